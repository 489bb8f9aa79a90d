"""`/v3/responses`, the adapter of OpenAI's Responses API onto the one internal chat request.

A Responses body is translated into a chat completions body (input items -> chat messages, flat function tools ->
chat's nested ones, `text.format` -> `response_format`, `max_output_tokens` -> `max_tokens`) and then read by chat's
own `parse_chat`: every bound, message and rule of chat applies unchanged (messages count, tools count, schema
size, grammar compilation). What the Responses API has and chat lacks is refused here with a 400 when it would
change the output (`background`, non-function tools, files and an `input_image`'s `file_id`, `top_logprobs`,
`max_tool_calls`, `truncation: auto`, `conversation`, `prompt`) and accepted when it cannot (`metadata`, `user`,
`include`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `text.verbosity`); any other field is a 400, so
a client never silently gets an output its request did not ask for. A user message's `input_image` parts are read
here (data URLs, or a listed host's URL: appliance/api/images.py, image_fetch.py), so every refusal of an image,
the engine's included, names its own field (`input[0].content[1].image_url`, as OpenAI's `param`), not the chat
message it becomes; the conversation kept for `previous_response_id` holds them as chat's `image_url` parts. The
engine's refusals of the conversation as a whole (its chat template's error, a text too long to encode, an image
refusal about no one image) name `input` (`CONVERSATION`, which the job's PromptSpec carries), as the worker's do.

`reasoning`: `effort` is the model's thinking switch (none / minimal off, low and up on, absent: the template's
default), passed with the prompt (PromptSpec.thinking) to the chat template as `enable_thinking`, Qwen3's variable;
with the model's reasoning parser on (`think`), its leading thought comes out as a `reasoning` item. `summary` is
accepted and has no effect (nothing summarizes a thought). On a model without a reasoning parser, `reasoning`
asking for anything is a 400, as OpenAI answers a reasoning field for a model that does not reason.
`frequency_penalty` / `presence_penalty` (not OpenAI's Responses fields, but vLLM's and OVMS's chat ones) go to
chat as they are. Every count and length of the fields read here is a field of the limits table (`content_parts`,
`id_chars`, `metadata*`), the rest chat's.

Output: the engine's chunks go through chat's `ChatShape` parsers (reasoning, tool calls), whose deltas
`ResponseEvents` turns into Responses items and streaming events (one path for unary and streaming, so the stream's
deltas always add up to the unary output). State (`store`, `previous_response_id`) lives in response_store.py.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from appliance.api.errors import ApiError, invalid
from appliance.api.images import ImageCount
from appliance.api.parsers import is_int, linked_image
from appliance.api.request import ChatRequest
from appliance.api.table import read_body
from appliance.limits import Limits
from appliance.openai_api.chat import parse_chat

# Fields read here; the rest of a body is refused (ACCEPTED_IGNORED: read and dropped).
FIELDS = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "stream",
    "store",
    "previous_response_id",
    "truncation",
    "background",
    "top_logprobs",
    "max_tool_calls",
)
ACCEPTED_IGNORED = ("metadata", "user", "include", "service_tier", "prompt_cache_key", "safety_identifier")
IDENTIFIERS = ("user", "safety_identifier", "prompt_cache_key")  # accepted, ignored strings: bounded by id_chars
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning.effort values
THINKING_OFF = ("none", "minimal")  # the efforts that turn the model's thinking off
SUMMARIES = ("auto", "concise", "detailed", "none")
CONVERSATION = "input"  # the field that holds the conversation (chat's `messages`): what its refusals name
CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": CONVERSATION, "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    body: dict  # the client's body (fields echoed in the response object)
    input_items: list[dict]  # this request's input, as items with ids (GET .../input_items)
    messages: list[dict]  # the conversation (previous responses', then this input's), without the instructions
    store: bool
    previous_response_id: str | None
    reasoning: dict | None
    thinking: bool | None = None  # the template's thinking switch (reasoning.effort); None: the template's default


def _parts(content: Any, where: str, limits: Limits, images: ImageCount | None) -> list[dict]:
    """A message's content as chat parts: a string, or parts of text (input_text / output_text / refusal) and, where
    `images` counts them, input_image: its image_url a data URL or a listed host's URL, `detail` as chat's
    image_url.detail (parsers.linked_image), read here at its own field; a `file_id` names a file this server does
    not store: 400. An image part is chat's Image part, with its `image_url` object beside it for the store."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or an array of input_text parts", "input")
    if len(content) > limits.content_parts:
        raise invalid(f"{where}: content must have no more than {limits.content_parts} parts", "input")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}: each content part must be an object", "input")
        kind = part.get("type")
        at = f"{where}.content[{j}]"
        if kind == "input_image" and images is not None:
            images.next(at)
            if part.get("file_id") is not None:
                raise invalid(
                    f"{at}.file_id: this server stores no files (there is no Files API here); send the image in "
                    "image_url as a data URL",
                    f"{at}.file_id",
                )
            url, detail = part.get("image_url"), part.get("detail")
            image = linked_image(url, detail, f"{at}.image_url", f"{at}.detail", limits)
            parts.append({**image, "image_url": {"url": url, "detail": detail or "auto"}})
            continue
        if kind not in TEXT_PARTS:
            allowed = "input_text, output_text, input_image" if images is not None else "input_text, output_text"
            raise invalid(f"{where}: content part type {kind!r} is not supported (parts: {allowed})", "input")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}: a {kind} part needs a string text", "input")
        parts.append({"type": "text", "text": text})
    return parts


