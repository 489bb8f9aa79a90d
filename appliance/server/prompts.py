"""A job's prompts as token ids, in the engine process (admit.py tokenizes a job's prompts with these, before its
set-up): a chat prompt templated (tools into the template, or the prompt: tool_prompt.py), a raw prompt with BOS,
token ids checked against the vocabulary; a text that cannot fit the model's context refused before it is encoded.

Ollama's num_ctx (Job.context_window, at most the model's context) bounds the prompt and the output together: a
chat prompt over the window loses its oldest messages (never a system message, never the last one), as Ollama's
chat does; a prompt still over it (a raw prompt, or a last message alone too long) is a 400: cutting tokens off
its start, as Ollama's runner does, would cut the chat template's own start.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.runtime.engine import PromptTooLong
from appliance.runtime.tokenizer import TextTooLong
from appliance.server import tool_prompt
from appliance.server.slots import Rejected, Slot

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine


def prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None, window: int | None = None) -> list[int]:
    """The prompt's token ids (chat: templated). `window` (num_ctx): a chat prompt loses its oldest messages until
    it leaves room for one token; a prompt still too long is a 400. `max_tokens` is the request's cap on generated
    tokens, named in the message for a prompt past the context (the tokenizer's bound is the context itself)."""
    ids = _prompt_ids(spec, slot, max_tokens)
    if window is None or len(ids) < window:
        return ids
    if spec.messages is not None:
        ids = _fit_messages(spec, slot, max_tokens, window)
    if len(ids) >= window:
        raise Rejected(
            p.Failed(
                400,
                f"the prompt is {len(ids)} tokens, which does not fit num_ctx {window} (with room for one token "
                "to generate); raise num_ctx or shorten the prompt",
                "num_ctx",
            )
        )
    return ids


def _fit_messages(spec: p.PromptSpec, slot: Slot, max_tokens: int | None, window: int) -> list[int]:
    """The prompt with the fewest oldest droppable messages (not system, not the last) left out that fits the
    window; binary search (the prompt shrinks as more are left out), each probe one templating."""
    messages = spec.messages or []
    droppable = [i for i, m in enumerate(messages[:-1]) if not (isinstance(m, dict) and m.get("role") == "system")]

    def without(k: int) -> list[int]:
        gone = set(droppable[:k])
        kept = [m for i, m in enumerate(messages) if i not in gone]
        return _prompt_ids(replace(spec, messages=kept), slot, max_tokens)

    if not droppable:
        return _prompt_ids(spec, slot, max_tokens)
    lo, hi = 1, len(droppable)  # without(hi) fits once checked; the least k in [lo, hi] that fits is wanted
    best = without(hi)
    if len(best) >= window:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        ids = without(mid)
        if len(ids) < window:
            hi, best = mid, ids
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
    # (static shapes: a prompt past max_prompt gets the engine's own message for that)
    if len(ids) >= limit and (engine.backend.max_prompt is None or len(ids) <= engine.backend.max_prompt):
        # refused now, not after the request's other prompts were tokenized too (in the engine's words)
        raise Rejected(p.Failed(400, str(PromptTooLong.over_context(len(ids), max_tokens, limit))))
    return ids


def echo_text(spec: p.PromptSpec, engine: Engine) -> str:
    if spec.text is not None:
        return spec.text
    assert spec.token_ids is not None, "a PromptSpec holds text, token ids or messages"
    return engine.tokenizer.decode(spec.token_ids)
