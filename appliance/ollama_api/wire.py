"""Engine events -> Ollama's wire format: NDJSON lines (`done: false` fragments, then one `done: true` line with
the counts and durations in nanoseconds), or one body for `stream: false`.

The OpenAI shapes (chat.py's ChatShape, completions.py's CompletionShape) still parse tool calls and reasoning per
chunk; this module only respells their deltas: `reasoning_content` -> `thinking`, a tool call (which ChatShape
streams as a delta naming it and one holding its whole arguments) -> one `{function: {name, arguments: <object>}}`.
A failure once the stream started is a last line `{"error": ...}` (Ollama's clients raise it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

from appliance.api.errors import ApiError
from appliance.api.generation import ClientGone, Generation
from appliance.ollama_api.requests import arguments_object

NS = 1_000_000_000
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama writes it."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


@dataclass
class Render:
    """One response's spelling: chat (`message`) or generate (`response`, `thinking`)."""

    model: str
    chat: bool
    keep_thinking: bool = True  # think: false on a reasoning model: the thought is dropped
    _pending: dict[int, str] = field(default_factory=dict)  # tool call index -> name, until its arguments come

    def body(self, content: str, thinking: str | None = None, calls: list | None = None) -> dict:
        body: dict = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if thinking and self.keep_thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            body["message"] = message
        else:
            body["response"] = content
            if thinking and self.keep_thinking:
                body["thinking"] = thinking
        return body

    def fragment(self, chunk: dict) -> dict | None:
        """One OpenAI stream delta -> an Ollama `done: false` line (None: nothing to send yet)."""
        if "delta" not in chunk:  # completions: {"text": ...}
            text = chunk.get("text") or ""
            return {**self.body(text), "done": False} if text else None
        delta = chunk["delta"]
        text, thought = delta.get("content") or "", delta.get("reasoning_content") or ""
        calls = []
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if fn.get("name") is not None:
                self._pending[call["index"]] = fn["name"]
            elif call["index"] in self._pending:
                name = self._pending.pop(call["index"])
                calls.append({"function": {"name": name, "arguments": arguments_object(fn.get("arguments", ""))}})
        logprobs = (chunk.get("logprobs") or {}).get("content")
        if not (text or (thought and self.keep_thinking) or calls or logprobs):
            return None
        return {**self.body(text, thought, calls), **({"logprobs": logprobs} if logprobs else {}), "done": False}

    def unary(self, body: dict) -> dict:
        """An OpenAI unary body -> the Ollama one (stats added by `final`)."""
        choice = body["choices"][0]
        if "message" not in choice:  # completions (generate with raw)
            return self.body(choice["text"])
        message = choice["message"]
        calls = [
            {"function": {"name": c["function"]["name"], "arguments": arguments_object(c["function"]["arguments"])}}
            for c in message.get("tool_calls") or ()
        ]
        out = self.body(message.get("content") or "", message.get("reasoning_content"), calls)
        if choice.get("logprobs"):  # chat's entries are Ollama's: token, logprob, bytes, top_logprobs
            out["logprobs"] = choice["logprobs"]["content"]
        return out

    def final(self, gen: Generation, body: dict | None = None) -> dict:
        """The `done: true` line (or the unary body): done_reason, counts and durations (ns)."""
        usage, timing = gen.usage(), gen.time_info()
        reason = gen.choices[0].finish_reason or "stop"
        return {
            **(body if body is not None else self.body("")),
            "done": True,
            "done_reason": DONE_REASONS.get(reason, reason),
            "total_duration": int(timing["total_time"] * NS),
            # the wait for an unloaded model's load (part of total_duration, as Ollama counts it)
            "load_duration": int(gen.accepted.load_seconds * NS) if gen.accepted else 0,
            "prompt_eval_count": usage["prompt_tokens"],
            "prompt_eval_duration": int(timing["prompt_time"] * NS),
            "eval_count": usage["completion_tokens"],
            "eval_duration": int(timing["completion_time"] * NS),
        }


class OllamaGeneration(Generation):
    """A Generation answered in Ollama's spelling."""

    def ollama_unary(self, render: Render) -> dict:
        return render.final(self, render.unary(self.unary()))

    def ndjson(self, render: Render) -> Iterator[str]:
        """Closing this generator early (client gone) closes the job, which cancels it engine-side."""
        try:
            for chunk in self.deltas():
                fragment = render.fragment(chunk)
                if fragment is not None:
                    yield line(fragment)
            yield line(render.final(self))
        except ApiError as exc:  # headers are sent: the error is the last line, as Ollama does
            yield line({"error": exc.message})
        except ClientGone:
            return
        finally:
            self.close()
