"""`POST /v1/messages` and `/v1/messages/count_tokens`: an Anthropic Messages body -> the chat adapter's
`ChatRequest` (appliance/api/request.py), the one internal request of a chat generation. So the model's chat
template, the tools prompt, the tool-call and reasoning parsers and the tool grammar are the chat path's, and every
bound is the chat one from the limits table (messages, stop strings, tools, max_tokens, grammar size, depth).

Fields: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages` (user / assistant; content
a string or blocks: `text`, `image` (user turns and tool results: a `base64` source with its `media_type`, JPEG, PNG
or WebP, or a `url` source fetched from a host the operator lists; appliance/api/images.py), `tool_use`,
`tool_result` with string, text- or image-block content and `is_error`; an
assistant's `thinking` blocks are dropped, as Anthropic drops earlier turns' thoughts), `stop_sequences`,
`temperature` / `top_p` / `top_k` (the SDK no longer sends them; older clients do), `tools` (custom tools with
`input_schema`), `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `thinking`, `output_config`
(`format` json_schema: constrained as chat's response_format; `effort` ignored), `stream`.
Accepted and ignored, since none of them constrains the output (`IGNORED`): the SDK's `metadata`, `service_tier`,
`cache_control` (this server's prefix cache needs no marker), `container`, `diagnostics`, `inference_geo`, `speed`,
`user_profile_id`, `workspace_id`, and the beta `context_management`; in blocks and tools the SDK's `cache_control`,
`citations`, `caller`, `toolset_name`, and a tool's `allowed_callers`, `defer_loading`, `eager_input_streaming`,
`input_examples`.
Refused (400) as Anthropic refuses them, "<path>: Extra inputs are not permitted": any other field, at the top
level, in a message, a content block, a tool, tool_choice or thinking (a field this server does not know may
constrain the output, and ignoring it would answer something the client did not ask for).
Refused (400) with the reason: documents and other blocks, GIF images and `file` image sources, server
tools (web search, code execution, ...) and `mcp_servers`, a last message from the assistant (a prefill: the chat
template starts a new assistant turn, so the answer would not continue it), a tool's `strict: true` unless
tool_choice is any or tool (which constrain the calls to the tools' schemas: auto does not), and thinking's
`display: "omitted"` (the thought is returned as the model writes it).

Mapping: content blocks become chat messages (a user turn's `tool_result` blocks each a `tool` message with its
`tool_call_id`, its text a user message, in their order; an assistant's `tool_use` blocks its `tool_calls`);
`tool_choice` any -> required, tool -> a named call (both grammar-constrained to the tool's input_schema);
`disable_parallel_tool_use` -> one call. `thinking` enabled needs a model with a reasoning parser (the app checks;
its budget_tokens is checked as Anthropic does, 1024 <= budget < max_tokens, but not enforced: max_tokens bounds
the thought and the answer together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from appliance.api import parsers as P
from appliance.api import table as F
from appliance.api.errors import ApiError, invalid
from appliance.api.images import MEDIA_TYPES, ImageCount, base64_image, url_image
from appliance.api.request import ChatRequest, EdgeOptions, ToolChoice
from appliance.api.table import read_body, sampling_values
from appliance.limits import Limits, base64_chars

MIN_THINKING_BUDGET = 1024  # Anthropic's smallest budget_tokens
# top-level fields of the SDK's MessageCreateParams (and the beta context_management) that do not constrain the
# output: accepted and ignored (the module docstring)
IGNORED = (
    "metadata",
    "service_tier",
    "cache_control",
    "container",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
    "context_management",
)
# known fields this server cannot honour: refused with the reason rather than Anthropic's "Extra inputs"
UNSUPPORTED = {
    "mcp_servers": "mcp_servers: MCP servers are connected by Anthropic's API, which runs their tools; this server "
    "runs none (send custom tools and run them yourself)",
}
# each object's fields, by the SDK's params (a response's blocks, sent back as an assistant turn, are a subset)
_MESSAGE_KEYS = frozenset({"role", "content"})
_BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "image": frozenset({"type", "source", "cache_control"}),
}
_TOOL_KEYS = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "strict",
        "cache_control",
        "allowed_callers",
        "defer_loading",
        "eager_input_streaming",
        "input_examples",
    }
)
_TOOL_CHOICE_KEYS = frozenset({"type", "name", "disable_parallel_tool_use"})
_THINKING_KEYS = frozenset({"type", "budget_tokens", "display"})


def _extra(value: dict, allowed: frozenset[str], where: str) -> None:
    """Anthropic's 400 for a field it does not know (pydantic's "Extra inputs are not permitted"), with its path."""
    extra = next((key for key in value if key not in allowed), None)
    if extra is not None:
        raise invalid(f"{where}.{extra}: Extra inputs are not permitted", where.split(".")[0])


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest  # the internal request: messages, tools, tool choice, sampling values
    thinking: str = "disabled"  # enabled | disabled | adaptive
    stop_sequences: tuple[str, ...] = ()
    one_call: bool = False  # disable_parallel_tool_use


def _blocks(value: Any, where: str, limits: Limits, images: ImageCount | None = None) -> list[dict]:
    """A string, or text blocks (and `image` blocks where `images` counts them: a tool_result's content) -> chat
    parts: {"type": "text", "text"} and {"type": "image", "image": Image}."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise invalid(f"{where} must be a string or an array of text blocks", where.split(".")[0])
    if len(value) > limits.content_parts:
        raise invalid(f"{where} must have no more than {limits.content_parts} blocks", where.split(".")[0])
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{where}: each block must be an object with a type", where.split(".")[0])
        if block["type"] == "image" and images is not None:
            parts.append(_image(block, f"{where}.{i}", limits, images))
            continue
        if block["type"] != "text":
            kinds = "text and image" if images is not None else "text"
            raise invalid(
                f"{where}: blocks of type {block['type']!r} are not supported here ({kinds} only)", where.split(".")[0]
            )
        _extra(block, _BLOCK_KEYS["text"], f"{where}.{i}")
        if not isinstance(block.get("text"), str):
            raise invalid(f"{where}: a text block needs a string text", where.split(".")[0])
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _chat_content(parts: list[dict]) -> str | list[dict]:
    """Chat content: the text parts joined with newlines, or the parts in order when an image is among them."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(block: dict, where: str, limits: Limits, images: ImageCount) -> dict:
    """An `image` block -> a chat image part: `source` base64 (with its media_type, which the file's bytes must
    match, as Anthropic checks) or url (fetched from a listed host only: appliance/api/image_fetch.py); a `file`
    source names a file this server does not store."""
    _extra(block, _BLOCK_KEYS["image"], where)
    images.next(where)
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    kind = source.get("type")
    at = f"{where}.source"
    if kind == "base64":
        _extra(source, frozenset({"type", "media_type", "data"}), at)
        media_type = source.get("media_type")
        if not isinstance(media_type, str):
            raise invalid(f"{at}.media_type: Field required", "messages")
        return {
            "type": "image",
            "image": base64_image(source.get("data"), f"{at}.data", limits, media_type),
        }
    if kind == "url":
        _extra(source, frozenset({"type", "url"}), at)
        url = source.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise invalid(f"{at}.url: an http(s) URL", "messages")
        return {"type": "image", "image": url_image(url, f"{at}.url", limits)}
    if kind == "file":
        raise invalid(f"{at}: file sources are not supported (this server has no Files API): send base64", "messages")
    raise invalid(
        f'{at}: source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}', "messages"
    )


def _text_blocks(value: Any, where: str, limits: Limits) -> str:
    """A string, or text blocks joined (what `system` may be)."""
    return "\n".join(p["text"] for p in _blocks(value, where, limits))


def system(value: Any, limits: Limits, read: dict) -> str:
    return _text_blocks(value, "system", limits)


def _id(value: Any, what: str, limits: Limits) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"messages: a {what} (a string)", "messages")
    if len(value) > limits.id_chars:
        raise invalid(f"messages: a tool id must be at most {limits.id_chars} characters", "messages")
    return value


def _user(content: list, out: list[dict], limits: Limits, images: ImageCount, m: int) -> None:
    parts: list[dict] = []
    for b, block in enumerate(content):
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block, f"messages.{m}.content.{b}", limits, images))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _chat_content(parts)})
                parts = []
            tool_use_id = _id(block.get("tool_use_id"), "tool_result block needs its tool_use_id", limits)
            content = block.get("content")
            where = f"messages.{m}.content.{b}.content"
            result = [] if content is None else _blocks(content, where, limits, images)
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise invalid("messages: a tool_result's is_error must be a boolean", "messages")
            if is_error and result and result[0]["type"] == "text":
                result[0] = {"type": "text", "text": "Error: " + result[0]["text"]}
            elif is_error:
                result.insert(0, {"type": "text", "text": "Error: "})
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _chat_content(result)})
        else:
            raise invalid(f"messages: a user message cannot hold a {kind!r} block", "messages")
    if parts:
        out.append({"role": "user", "content": _chat_content(parts)})


def _assistant(content: list, out: list[dict], limits: Limits) -> None:
    texts: list[str] = []
    calls: list[dict] = []
    for block in content:
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise invalid(
                    "messages: a tool_use block needs id and name (strings) and input (an object)", "messages"
                )
            _id(call_id, "tool_use block needs its id", limits)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thoughts do not go back into the prompt (Anthropic drops them too)
        else:
            raise invalid(f"messages: an assistant message cannot hold a {kind!r} block", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    out.append(message)


_BLOCKS = set(_BLOCK_KEYS)


def messages(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Anthropic messages -> chat messages (the module docstring's mapping); the chat bounds hold for the result
    (parsers.messages: count, the fields kept)."""
    if not isinstance(value, list):
        raise invalid("messages: Input should be a valid list", "messages")
    if not value:
        raise invalid("messages: at least one message is required", "messages")
    if len(value) > limits.messages:
        raise invalid(f"messages array must have no more than {limits.messages} messages", "messages")
    out: list[dict] = []
    images = ImageCount(limits)
    for m, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid('messages: each message is an object whose role is "user" or "assistant"', "messages")
        _extra(message, _MESSAGE_KEYS, f"messages.{m}")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise invalid("messages: content must be a string or an array of content blocks", "messages")
        if len(content) > limits.content_parts:
            raise invalid(f"messages: content must have no more than {limits.content_parts} blocks", "messages")
        for b, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise invalid("messages: each content block must be an object with a type", "messages")
            if block["type"] not in _BLOCKS:
                raise invalid(
                    f"messages: content blocks of type {block['type']!r} are not supported (blocks: text, image, "
                    "tool_use, tool_result, thinking)",
                    "messages",
                )
            _extra(block, _BLOCK_KEYS[block["type"]], f"messages.{m}.content.{b}")
            if block["type"] == "text" and not isinstance(block.get("text"), str):
                raise invalid("messages: a text block needs a string text", "messages")
        if message["role"] == "user":
            _user(content, out, limits, images, m)
        else:
            _assistant(content, out, limits)
    if value[-1]["role"] == "assistant":
        raise invalid(
            "messages: the last message is the assistant's (a prefill), which this server cannot continue: end "
            "with a user message",
            "messages",
        )
    return tuple(out)


def tools(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Custom tools {name, description?, input_schema} -> chat tools (parsers.tools: names, count, uniqueness)."""
    if not isinstance(value, list):
        raise invalid("tools: Input should be a valid list", "tools")
    converted = []
    for t, tool in enumerate(value[: limits.tools + 1]):  # one past the bound: parsers.tools names the bound
        if not isinstance(tool, dict):
            raise invalid("tools: each tool must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise invalid(
                f"tools: tool type {tool['type']!r} is not supported (server tools run at Anthropic); only custom "
                "tools with an input_schema",
                "tools",
            )
        _extra(tool, _TOOL_KEYS, f"tools.{t}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid("tools: each tool needs an input_schema (a JSON schema object)", "tools")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]  # checked by parsers.tools; parse_messages says where it holds
        converted.append({"type": "function", "function": function})
    return P.tools(converted, limits, read)


def tool_choice(value: Any, limits: Limits, read: dict) -> tuple[ToolChoice, str | None, bool]:
    """(the chat tool_choice, the tool's name, disable_parallel_tool_use)."""
    kinds: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str) or value["type"] not in kinds:
        raise invalid('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    _extra(value, _TOOL_CHOICE_KEYS, "tool_choice")
    one = value.get("disable_parallel_tool_use")
    if one is not None and not isinstance(one, bool):
        raise invalid("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    name = value.get("name")
    if value["type"] == "tool" and (not isinstance(name, str) or not name):
        raise invalid('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
    return kinds[value["type"]], name if value["type"] == "tool" else None, bool(one)


def thinking(value: Any, limits: Limits, read: dict) -> tuple[str, int | None]:
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid('thinking must be {"type": "enabled", "budget_tokens": N}, or type "disabled"', "thinking")
    _extra(value, _THINKING_KEYS, "thinking")
    if value.get("display") not in (None, "summarized", "omitted"):
        raise invalid('thinking.display must be "summarized" or "omitted"', "thinking")
    if value.get("display") == "omitted":
        raise invalid(
            'thinking.display "omitted" is not supported: this server returns the thought as the model writes it '
            '(leave display out, or send "summarized")',
            "thinking",
        )
    budget = value.get("budget_tokens")
    if value["type"] == "enabled":
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
            raise invalid(f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET}", "thinking")
        if read["max_tokens"] is not None and budget >= read["max_tokens"]:
            raise invalid("thinking.budget_tokens: must be less than max_tokens", "thinking")
    return value["type"], budget


def output_config(value: Any, limits: Limits, read: dict) -> Any:
    """Structured outputs: `format` {type: json_schema, schema} is the chat path's json_schema response_format (the
    same grammar, the same grammar_chars bound); `effort` is accepted and ignored (no model here has the switch,
    and it does not constrain the output)."""
    if not isinstance(value, dict) or set(value) - {"effort", "format"}:
        raise invalid("output_config accepts effort and format", "output_config")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
    try:
        return P.response_format({"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}, limits, read)
    except ApiError as exc:
        raise invalid(exc.message.replace("response_format", "output_config.format"), "output_config") from None


def stop_sequences(value: Any, limits: Limits, read: dict) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop_sequences must be an array of strings", "stop_sequences")
    if len(value) > limits.stop_strings:
        raise invalid(f"stop_sequences must have no more than {limits.stop_strings} strings", "stop_sequences")
    if any(len(s) > limits.stop_chars for s in value):
        raise invalid(f"stop_sequences strings must be at most {limits.stop_chars} characters long", "stop_sequences")
    return tuple(dict.fromkeys(s for s in value if s))


# ---- the fields' JSON schemas (docs/openapi.json's MessagesRequest, generated by appliance/wsgi/openapi.py):
# no stricter than the parsers above (a body they accept is valid by its schema; tests/e2e/test_fuzz.py's negative run
# checks the converse direction on the running server), bounds from the limits table


def _text_blocks_schema(limits: Limits) -> dict:
    block = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    return {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": limits.content_parts, "items": block}]}


def _id_schema(limits: Limits) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": limits.id_chars}


def _image_schema(limits: Limits) -> dict:
    base64 = {
        "type": "object",
        "required": ["type", "media_type", "data"],
        "properties": {
            "type": {"const": "base64"},
            "media_type": {"enum": list(MEDIA_TYPES)},
            "data": {"type": "string", "maxLength": base64_chars(limits.image_bytes)},
        },
    }
    url = {
        "type": "object",
        "required": ["type", "url"],
        "properties": {"type": {"const": "url"}, "url": {"type": "string"}},
    }
    return {"required": ["source"], "properties": {"source": {"anyOf": [base64, url]}}}


def _messages_schema(limits: Limits) -> dict:
    image = _image_schema(limits)
    image_block = {
        "type": "object",
        "required": ["type", *image["required"]],
        "properties": {"type": {"const": "image"}, **image["properties"]},
    }
    result_blocks = {
        "type": "array",
        "maxItems": limits.content_parts,
        "items": {"anyOf": [_text_blocks_schema(limits)["anyOf"][1]["items"], image_block]},
    }
    kinds = {
        "image": image,
        "text": {"required": ["text"], "properties": {"text": {"type": "string"}}},
        "tool_use": {
            "required": ["id", "name", "input"],
            "properties": {"id": _id_schema(limits), "name": {"type": "string"}, "input": {"type": "object"}},
        },
        "tool_result": {
            "required": ["tool_use_id"],
            "properties": {
                "tool_use_id": _id_schema(limits),
                "content": {"anyOf": [{"type": "string"}, result_blocks, {"type": "null"}]},
                "is_error": {"type": ["boolean", "null"]},
            },
        },
    }
    block = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": sorted(_BLOCKS)}},
        "allOf": [{"if": {"properties": {"type": {"const": k}}}, "then": v} for k, v in kinds.items()],
    }
    content = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": limits.content_parts, "items": block}]}
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]}, "content": content},
    }
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": limits.messages,
        "items": message,
        "description": "user / assistant turns, the last one the user's; content a string or blocks (text, "
        f"image: user turns and tool results, at most {limits.images} images per request (`--max-images`), each "
        f"file at most {limits.image_bytes} bytes (`--max-image-bytes`); tool_use, tool_result, thinking: dropped).",
    }


def _tools_schema(limits: Limits) -> dict:
    tool = {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "type": {"enum": ["custom", None]},
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
            "input_schema": {"type": "object"},
        },
    }
    return {"type": "array", "maxItems": limits.tools, "items": tool, "description": "Custom tools only."}


def _tool_choice_schema(limits: Limits) -> dict:
    return {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]},
            "disable_parallel_tool_use": {"type": ["boolean", "null"]},
        },
        "if": {"properties": {"type": {"const": "tool"}}},
        "then": {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}},
    }