def _text_of(content: Any, where: str, limits: Limits) -> str:
    """A content without images: its text parts joined."""
    return "\n".join(p["text"] for p in _parts(content, where, limits, None))


def _stored(message: dict) -> dict:
    """A chat message as the store keeps it (JSON): an image part as chat's `image_url` part."""
    content = message["content"]
    if not isinstance(content, list):
        return message
    parts = [{"type": "image_url", "image_url": p["image_url"]} if p["type"] == "image" else p for p in content]
    return {**message, "content": parts}


def _image_count(messages: list[dict]) -> int:
    """The images of a stored conversation (its image_url parts)."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image_url"
    )


def _item_messages(items: list, limits: Limits, images: ImageCount) -> tuple[list[dict], list[dict]]:
    """Input items -> (chat messages, the items as stored: with ids and content as parts)."""
    if len(items) > limits.messages:
        raise invalid(f"input must have no more than {limits.messages} items", "input")
    messages: list[dict] = []
    stored: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} is not an object", "input")
        for key in ("id", "call_id"):
            if isinstance(item.get(key), str) and len(item[key]) > limits.id_chars:
                raise invalid(f"{where}: {key} must be at most {limits.id_chars} characters", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise invalid(f"{where}: role must be user, system, developer or assistant", "input")
            parts = _parts(item.get("content"), where, limits, images if role == "user" else None)
            text = "\n".join(p["text"] for p in parts if p["type"] == "text")
            if all(p["type"] == "text" for p in parts):
                messages.append({"role": role, "content": text})
                part = "output_text" if role == "assistant" else "input_text"
                content = [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
            else:  # images: chat's parts in order (its parser reads them); stored as the client gave them
                messages.append({"role": role, "content": parts})
                content = [
                    {"type": "input_text", "text": p["text"]}
                    if p["type"] == "text"
                    else {
                        "type": "input_image",
                        "image_url": p["image_url"]["url"],
                        "detail": p["image_url"]["detail"],
                    }
                    for p in parts
                ]
            stored.append(
                {
                    "type": "message",
                    "id": item.get("id") if isinstance(item.get("id"), str) else new_id("msg"),
                    "role": item["role"],
                    "status": "completed",
                    "content": content,
                }
            )
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise invalid(f"{where}: a function_call needs string call_id, name and arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            stored.append(
                {
                    "type": "function_call",
                    "id": item.get("id") if isinstance(item.get("id"), str) else new_id("fc"),
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise invalid(f"{where}: a function_call_output needs a string call_id", "input")
            text = _text_of(output, where, limits)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            stored.append(
                {
                    "type": "function_call_output",
                    "id": item.get("id") if isinstance(item.get("id"), str) else new_id("fco"),
                    "call_id": call_id,
                    "output": text,
                    "status": "completed",
                }
            )
        elif kind == "reasoning":  # a previous output handed back: the template drops past thoughts anyway
            continue
        else:
            raise invalid(
                f"{where}: item type {kind!r} is not supported (message, function_call, function_call_output, "
                "reasoning)",
                "input",
            )
    return messages, stored


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise invalid("tools is not an array", "tools")
    out = []
    for tool in value:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tool type {kind!r} is not supported: only function tools", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if value in ("none", "auto", "required"):
        return value
    raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")


def _text_format(value: Any) -> dict | None:
    if not isinstance(value, dict):
        raise invalid("text must be an object", "text")
    unknown = set(value) - {"format", "verbosity"}
    if unknown:
        raise invalid(f"text.{sorted(unknown)[0]} is not supported", "text")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type must be text, json_object or json_schema", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise invalid("text.format.schema must be a JSON schema (an object)", "text.format")
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def check_id(value: Any, param: str, limits: Limits) -> str:
    if not isinstance(value, str):
        raise invalid(f"{param} must be a string", param)
    if len(value) > limits.id_chars:
        raise invalid(f"{param} must be at most {limits.id_chars} characters", param)
    return value


def _metadata(value: Any, limits: Limits) -> None:
    """OpenAI's metadata: string pairs, bounded in number and length (the limits table has OpenAI's)."""
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or len(value) > limits.metadata
        or not all(isinstance(k, str) and len(k) <= limits.metadata_key_chars for k in value)
        or not all(isinstance(v, str) and len(v) <= limits.metadata_chars for v in value.values())
    ):
        raise invalid(
            f"metadata must be at most {limits.metadata} string pairs (keys {limits.metadata_key_chars}, values "
            f"{limits.metadata_chars} characters)",
            "metadata",
        )


def _reasoning(value: Any, reasoning_parser: str) -> tuple[dict | None, bool | None]:
    """`reasoning` -> (itself, the thinking switch). `effort` none / minimal: thinking off; low and up: on; omitted:
    the template's default. Without a reasoning parser nothing can think: anything but `none` is a 400, as
    OpenAI answers a reasoning field sent to a model that does not reason."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise invalid("reasoning must be an object with effort and summary", "reasoning")
    effort = value.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None and value[key] not in SUMMARIES:
            raise invalid(f"reasoning.{key} must be one of {', '.join(SUMMARIES)}", f"reasoning.{key}")
    wants = any(value.get(k) not in (None, "none") for k in ("effort", "summary", "generate_summary"))
    if wants and reasoning_parser != "think":
        raise invalid(
            "reasoning is not supported by this model: it has no reasoning parser (--reasoning-parser)", "reasoning"
        )
    return value, None if effort is None or reasoning_parser != "think" else effort not in THINKING_OFF


