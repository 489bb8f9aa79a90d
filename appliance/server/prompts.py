"""A job's prompts as token ids, in the engine process (admit.py tokenizes a job's prompts with these, before its
set-up): a chat prompt templated (tools into the template, or the prompt: tool_prompt.py), a raw prompt with BOS,
token ids checked against the vocabulary; a text that cannot fit the model's context refused before it is encoded.

Ollama's num_ctx (Job.context_window, at most the model's context) bounds the prompt and the output together: a
chat prompt over the window loses its oldest messages (never a system message, never the last one), as Ollama's
chat does; a prompt still over it (a raw prompt, or a last message alone too long) is a 400: cutting tokens off
its start, as Ollama's runner does, would cut the chat template's own start.

Images (vision-language models): a chat prompt's images are counted at the length they expand to (from their
headers, each read once into a plan, before any is decoded), a message left out leaves its images out too, and only
then are the images that remain encoded (`with_media`: runtime/vision/ expands the template's placeholders from the
plans and computes the features). A refusal of the conversation names the client's field for it
(PromptSpec.conversation_field: Responses' `input`, chat's `messages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.runtime.engine import PromptTooLong
from appliance.runtime.tokenizer import TextTooLong
from appliance.server import tool_prompt
from appliance.server.slots import Rejected, Slot

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine
    from appliance.runtime.media import Media
    from appliance.runtime.vision.encoder import ImagePlan

CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a prompt past the context (clients match it)


def prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None, window: int | None = None) -> list[int]:
    """The prompt's token ids (chat: templated), fitted to `window` as `fitted` does."""
    return fitted(spec, slot, max_tokens, window)[0]


def fitted(
    spec: p.PromptSpec,
    slot: Slot,
    max_tokens: int | None = None,
    window: int | None = None,
    images: Sequence[ImagePlan] = (),
) -> tuple[list[int], p.PromptSpec, list[ImagePlan]]:
    """The prompt's token ids (chat: templated), the spec they are of and the plans of its images. `window`
    (num_ctx): a chat prompt loses its oldest messages, and their images, until it leaves room for one token; a
    prompt still too long is a 400. `max_tokens` is the request's cap on generated tokens, named in the message for
    a prompt past the context (the tokenizer's bound is the context itself). `images`: the plans of spec.images
    (`image_plans`), whose tokens beyond their placeholders count, so the length checked is the prompt's once its
    images are expanded."""
    ids, images = _prompt_ids(spec, slot, max_tokens), list(images)
    extra = _extra(images)
    if window is None:  # (a window is at most the context: fitting it is enough)
        if extra:
            _check_context(len(ids) + extra, spec, slot, max_tokens)  # refused here, before any image is encoded
        return ids, spec, images
    if len(ids) + extra < window:
        return ids, spec, images
    if spec.messages is not None:
        ids, spec, images = _fit_messages(spec, slot, max_tokens, window, images)
        extra = _extra(images)
    if len(ids) + extra >= window:
        raise Rejected(
            p.Failed(
                400,
                f"the prompt is {len(ids) + extra} tokens, which does not fit num_ctx {window} (with room for one "
                "token to generate); raise num_ctx or shorten the prompt",
                "num_ctx",
            )
        )
    return ids, spec, images


def image_parts(messages: Sequence[object]) -> list[int]:
    """The index of the message each image belongs to, in order: the {"type": "image"} parts of list contents."""
    owners = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            owners += [i for part in content if isinstance(part, dict) and part.get("type") == "image"]
    return owners


def image_plans(spec: p.PromptSpec, engine: Engine, max_pixels: int) -> list[ImagePlan]:
    """Each image of the prompt as its header says, read once (ImageRejected for one past `max_pixels` or not an
    accepted format): the tokens it becomes, which `fitted` counts and `with_media` expands."""
    if not spec.images or engine.vision is None:
        return []
    return engine.vision.plans(spec.images, max_pixels)


def with_media(
    ids: list[int], images: Sequence[ImagePlan], engine: Engine, max_pixels: int, scope: str = ""
) -> tuple[list[int], Media | None]:
    """The prompt's ids with its images (their plans, as `fitted` kept them) expanded, and their Media (features
    encoded here, in the job's thread, off the engine thread, or found in the vision feature cache under `scope`);
    (ids, None) for a prompt without images."""
    if not images or engine.vision is None:
        return ids, None
    return engine.vision.prepare(ids, images, max_pixels, scope)