def _thinking_schema(limits: Limits) -> dict:
    return {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]}},
        "if": {"properties": {"type": {"const": "enabled"}}},
        "then": {
            "required": ["budget_tokens"],
            "properties": {"budget_tokens": {"type": "integer", "minimum": MIN_THINKING_BUDGET}},
        },
        "description": "enabled (budget_tokens >= 1024, below max_tokens) needs a model with a reasoning parser.",
    }


def _output_config_schema(limits: Limits) -> dict:
    fmt = {
        "type": "object",
        "required": ["type", "schema"],
        "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {"effort": {}, "format": {"anyOf": [fmt, {"type": "null"}]}},
    }


def _stop_sequences_schema(limits: Limits) -> dict:
    strings = {"type": "string", "maxLength": limits.stop_chars}
    return {"type": "array", "maxItems": limits.stop_strings, "items": strings}


MAX_TOKENS = replace(
    F.max_tokens("max_tokens", positive=True, description="Generated tokens at most (thought and answer). Required."),
    required="max_tokens: Field required",
)

# check order: the order of these fields (count_tokens reads the same table: its max_tokens is not required)
MESSAGES = (
    F.MODEL,
    MAX_TOKENS,
    F.custom("system", _text_blocks_schema, parse=system, param=None),
    F.custom("messages", _messages_schema, required="messages: Field required", parse=messages, param=None),
    F.custom("stop_sequences", _stop_sequences_schema, parse=stop_sequences, param=None),
    F.boolean("stream", "stream: Input should be a valid boolean", param=None),
    F.number("temperature", F.Min(0), F.Max(1), message="temperature: must be a number in [0, 1]"),
    F.number("top_p", F.Min(0), F.Max(1), message="top_p: must be a number in [0, 1]"),
    F.integer("top_k", "top_k: must be a non-negative integer", F.Min(0), F.Max(P.UINT32_MAX)),
    F.custom("tools", _tools_schema, parse=tools, param=None),
    F.custom("tool_choice", _tool_choice_schema, parse=tool_choice, param=None),
    F.custom("thinking", _thinking_schema, parse=thinking, param=None),
    F.custom("output_config", _output_config_schema, parse=output_config, param=None),
    *(F.ignored(name) for name in IGNORED),
)
COUNT_TOKENS = tuple(replace(f, required=None) if f is MAX_TOKENS else f for f in MESSAGES)


