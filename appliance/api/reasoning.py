"""Reasoning models: the `<think>...</think>` block moved out of the answer.

A model whose chat template mentions `<think>` (Qwen3, DeepSeek-R1 distills; `--reasoning-parser think` forces it)
writes its thought first. The thought goes to `reasoning_content` (OVMS's name) and `reasoning` (vLLM's newer one),
the rest to `content` (and tool parsing sees only that rest). A thought cut by max_tokens stays reasoning: content
is then empty, never the half thought. Incremental, like the tool parsers: a tag split across chunks is held back,
so a stream gives the same parts as the unary answer. Only a thought at the start of the output counts (whitespace
before it aside); `<think>` later in the text is content.
"""

from __future__ import annotations

PARSERS = ("none", "think")  # `--reasoning-parser` after auto is resolved; appliance/server/tool_prompt.py picks one
OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """feed(text) / finish() -> (reasoning, content) text parts of what can be told apart so far."""

    def __init__(self) -> None:
        self.state = "start"  # start (before the first non-space text) | thinking | answer
        self.buf = ""
        self.seen = False  # the output opened a thought

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(OPEN):
                self.state, self.buf, self.seen = "thinking", stripped[len(OPEN) :], True
            elif not final and OPEN.startswith(stripped):  # whitespace, or a prefix of the tag: wait
                return "", ""
            else:
                self.state = "answer"
        if self.state == "thinking":
            at = self.buf.find(CLOSE)
            if at < 0:
                keep = 0 if final else _held(self.buf, CLOSE)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(CLOSE) :].lstrip(), "answer-start"
        if self.state == "answer-start":  # whitespace after </think> is layout, dropped
            self.buf = self.buf.lstrip()
            if not self.buf:
                return reasoning, ""
            self.state = "answer"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Unary: (reasoning or None when the output has no thought, content)."""
    p = ReasoningParser()
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.seen else None), c1 + c2
