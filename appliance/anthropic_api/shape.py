"""One generation as an Anthropic message: the engine's text -> content blocks (`thinking`, `text`, `tool_use`) and
the stream events that build them.

The same parsers as the chat adapter, in the same order (appliance/openai_api/chat.py): the reasoning parser
splits a leading `<think>` block off, the model's tool-call parser finds calls in the rest. Their events become
blocks here: a block opens at its first piece and closes when a piece of another kind comes or the output ends,
so a stream's `content_block_*` events add up to exactly the unary `content` (the unary path feeds the same
machine, once). A call is one `tool_use` block whose input is sent whole, as one `input_json_delta`: the parser
emits a call only once its JSON is complete, so `partial_json` always concatenates to valid JSON.

Stop sequences: Anthropic leaves the matched stop sequence out of the text and names it in `stop_sequence`. The
engine is asked to keep it (include_stop_str_in_output) and, since it holds back anything that may start a stop
string until decided, a choice that ends on one has it whole at the end of its last chunk: cut here, named in
`stop_sequence`. Without stop sequences the engine's text is taken as is.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from appliance.api.generation import Choice
from appliance.api.reasoning import ReasoningParser
from appliance.api.tool_calls import ToolCall, ToolCallParser
from appliance.outputs import TokenLogprob

THINKING = {"type": "thinking", "thinking": "", "signature": ""}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@dataclass
class Blocks:
    """The content blocks of one answer, built piece by piece; each step returns the stream events it makes."""

    content: list[dict] = field(default_factory=list)
    open_kind: str | None = None  # the kind of content[-1] while it is open
    parts: list[str] = field(default_factory=list)  # the open text / thinking block's pieces, joined at its close

    def _close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        if self.open_kind in ("text", "thinking"):
            self.content[-1][self.open_kind] = "".join(self.parts)
        self.parts.clear()
        self.open_kind = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _start(self, block: dict) -> list[dict]:
        events = self._close()
        self.content.append(dict(block))
        self.open_kind = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else {**block, block["type"]: ""}
        events.append({"type": "content_block_start", "index": len(self.content) - 1, "content_block": start})
        return events

    def piece(self, kind: str, text: str) -> list[dict]:
        """More `text` (a "text" or "thinking" piece)."""
        if not text:
            return []
        if self.open_kind == kind:
            events = []
        else:  # a thinking block's signature: there is none to give (nothing signs a local model's thought)
            events = self._start({"type": "text", "text": ""} if kind == "text" else THINKING)
        self.parts.append(text)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return events

    def call(self, call: ToolCall) -> list[dict]:
        block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": json.loads(call.arguments)}
        events = self._start(block)
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return events + self._close()

    def finish(self) -> list[dict]:
        return self._close()


@dataclass
class MessageShape:
    """The `Shape` (appliance/api/generation.py) of a Messages answer: `delta` returns Anthropic stream events
    (content_block_*), `choice` the message's content and stop fields. One choice: the Messages API has no `n`."""

    object = "message"
    chunk_object = "message"
    id_prefix = "msg_"
    tool_parser: str | None = None  # the call format to parse; None: no tools in play (tool_choice none)
    reasoning: bool = False  # the model writes a `<think>` block (its reasoning parser is "think")
    thinking: bool = False  # the request enabled thinking: the thought is a `thinking` block (else dropped)
    calls_only: bool = False  # tool_choice any / tool: the grammar allows calls only; other text is a cut call
    one_call: bool = False  # disable_parallel_tool_use: calls after the first are dropped
    stop_sequences: tuple[str, ...] = ()
    blocks: Blocks = field(default_factory=Blocks)
    stop_sequence: str | None = None
    calls: int = 0
    _reasoning: ReasoningParser | None = None
    _tools: ToolCallParser | None = None

    def __post_init__(self) -> None:
        self._reasoning = ReasoningParser() if self.reasoning else None
        self._tools = ToolCallParser(self.tool_parser) if self.tool_parser else None

    def stop_reason(self, finish_reason: str | None) -> str:
        if self.calls:
            return "tool_use"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return STOP_REASONS.get(finish_reason or "stop", "end_turn")

    # ---- Shape
    def opening(self, c: Choice) -> dict:
        """The prefill is done: a `ping` (message_start is the route's, with the usage of the Accepted event)."""
        return {"type": "ping"}

    def delta(self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> list[dict]:
        if finish_reason == "stop":
            ends = [s for s in self.stop_sequences if text.endswith(s)]
            if ends:
                self.stop_sequence = max(ends, key=len)
                text = text[: len(text) - len(self.stop_sequence)]
        thought, answer = self._reasoning.feed(text) if self._reasoning else ("", text)
        if finish_reason and self._reasoning:
            more_thought, more_answer = self._reasoning.finish()
            thought, answer = thought + more_thought, answer + more_answer
        events = self.blocks.piece("thinking", thought) if self.thinking else []
        pieces = self._tools.feed(answer) if self._tools else [("content", answer)]
        if finish_reason and self._tools:
            pieces += self._tools.finish()
        for kind, value in pieces:
            if kind == "content":
                assert isinstance(value, str)
                if not self.calls_only:
                    events += self.blocks.piece("text", value)
            else:
                assert isinstance(value, ToolCall)
                if self.one_call and self.calls:
                    continue
                self.calls += 1
                events += self.blocks.call(value)
        if finish_reason:
            events += self.blocks.finish()
        return events

    def choice(self, c: Choice, logprobs: bool) -> dict:
        return {
            "content": self.blocks.content,
            "stop_reason": self.stop_reason(c.finish_reason),
            "stop_sequence": self.stop_sequence,
        }