def _fit_messages(
    spec: p.PromptSpec, slot: Slot, max_tokens: int | None, window: int, plans: Sequence[ImagePlan]
) -> tuple[list[int], p.PromptSpec, list[ImagePlan]]:
    """The prompt with the fewest oldest droppable messages (not system, not the last) left out that fits the
    window, with the images of those left out, and the plans of the images it keeps; binary search (the prompt
    shrinks as more are left out), each probe one templating."""
    messages = spec.messages or []
    droppable = [i for i, m in enumerate(messages[:-1]) if not (isinstance(m, dict) and m.get("role") == "system")]
    owners = image_parts(messages)

    def without(k: int) -> tuple[list[int], p.PromptSpec, list[ImagePlan]]:
        gone = set(droppable[:k])
        kept = [m for i, m in enumerate(messages) if i not in gone]
        images = [data for data, i in zip(spec.images or [], owners) if i not in gone]
        fields = [field for field, i in zip(spec.image_fields or [], owners) if i not in gone]
        trimmed = replace(
            spec,
            messages=kept,
            images=images if spec.images is not None else None,
            image_fields=fields if spec.image_fields is not None else None,
        )
        planned = [plan for plan, i in zip(plans, owners) if i not in gone]
        return _prompt_ids(trimmed, slot, max_tokens), trimmed, planned

    if not droppable:
        return _prompt_ids(spec, slot, max_tokens), spec, list(plans)
    lo, hi = 1, len(droppable)  # without(hi) fits once checked; the least k in [lo, hi] that fits is wanted
    best = without(hi)
    if len(best[0]) + _extra(best[2]) >= window:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        probe = without(mid)
        if len(probe[0]) + _extra(probe[2]) < window:
            hi, best = mid, probe
        else:
            lo = mid + 1
    return best


def _prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None) -> list[int]:
    engine = slot.engine
    assert engine is not None, "submit checked it"
    tok = engine.tokenizer
    limit = engine.max_context  # text that cannot be this many tokens is refused before it is encoded
    if spec.token_ids is not None:
        vocab = engine.manifest.vocab_size
        bad = next((t for t in spec.token_ids if t >= vocab), None)
        if bad is not None:
            raise Rejected(
                p.Failed(400, f"prompt token id {bad} is out of the vocabulary range [0, {vocab})", "prompt")
            )
        return list(spec.token_ids)
    if spec.messages is not None:
        try:
            # the template spells out BOS and friends; special-token text in content stays text. Tools go to
            # the template, or into the prompt when it has no use for them (appliance/server/tool_prompt.py)
            messages, kwargs = tool_prompt.chat_inputs(spec.messages, spec.tools, tok.chat_template, slot.parsers()[0])
            if spec.thinking is not None:  # a template without the switch ignores it
                kwargs["enable_thinking"] = spec.thinking
            ids = tok.encode_chat(messages, add_generation_prompt=True, token_budget=limit, **kwargs)
        except Exception as exc:  # no template, a broken one, or its raise_exception (roles must alternate)
            raise Rejected(p.Failed(400, str(exc), spec.conversation_field)) from None
    else:
        assert spec.text is not None, "a PromptSpec holds text, token ids or messages"
        try:  # as OVMS: a raw prompt gets BOS if the model has one
            ids = tok.encode(spec.text, add_special_tokens=True, token_budget=limit)
        except TextTooLong as exc:
            raise Rejected(
                p.Failed(400, f"the prompt cannot fit the model max length: {limit}: {exc}", "prompt")
            ) from None
    if not ids:
        raise Rejected(p.Failed(400, "prompt is empty after tokenization", "prompt"))
    _check_context(len(ids), spec, slot, max_tokens)
    return ids


def _extra(images: Sequence[ImagePlan]) -> int:
    """The tokens the images add to the prompt beyond their placeholders (one token each)."""
    return sum(image.tokens - 1 for image in images)


def _check_context(length: int, spec: p.PromptSpec, slot: Slot, max_tokens: int | None) -> None:
    """400 for a prompt of `length` tokens past the model's context, refused now, not after the request's other
    prompts were tokenized (or its images encoded) too, in the engine's words, naming the prompt's field with
    OpenAI's code for it. (Static shapes: a prompt past max_prompt gets the engine's own message for that.)"""
    engine = slot.engine
    assert engine is not None, "submit checked it"
    limit = engine.max_context
    if length >= limit and (engine.backend.max_prompt is None or length <= engine.backend.max_prompt):
        message = str(PromptTooLong.over_context(length, max_tokens, limit))
        raise Rejected(p.Failed(400, message, spec.prompt_field, CONTEXT_EXCEEDED))


def echo_text(spec: p.PromptSpec, engine: Engine) -> str:
    if spec.text is not None:
        return spec.text
    assert spec.token_ids is not None, "a PromptSpec holds text, token ids or messages"
    return engine.tokenizer.decode(spec.token_ids)