def parse_messages(body: Any, limits: Limits = Limits(), *, count_only: bool = False) -> MessagesRequest:
    table = COUNT_TOKENS if count_only else MESSAGES
    values, unknown = read_body(body, table, limits)
    if unknown:
        raise invalid(UNSUPPORTED.get(unknown[0], f"{unknown[0]}: Extra inputs are not permitted"), unknown[0])
    chat_messages = values["messages"]
    if values["system"] is not None:
        chat_messages = ({"role": "system", "content": values["system"]}, *chat_messages)
    chat_messages = P.messages(list(chat_messages), limits, {})  # the chat bounds, on what the template reads
    found = values["tools"] or ()
    choice: ToolChoice
    choice, name, one = values["tool_choice"] or ("auto", None, False)
    if choice in ("required", "named") and not found:
        raise invalid('tool_choice "any" or "tool" needs tools', "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in found}:
        raise invalid(f"tool_choice names tool {name!r}, which is not one of tools", "tool_choice")
    if choice not in ("required", "named") and any(t["function"].get("strict") for t in found):
        raise invalid(
            'tools: strict is honoured with tool_choice "any" or "tool" here (their calls are constrained to the '
            'tools\' input_schema); with "auto" or "none" the output is not: send one of those, or leave strict out',
            "tools",
        )
    grammar = values["output_config"]  # with tool_choice any / tool: a later turn's text (api/request.chat_job)
    stops = values["stop_sequences"] or ()
    sampling = sampling_values(values, table)  # the fields whose `param` sets a SamplingParams attribute
    if grammar is not None:
        sampling["grammar"] = grammar
    if stops:  # kept by the engine, cut by the shape, which then knows which one matched (shape.py)
        sampling["stop"], sampling["include_stop_str_in_output"] = stops, True
    stream = bool(values["stream"]) and not count_only
    chat = ChatRequest(
        EdgeOptions(values["model"], stream=stream),
        sampling,
        tuple(chat_messages),
        tools=found,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=not one,
    )
    mode, _ = values["thinking"] or ("disabled", None)
    return MessagesRequest(chat, mode, stops, one)
