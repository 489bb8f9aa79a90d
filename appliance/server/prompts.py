"""A job's prompts as token ids, in the engine process (admit.py tokenizes a job's prompts with these, before its
set-up): a chat prompt templated (tools into the template, or the prompt: tool_prompt.py), a raw prompt with BOS,
token ids checked against the vocabulary; a text that cannot fit the model's context refused before it is encoded.

Ollama's num_ctx (Job.context_window, at most the model's context) bounds the prompt and the output together: a
chat prompt over the window loses its oldest messages (never a system message, never the last one), as Ollama's
chat does; a prompt still over it (a raw prompt, or a last message alone too long) is a 400: cutting tokens off
its start, as Ollama's runner does, would cut the chat template's own start.

Images (vision-language models): a chat prompt's images are counted at the length they expand to (from their
headers, before any is decoded), a message left out leaves its images out too, and only then are the images that
remain encoded (`with_media`: runtime/vision/ expands the template's placeholders and computes the features).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.runtime.engine import PromptTooLong
from appliance.runtime.tokenizer import TextTooLong
from appliance.runtime.vision.errors import image_at
from appliance.server import tool_prompt
from appliance.server.slots import Rejected, Slot

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine
    from appliance.runtime.media import Media


def prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None, window: int | None = None) -> list[int]:
    """The prompt's token ids (chat: templated), fitted to `window` as `fitted` does."""
    return fitted(spec, slot, max_tokens, window)[0]


def fitted(
    spec: p.PromptSpec,
    slot: Slot,
    max_tokens: int | None = None,
    window: int | None = None,
    extra_tokens: Sequence[int] = (),
) -> tuple[list[int], p.PromptSpec]:
    """The prompt's token ids (chat: templated) and the spec they are of. `window` (num_ctx): a chat prompt loses its
    oldest messages, and their images, until it leaves room for one token; a prompt still too long is a 400.
    `max_tokens` is the request's cap on generated tokens, named in the message for a prompt past the context (the
    tokenizer's bound is the context itself). `extra_tokens`: the tokens each of spec.images adds to the prompt
    beyond its placeholder (`image_tokens`), so the length checked is the prompt's once its images are expanded."""
    ids = _prompt_ids(spec, slot, max_tokens)
    extra = sum(extra_tokens)
    if window is None:  # (a window is at most the context: fitting it is enough)
        if extra:
            _check_context(len(ids) + extra, slot, max_tokens)  # refused here, before any image is encoded
        return ids, spec
    if len(ids) + extra < window:
        return ids, spec
    if spec.messages is not None:
        ids, spec, extra = _fit_messages(spec, slot, max_tokens, window, extra_tokens)
    if len(ids) + extra >= window:
        raise Rejected(
            p.Failed(
                400,
                f"the prompt is {len(ids) + extra} tokens, which does not fit num_ctx {window} (with room for one "
                "token to generate); raise num_ctx or shorten the prompt",
                "num_ctx",
            )
        )
    return ids, spec


def image_parts(messages: Sequence[object]) -> list[int]:
    """The index of the message each image belongs to, in order: the {"type": "image"} parts of list contents."""
    owners = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            owners += [i for part in content if isinstance(part, dict) and part.get("type") == "image"]
    return owners


def image_tokens(spec: p.PromptSpec, engine: Engine, max_pixels: int) -> list[int]:
    """The tokens each image of the prompt adds beyond its placeholder token, from its header (ImageRejected for one
    past `max_pixels` or not an accepted format)."""
    if not spec.images or engine.vision is None:
        return []
    tokens = []
    for i, data in enumerate(spec.images):
        with image_at(i):
            tokens.append(engine.vision.num_tokens(data, max_pixels) - 1)
    return tokens


def with_media(
    ids: list[int], spec: p.PromptSpec, engine: Engine, max_pixels: int, scope: str = ""
) -> tuple[list[int], Media | None]:
    """The prompt's ids with its images expanded, and their Media (features encoded here, in the job's thread, off
    the engine thread, or found in the vision feature cache under `scope`); (ids, None) for a prompt without
    images."""
    if not spec.images or engine.vision is None:
        return ids, None
    return engine.vision.prepare(ids, spec.images, max_pixels, scope)


def _fit_messages(
    spec: p.PromptSpec, slot: Slot, max_tokens: int | None, window: int, extra_tokens: Sequence[int]
) -> tuple[list[int], p.PromptSpec, int]:
    """The prompt with the fewest oldest droppable messages (not system, not the last) left out that fits the
    window, with the images of those left out, and its images' extra tokens; binary search (the prompt shrinks as
    more are left out), each probe one templating."""
    messages = spec.messages or []
    droppable = [i for i, m in enumerate(messages[:-1]) if not (isinstance(m, dict) and m.get("role") == "system")]
    owners = image_parts(messages)

    def without(k: int) -> tuple[list[int], p.PromptSpec, int]:
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
        extra = sum(n for n, i in zip(extra_tokens, owners) if i not in gone)
        return _prompt_ids(trimmed, slot, max_tokens), trimmed, extra

    if not droppable:
        return _prompt_ids(spec, slot, max_tokens), spec, sum(extra_tokens)
    lo, hi = 1, len(droppable)  # without(hi) fits once checked; the least k in [lo, hi] that fits is wanted
    best = without(hi)
    if len(best[0]) + best[2] >= window:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        probe = without(mid)
        if len(probe[0]) + probe[2] < window:
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
            raise Rejected(p.Failed(400, str(exc), "messages")) from None
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
    _check_context(len(ids), slot, max_tokens)
    return ids


def _check_context(length: int, slot: Slot, max_tokens: int | None) -> None:
    """400 for a prompt of `length` tokens past the model's context, refused now, not after the request's other
    prompts were tokenized (or its images encoded) too, in the engine's words. (Static shapes: a prompt past
    max_prompt gets the engine's own message for that.)"""
    engine = slot.engine
    assert engine is not None, "submit checked it"
    limit = engine.max_context
    if length >= limit and (engine.backend.max_prompt is None or length <= engine.backend.max_prompt):
        raise Rejected(p.Failed(400, str(PromptTooLong.over_context(length, max_tokens, limit))))


def echo_text(spec: p.PromptSpec, engine: Engine) -> str:
    if spec.text is not None:
        return spec.text
    assert spec.token_ids is not None, "a PromptSpec holds text, token ids or messages"
    return engine.tokenizer.decode(spec.token_ids)