def parse_responses(
    body: Any, limits: Limits, previous: list[dict] | None = None, reasoning_parser: str = "none"
) -> ResponsesRequest:
    """`previous`: the conversation of `previous_response_id` (the app looked it up: it needs the store)."""
    read_body(body, (), limits)  # an object; depth and Unicode of the whole body
    assert isinstance(body, dict)
    unknown = sorted(set(body) - set(FIELDS) - set(ACCEPTED_IGNORED))
    if unknown:
        raise invalid(f"{unknown[0]} is not supported by this server", unknown[0])
    if body.get("background") is not None and body["background"] is not False:
        raise invalid("background is not supported by this server: responses are answered in the request", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid('truncation must be "disabled": this server never drops input to fit', "truncation")
    if body.get("top_logprobs") is not None and (not is_int(body["top_logprobs"]) or body["top_logprobs"] != 0):
        raise invalid("top_logprobs is not supported by the Responses endpoint here", "top_logprobs")
    if body.get("max_tool_calls") is not None:
        raise invalid("max_tool_calls is not supported (parallel_tool_calls false allows one call)", "max_tool_calls")
    _metadata(body.get("metadata"), limits)
    for key in (*IDENTIFIERS, "previous_response_id"):
        if body.get(key) is not None:
            check_id(body[key], key, limits)
    reasoning, thinking = _reasoning(body.get("reasoning"), reasoning_parser)
    raw_input = body.get("input")
    if raw_input is None and previous is None:
        raise invalid("input missing in request", "input")
    if isinstance(raw_input, str):
        raw_input = [{"type": "message", "role": "user", "content": raw_input}]
    elif raw_input is None:
        raw_input = []
    elif not isinstance(raw_input, list):
        raise invalid("input must be a string or an array of items", "input")
    messages, stored = _item_messages(raw_input, limits, ImageCount(limits, _image_count(previous or [])))
    conversation = [*(previous or []), *messages]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
    }
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("stream", "stream"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
        if not chat["tools"]:
            del chat["tools"]
    if body.get("tool_choice") is not None and ("tools" in chat or body["tool_choice"] not in ("auto", "none")):
        chat["tool_choice"] = _tool_choice(body["tool_choice"])  # required / named without tools: chat's 400
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store must be a boolean", "store")
    previous_id = body.get("previous_response_id")
    try:
        req = replace(parse_chat(chat, limits), conversation=CONVERSATION)  # the engine's refusals name `input` too
    except ApiError as exc:  # chat's names of fields, said in this API's
        exc.param = CHAT_NAMES.get(exc.param or "", exc.param)
        raise
    grammar = req.sampling.get("grammar")
    if grammar is not None:  # the engine's refusal of a schema names `text.format`, not chat's `response_format`
        renamed = replace(grammar, param=CHAT_NAMES.get(grammar.param, grammar.param))
        req = replace(req, sampling={**req.sampling, "grammar": renamed})
    kept = [*(previous or []), *map(_stored, messages)]
    return ResponsesRequest(req, body, stored, kept, store is not False, previous_id, reasoning, thinking)


# ---------------------------------------------------------------- output: chat deltas -> Responses items / events


# the text items of the output: a new one of each kind, and the delta event of its text
REASONING_TEXT: dict[str, Any] = {"type": "reasoning_text", "text": ""}
OUTPUT_TEXT: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
TEXT_ITEMS: dict[str, Callable[[], dict]] = {
    "reasoning": (lambda: {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [REASONING_TEXT]}),
    "message": (lambda: {"type": "message", "id": new_id("msg"), "role": "assistant", "content": [OUTPUT_TEXT]}),
}
TEXT_DELTAS: dict[str, tuple[str, dict[str, Any]]] = {
    "reasoning": ("response.reasoning_text.delta", {}),
    "message": ("response.output_text.delta", {"logprobs": []}),
}


@dataclass
class ResponseEvents:
    """Folds chat deltas (ChatShape.delta's: content, reasoning_content, tool_calls) into Responses output items,
    yielding the streaming events in OpenAI's order; `sequence_number` counts every event. The open item's text
    (or a call's arguments) is kept as its pieces and joined once, when the item closes."""

    base: dict  # the response object so far (status in_progress, output [])
    seq: int = 0
    output: list[dict] = field(default_factory=list)
    _open: dict | None = None  # the item being written
    _parts: list[str] = field(default_factory=list)  # its text / arguments so far

    def event(self, kind: str, **fields: Any) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def opening(self) -> Iterator[dict]:
        yield self.event("response.created", response=self.snapshot("in_progress"))
        yield self.event("response.in_progress", response=self.snapshot("in_progress"))

    def snapshot(self, status: str, **more: Any) -> dict:
        return {**self.base, "status": status, "output": [dict(i) for i in self.output], **more}

    def _start(self, item: dict) -> Iterator[dict]:
        yield from self.close()
        self._open = item
        self.output.append(item)
        index = len(self.output) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        yield self.event("response.output_item.added", output_index=index, item=added)
        if item["type"] == "message":
            yield self.event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=OUTPUT_TEXT
            )

    def close(self, status: str = "completed") -> Iterator[dict]:
        item, self._open = self._open, None
        if item is None:
            return
        written = "".join(self._parts)
        self._parts.clear()
        index = self.output.index(item)
        item["status"] = status
        if item["type"] in TEXT_ITEMS:
            item["content"] = [{**item["content"][0], "text": written}]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                yield self.event("response.output_text.done", **ids, text=written, logprobs=[])
                yield self.event("response.content_part.done", **ids, part=item["content"][0])
            else:
                yield self.event("response.reasoning_text.done", **ids, text=written)
        else:
            item["arguments"] = written
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=written,
            )
        yield self.event("response.output_item.done", output_index=index, item=item)

    def _text(self, kind: str, text: str) -> Iterator[dict]:
        """More text of a `reasoning` or `message` item: the open one if it is of that kind, else a new one."""
        if self._open is None or self._open["type"] != kind:
            yield from self._start(TEXT_ITEMS[kind]())
        assert self._open is not None
        self._parts.append(text)
        name, more = TEXT_DELTAS[kind]
        ids = {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        yield self.event(name, **ids, delta=text, **more)

    def feed(self, delta: dict) -> Iterator[dict]:
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            fn = call.get("function", {})
            if "id" in call:  # a new call: its name (its arguments follow in the next delta)
                item = {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": call["id"],
                    "name": fn.get("name", ""),
                    "arguments": "",
                }
                yield from self._start(item)
            arguments = fn.get("arguments")
            if arguments and self._open is not None and self._open["type"] == "function_call":
                self._parts.append(arguments)
                yield self.event(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output) - 1,
                    delta=arguments,
                )

    def assistant_messages(self) -> list[dict]:
        """This response's output as chat messages (the next turn's prefix: the template renders them as the
        model wrote them, so the prefix cache finds this turn's prompt)."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.output
            if i["type"] == "function_call"
        ]
        message: dict = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]


def response_base(req: ResponsesRequest, response_id: str, model: str, params: Any) -> dict:
    """The response object's fields other than status / output / usage: what OpenAI echoes of the request."""
    body = req.body
    chat = req.chat
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    tool_choice: Any = body.get("tool_choice") or "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": (req.reasoning or {}).get("effort"),
            "summary": (req.reasoning or {}).get("summary"),
        },
        "service_tier": "default",
        "store": req.store,
        "temperature": params.temperature,
        "text": {"format": fmt, "verbosity": (body.get("text") or {}).get("verbosity") or "medium"},
        "tool_choice": tool_choice,
        "tools": [
            {"type": "function", "strict": None, "description": None, "parameters": None, **t["function"]}
            for t in chat.tools
        ],
        "top_logprobs": 0,
        "top_p": params.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def usage(chat_usage: dict, output: list[dict]) -> dict:
    """Chat's usage in the Responses spelling. The engine does not count reasoning tokens apart: they are the
    output tokens' share of the reasoning characters (0 without a thought)."""
    prompt, generated = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    thought = sum(len(i["content"][0]["text"]) for i in output if i["type"] == "reasoning")
    written = thought + sum(
        len(i["content"][0]["text"]) if i["type"] == "message" else len(i["arguments"])
        for i in output
        if i["type"] in ("message", "function_call")
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": round(generated * thought / written) if thought else 0},
        "total_tokens": prompt + generated,
    }
