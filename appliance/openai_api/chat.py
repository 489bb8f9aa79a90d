"""`/v3/chat/completions`, the adapter of OpenAI's chat API: its body -> a `ChatRequest` (the rules across its
fields; the fields themselves are fields.CHAT), the job it makes (messages -> the model's chat template,
engine-side), and how its choices and chunks are spelled.

Tools (tool_calls.py): tool_choice "none" passes no tools and parses nothing; "auto" parses the free output;
"required" and a named tool constrain it with a Lark grammar of calls whose arguments follow each tool's parameters
schema; a response_format beside them shapes a later turn's text (`chat_job`). Reasoning (reasoning.py): with the
engine's reasoning parser on, a leading thought goes to `reasoning_content` and `reasoning`; tool calls are parsed
in the rest only. The parsers are per choice and incremental, so a stream's deltas add up to the unary message; a
call is streamed as a delta naming it (arguments "") and one holding its whole arguments, which therefore always
concatenate to valid JSON, except in the one call max_tokens cut where only calls may be (tool_choice required /
named): it comes last, with the arguments written so far and finish_reason "length", as OpenAI returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.api.errors import invalid
from appliance.api.generation import Choice
from appliance.api.reasoning import ReasoningParser, split_reasoning
from appliance.api.request import DEFAULT_TOOL_PARSER, ChatRequest, EdgeOptions, ToolChoice
from appliance.api.table import read_body
from appliance.api.tool_calls import (
    ToolCall,
    ToolCallParser,
    new_call_id,
    parse_tool_calls,
)
from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api.validation import OVMS, Dialect, check_queue, generation
from appliance.outputs import TokenLogprob


def parse_chat(body: Any, limits: Limits = Limits(), dialect: Dialect = OVMS) -> ChatRequest:
    values, unknown = read_body(body, F.CHAT, limits)
    # OpenAI renamed max_tokens to max_completion_tokens for chat; the newer name wins when both are given (both
    # are checked: an invalid value is an error even where the other one wins): the later field in the table
    edge, sampling = generation(values, F.CHAT, dialect)
    logprobs, top = values["logprobs"], values["top_logprobs"]
    if top is not None and not logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    if logprobs:
        sampling["logprobs"] = top or 0
    tools = values["tools"] or ()
    choice: ToolChoice
    choice, name = values["tool_choice"] or ("auto", None)
    if values["tool_choice"] is not None and not tools:
        raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names function {name!r}, which is not one of tools", "tool_choice")
    check_queue(1, edge["n"], sampling, limits)
    return ChatRequest(
        EdgeOptions(**edge, unknown=unknown),
        sampling,
        values["messages"],
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=values["parallel_tool_calls"] is not False,
    )


def _entry(token: str, logprob: float | None) -> dict:  # None only for a first prompt token
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_object(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_entry(e.token, e.logprob), "top_logprobs": [_entry(t, lp) for _, t, lp in e.top]} for e in entries
        ]
    }


@dataclass
class _Parsing:
    """One choice's stream parsers."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    calls: int = 0
    cut: bool = False  # a call max_tokens cut was sent: finish_reason stays "length"


@dataclass
class ChatShape:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    tool_parser: str | None = None  # the call format to parse; None: no tools in play (or tool_choice none)
    reasoning: bool = False  # the engine's reasoning parser is "think"
    # tool_choice required / named: the grammar lets the output be calls only, so text outside complete calls is a
    # call that max_tokens cut (or the separator before it): never content; a cut call comes back as far as it got
    # (its name and the start of its arguments), with finish_reason "length", as OpenAI returns it
    calls_only: bool = False
    _parsing: dict[int, _Parsing] = field(default_factory=dict)

    @classmethod
    def for_request(cls, req: ChatRequest, tool_parser: str, reasoning_parser: str) -> ChatShape:
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        return cls(
            (tool_parser or DEFAULT_TOOL_PARSER) if parse_tools else None,
            reasoning_parser == "think",
            parse_tools and req.tool_choice in ("required", "named"),
        )

    # ---- unary
    def choice(self, c: Choice, logprobs: bool) -> dict:
        reasoning, content = split_reasoning(c.text) if self.reasoning else (None, c.text)
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            cut = self.calls_only and c.finish_reason == "length"
            content, calls = parse_tool_calls(content, self.tool_parser, cut)
            content = "" if self.calls_only else content
        empty_is_null = calls or self.reasoning or self.calls_only
        message: dict = {"role": "assistant", "content": (content or None) if empty_is_null else content}
        if self.reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_openai(new_call_id()) for call in calls]
        return {
            "index": c.index,
            "message": message,
            "finish_reason": "tool_calls" if calls and not any(call.cut for call in calls) else c.finish_reason,
            "logprobs": logprobs_object(c.logprobs) if logprobs else None,
        }

    # ---- streaming
    def opening(self, c: Choice) -> dict:
        """OVMS 2026.1+: the first chunk, right after prefill, only names the role."""
        return {
            "index": c.index,
            "delta": {"role": "assistant", "content": None},
            "finish_reason": None,
            "logprobs": None,
        }

    def delta(self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> list[dict]:
        if self.tool_parser is None and not self.reasoning:
            return [self._chunk(c, {"content": text} if text else {}, logprobs, finish_reason)]
        st = self._parsing.setdefault(
            c.index,
            _Parsing(
                ReasoningParser() if self.reasoning else None,
                ToolCallParser(self.tool_parser) if self.tool_parser else None,
            ),
        )
        thought, answer = st.reasoning.feed(text) if st.reasoning else ("", text)
        if finish_reason and st.reasoning:
            more_thought, more_answer = st.reasoning.finish()
            thought, answer = thought + more_thought, answer + more_answer
        events = st.tools.feed(answer) if st.tools else [("content", answer)]
        if finish_reason and st.tools:
            events += st.tools.finish(self.calls_only and finish_reason == "length")
        deltas: list[dict] = [{"reasoning_content": thought, "reasoning": thought}] if thought else []
        for kind, value in events:
            if kind == "content":
                if not value or self.calls_only:
                    continue
                if deltas and set(deltas[-1]) == {"content"}:
                    deltas[-1]["content"] += value
                else:
                    deltas.append({"content": value})
            else:
                assert isinstance(value, ToolCall)
                k, st.calls, st.cut = st.calls, st.calls + 1, st.cut or value.cut
                head = {"index": k, "id": new_call_id(), "type": "function"}
                deltas.append({"tool_calls": [{**head, "function": {"name": value.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": value.arguments}}]})
        if not deltas and (logprobs or finish_reason):
            deltas = [{}]
        if finish_reason and st.calls and not st.cut:
            finish_reason = "tool_calls"
        return [
            self._chunk(c, d, logprobs if i == 0 else None, finish_reason if i == len(deltas) - 1 else None)
            for i, d in enumerate(deltas)
        ]

    @staticmethod
    def _chunk(c: Choice, delta: dict, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {
            "index": c.index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": logprobs_object(logprobs) if logprobs is not None else None,
        }
