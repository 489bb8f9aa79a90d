"""Parsers of the structured request fields: each checks one field alone and returns its value.

Each is a `Parser`, (value, limits, fields read so far) -> value, and each API's field table names it beside the
field it reads (`custom(..., parse=...)`, appliance/openai_api/fields.py, appliance/anthropic_api/request.py); the
rules across fields are in each adapter, and the JSON schemas (docs/openapi.json) in the tables. Here: the prompt
and chat messages, stop strings and ids, logit_bias, stream_options, structured output (`response_format`,
Cerebras's `grammar_root`), chat tools, Friendli's list-valued completions fields (`tokens`, `seed` as a list,
`stop_tokens`, `bad_words`, `bad_word_tokens`), and OpenAI's `prediction`.

Whether a schema, regex or grammar compiles is decided engine-side (runtime/grammar.py, a 400 naming
`response_format` from there): the HTTP workers do not import llguidance. JSON schemas are written as canonical JSON
(sorted keys, no spaces) so that equal schemas share one compilation, whatever key order or spacing each client
sends. No numpy here: HTTP workers import this.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from appliance.api.errors import invalid
from appliance.api.images import Image, ImageCount, url_image
from appliance.limits import Limits
from appliance.params import Grammar

Parser = Callable[[Any, Limits, dict], Any]  # a custom field's check: (value, limits, fields read so far) -> value
Prompt = str | tuple[int, ...]  # text or token ids
UINT32_MAX = 4294967295
TOKEN_ID_PATTERN = r"0|[1-9][0-9]{0,9}"  # canonical decimal: "01", "+1", " 1", "1_0" name no token
TOOL_NAME_PATTERN = r"[a-zA-Z0-9_-]{1,64}"
MESSAGE_STRINGS = ("name", "tool_call_id")  # message fields passed to the chat template besides role/content
# Cerebras grammar_root values that name a JSON value -> the JSON schema they mean ({}: any JSON value)
GRAMMAR_ROOTS: dict[str, dict] = {
    "value": {},
    "root": {},
    "object": {"type": "object"},
    "array": {"type": "array"},
    "string": {"type": "string"},
    "number": {"type": "number"},
    "integer": {"type": "integer"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
}
_TOKEN_ID = re.compile(TOKEN_ID_PATTERN)
_TOOL_NAME = re.compile(TOOL_NAME_PATTERN)
# Cerebras grammar_root values with no JSON-value meaning: the rules of its own tool-call grammar
_TOOL_ROOTS = ("funcall", "tool_name", "tool_args", "tool_call", "tool_calls")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id(value: Any) -> bool:
    return is_int(value) and 0 <= value <= UINT32_MAX


def canonical_schema(schema: dict) -> str:
    """The schema as compact JSON text, keys in the client's order: the output's properties follow the order of
    `properties` (as OpenAI documents; a schema that puts "reasoning" before "answer" relies on it), so sorting
    the keys for a better cache hit rate would change the output."""
    return json.dumps(schema, separators=(",", ":"))


# keywords whose values are data, not schemas: a `oneOf` key inside a const or an enum is left as it is
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _pointer(root: Any, ref: Any) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/Cat") names in `root`; None when it names nothing here."""
    if not isinstance(ref, str) or not ref.startswith("#") or (ref != "#" and not ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def inline_one_of_refs(schema: dict, budget: int) -> dict:
    """A copy of `schema` in which each `oneOf` branch that is a bare local `{"$ref": ...}` is the subschema it
    names. Why: llguidance compiles a oneOf only where it can prove
    the branches disjoint (else a 400, "oneOf constraints are not supported"), and it proves it from the branches'
    own keywords (a `const` discriminator, distinct types) without following a `$ref`. Pydantic writes a
    discriminated union as a oneOf of `$ref`s into `$defs` (pydantic-ai sends it so, without OpenAPI's
    `discriminator`): the same schema with its branches inlined compiles, and means the same (a branch's own refs
    stay pointers from the root, which keeps its `$defs`). Branches stay refs once the growth would pass `budget`
    (the request's remaining `grammar_chars`), so the copy stays within the bound the original met; a schema nested
    past Python's recursion limit is returned as it is (the engine then judges it)."""
    left = budget

    def branch(item: Any) -> Any:
        nonlocal left
        if not isinstance(item, dict) or set(item) != {"$ref"}:
            return item
        target = _pointer(schema, item["$ref"])
        if not isinstance(target, dict) or "$ref" in target:
            return item
        cost = len(canonical_schema(target)) - len(canonical_schema(item))
        if cost > left:
            return item
        left -= cost
        return target

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in _DATA_KEYWORDS else walk(v) for k, v in node.items()}
        if isinstance(out.get("oneOf"), list):
            out["oneOf"] = [branch(v) for v in out["oneOf"]]
        return out

    try:
        return walk(schema)
    except RecursionError:
        return schema


def _json_schema(schema: dict, limits: Limits) -> Grammar:
    """A response_format's JSON schema, its oneOf branches inlined (inline_one_of_refs) within grammar_chars."""
    text = canonical_schema(schema)
    if len(text) <= limits.grammar_chars:
        text = canonical_schema(inline_one_of_refs(schema, limits.grammar_chars - len(text)))
    return _grammar("json_schema", text, limits)


def _grammar(kind: str, text: str, limits: Limits, param: str = "response_format") -> Grammar:
    if len(text) > limits.grammar_chars:
        raise invalid(f"{param}: the {kind} is longer than {limits.grammar_chars} characters", param)
    return Grammar(kind, text)  # type: ignore[arg-type]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"response_format.{what} must be a non-empty string", "response_format")
    return value


def response_format(value: Any, limits: Limits, read: dict) -> Grammar | None:
    """OpenAI's text / json_object / json_schema, Friendli's json_object with a `schema` string and regex, and a
    Lark or GBNF grammar -> the Grammar the output must match (None: free text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("response_format must be an object with a string type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        if schema is None:
            return _grammar("json_schema", canonical_schema({"type": "object"}), limits)
        if isinstance(schema, str):  # Friendli: the JSON schema as a string
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise invalid(f"response_format.schema is not valid JSON: {exc}", "response_format") from None
        if not isinstance(schema, dict):
            raise invalid("response_format.schema must be a JSON schema (an object)", "response_format")
        return _json_schema(schema, limits)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format json_schema needs a json_schema object", "response_format")
        for name, types in (("name", str), ("description", str), ("strict", bool)):
            if spec.get(name) is not None and not isinstance(spec[name], types):
                raise invalid(f"response_format.json_schema.{name} has the wrong type", "response_format")
        if not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema must be a JSON schema (an object)", "response_format")
        return _json_schema(spec["schema"], limits)
    if kind == "regex":
        return _grammar("regex", _text(value.get("schema"), "schema"), limits)
    if kind == "grammar":
        form: dict = value["grammar"] if isinstance(value.get("grammar"), dict) else value
        syntax = form.get("syntax")
        if syntax not in ("lark", "gbnf"):
            raise invalid("response_format grammar syntax must be \"lark\" or \"gbnf\"", "response_format")
        return _grammar(syntax, _text(form.get("definition"), "definition"), limits)
    raise invalid(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, regex, grammar", "response_format"
    )


def grammar_root(value: Any, limits: Limits, read: dict) -> Grammar:
    """Cerebras's grammar_root: a JSON value of one kind (a JSON schema); its tool-call roots are refused."""
    if isinstance(value, str) and value in GRAMMAR_ROOTS:
        return Grammar("json_schema", canonical_schema(GRAMMAR_ROOTS[value]))
    if value in _TOOL_ROOTS:
        raise invalid(
            f"grammar_root {value!r} is a rule of Cerebras's tool-call grammar, which this server does not have: "
            "use chat tools with tool_choice \"required\" or a named function",
            "grammar_root",
        )
    raise invalid(f"grammar_root must be one of {', '.join(GRAMMAR_ROOTS)}", "grammar_root")


def tools(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Each {"type": "function", "function": {...}}, kept with only the fields a template and a parser use."""
    if not isinstance(value, list):
        raise invalid("tools is not an array", "tools")
    if len(value) > limits.tools:
        raise invalid(f"tools must have no more than {limits.tools} functions", "tools")
    out, names = [], set()
    for tool in value:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {...}}", "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise invalid("tool function names must match ^[a-zA-Z0-9_-]{1,64}$", "tools")
        if name in names:
            raise invalid(f"tool function names must be unique: {name!r} is given twice", "tools")
        names.add(name)
        kept: dict[str, Any] = {"name": name}
        for key, types, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema (an object)"),
            ("strict", bool, "a boolean"),
        ):
            if fn.get(key) is not None:
                if not isinstance(fn[key], types):
                    raise invalid(f"tool {name!r}: function.{key} must be {what}", "tools")
                kept[key] = fn[key]
        out.append({"type": "function", "function": kept})
    return tuple(out)


def tool_choice(value: Any, limits: Limits, read: dict) -> tuple[str, str | None]:
    """(ChatRequest.tool_choice, tool_name)."""
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def seeds(value: Any, limits: Limits, read: dict) -> int | tuple[int, ...]:
    """A seed, or (Friendli) a list of one seed per choice (its length is checked against n by the caller)."""
    if is_int(value):
        if not _id(value):
            raise invalid("seed out of range [0, 4294967295]", "seed")
        return value
    if not isinstance(value, list):
        raise invalid("seed is not an integer", "seed")
    if value and len(value) <= limits.n and all(_id(s) for s in value):
        return tuple(value)
    raise invalid("a seed list must hold one integer in [0, 4294967295] per choice", "seed")


def tokens(value: Any, limits: Limits, read: dict) -> tuple[int, ...]:
    """Friendli's prompt as token ids (each checked against the vocabulary engine-side)."""
    if not isinstance(value, list) or not value or not all(is_int(t) and t >= 0 for t in value):
        raise invalid("tokens is not a non-empty array of token ids", "tokens")
    return tuple(value)


def token_lists(name: str, count: str) -> Callable[[Any, Limits, dict], tuple[tuple[int, ...], ...]]:
    """Friendli's [{"tokens": [ids]}] (stop_tokens, bad_word_tokens): at most `count` (a Limits field) entries."""

    def parse(value: Any, limits: Limits, read: dict) -> tuple[tuple[int, ...], ...]:
        most = getattr(limits, count)
        if not isinstance(value, list):
            raise invalid(f'{name} is not an array of {{"tokens": [token ids]}}', name)
        if len(value) > most:
            raise invalid(f"{name} must have no more than {most} entries", name)
        out = []
        for entry in value:
            ids = entry.get("tokens") if isinstance(entry, dict) else None
            if not isinstance(ids, list) or not ids or not all(_id(t) for t in ids):
                raise invalid(f'{name} entries must be {{"tokens": [token ids]}} with at least one id', name)
            if len(ids) > limits.token_sequence:
                raise invalid(f"{name} entries must have no more than {limits.token_sequence} token ids", name)
            out.append(tuple(ids))
        return tuple(dict.fromkeys(out))

    return parse


def bad_words(value: Any, limits: Limits, read: dict) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        raise invalid("bad_words is not an array of non-empty strings", "bad_words")
    if len(value) > limits.bad_words:
        raise invalid(f"bad_words must have no more than {limits.bad_words} entries", "bad_words")
    if any(len(w) > limits.stop_chars for w in value):
        raise invalid(f"bad_words strings must be at most {limits.stop_chars} characters long", "bad_words")
    return tuple(dict.fromkeys(value))


def prediction(value: Any, limits: Limits, read: dict) -> str:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or [{"type": "text", "text"}]} -> the text
    (parts joined as they are: the answer is expected to repeat them in order)."""
    if not isinstance(value, dict):
        raise invalid("prediction is not an object", "prediction")
    if set(value) - {"type", "content"}:
        raise invalid("prediction accepts only type and content", "prediction")
    if value.get("type") != "content":
        raise invalid('prediction type must be "content"', "prediction")
    content = value.get("content")
    if isinstance(content, list):
        ok = all(
            isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str)
            for p in content
        )
        if not ok:
            raise invalid('prediction content parts must be {"type": "text", "text": string}', "prediction")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise invalid("prediction content is not a string or an array of text parts", "prediction")
    if len(content) > limits.prediction_chars:
        raise invalid(f"prediction content must be at most {limits.prediction_chars} characters", "prediction")
    return content


def finite(value: Any) -> float | None:
    """A JSON number as a finite float, else None (a string, a bool, NaN, infinity, or an integer too large for a
    float: float(10**400) raises OverflowError, as math.isfinite(10**400) does)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def stream_options(options: Any, limits: Limits, read: dict) -> bool:
    """include_usage; stream_options is only for streams (OVMS checks that first)."""
    if not read["stream"]:
        raise invalid("stream_options provided, but stream not set to true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("stream_options is not an object", "stream_options")
    if set(options) - {"include_usage"}:
        raise invalid(
            "Found unexpected stream options. Properties accepted in stream_options: include_usage", "stream_options"
        )
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise invalid("stream_options.include_usage is not a boolean", "stream_options")
    return bool(usage)


def stop(value: Any, limits: Limits, read: dict) -> tuple[str, ...]:
    if isinstance(value, str):
        values = [value]
    elif isinstance(value, list):
        if len(value) > limits.stop_strings:
            raise invalid(f"stop array must have no more than {limits.stop_strings} strings", "stop")
        if not all(isinstance(s, str) for s in value):
            raise invalid("stop array contains non string element", "stop")
        values = value
    else:
        raise invalid("stop is not a string or array of strings", "stop")
    if any(len(s) > limits.stop_chars for s in values):
        raise invalid(f"stop strings must be at most {limits.stop_chars} characters long", "stop")
    return tuple(s for s in values if s)  # an empty stop string would match everywhere: it means nothing


def stop_token_ids(stop_ids: Any, limits: Limits, read: dict) -> tuple[int, ...]:
    if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t <= UINT32_MAX for t in stop_ids):
        raise invalid("stop_token_ids is not an array of token ids", "stop_token_ids")
    if len(stop_ids) > limits.stop_token_ids:  # each id is checked against the vocabulary engine-side
        raise invalid(f"stop_token_ids must have no more than {limits.stop_token_ids} token ids", "stop_token_ids")
    return tuple(dict.fromkeys(stop_ids))


def logit_bias(value: Any, limits: Limits, read: dict) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise invalid("logit_bias is not an object", "logit_bias")
    if len(value) > limits.logit_bias:
        raise invalid(f"logit_bias must have no more than {limits.logit_bias} entries", "logit_bias")
    out = []
    for key, bias in value.items():
        # Canonical decimal only: int() would also take " 5", "+5", "1_0", "05" and other scripts' digits, and
        # "1" and "01" would then be two entries for one token. Bounded: the engine keeps token ids in int64 arrays.
        if not _TOKEN_ID.fullmatch(key) or int(key) > UINT32_MAX:
            raise invalid("logit_bias keys must be token ids", "logit_bias")
        bias = finite(bias)
        if bias is None or not -100 <= bias <= 100:
            raise invalid("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out.append((int(key), bias))
    return tuple(out)


def prompts(value: Any, limits: Limits, read: dict) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (at most limits.prompts)."""
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        items = value
    elif isinstance(value, list) and not value:
        raise invalid("prompt is empty", "prompt")
    else:
        raise invalid(
            "prompt is not a string, an array of strings, an array of token ids or an array of arrays of token ids",
            "prompt",
        )
    if len(items) > limits.prompts:
        raise invalid(f"prompt array must have no more than {limits.prompts} prompts", "prompt")
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise invalid("prompt is empty", "prompt")
            out.append(item)
        else:
            if not item:
                raise invalid("prompt is empty", "prompt")
            if not all(is_int(t) and t >= 0 for t in item):
                raise invalid("prompt token ids must be non-negative integers", "prompt")
            out.append(tuple(item))
    return tuple(out)


DETAILS = ("auto", "high")  # image_url.detail values honoured; "low" is refused (linked_image says why)
IMAGE_ROLES = ("user", "tool")  # messages that may carry images (OpenAI: user; a tool result: Anthropic's)


def _image_part(part: dict, where: str, role: str, limits: Limits, count: ImageCount) -> dict:
    """An `image_url` part (OpenAI: {"url": data URL or http(s) URL, "detail"}) or an adapter's own Image part ->
    `{"type": "image", "image": Image}`."""
    if role not in IMAGE_ROLES:
        raise invalid(f"{where}: images go in user messages, not {role!r} ones", where)
    count.next(where)
    if part["type"] == "image":
        return part
    spec, at = part.get("image_url"), f"{where}.image_url"
    if not isinstance(spec, dict):
        raise invalid(f'{at}: an image_url part needs "image_url": {{"url": ...}}', at)
    return linked_image(spec.get("url"), spec.get("detail"), f"{at}.url", f"{at}.detail", limits)


def linked_image(url: Any, detail: Any, url_at: str, detail_at: str, limits: Limits) -> dict:
    """An image given by its URL (a data URL or a listed host's: images.url_image) and `detail`, at the fields
    `url_at` and `detail_at` (chat's image_url.url and image_url.detail, Responses' input_image image_url and
    detail) -> `{"type": "image", "image": Image}`. `detail`: "auto" and "high" are the model's own preprocessing
    (the export's processor: its resolution bounds and tiling), which is the most this model can see; "low" asks
    for a downscaled image (OpenAI: 512 x 512, fewer tokens), which the engine does not make, so it is refused
    rather than answered from the full image."""
    if detail is not None and detail not in (*DETAILS, "low"):
        raise invalid(f"{detail_at} must be auto, low or high", detail_at)
    if detail == "low":
        raise invalid(
            f'{detail_at} "low" is not supported: images are read at the model\'s own resolution (send "auto" or '
            '"high")',
            detail_at,
        )
    return {"type": "image", "image": url_image(url, url_at, limits)}


def _content(content: list, where: str, role: str, limits: Limits, count: ImageCount) -> str | list[dict]:
    """A list of content parts -> the text parts joined with newlines, or, when an image is among them, the parts
    in order (text `{"type": "text", "text"}`, images `{"type": "image", "image": Image}`)."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" or (kind == "image" and isinstance(part.get("image"), Image)):
            parts.append(_image_part(part, at, role, limits, count))
        else:
            raise invalid(f"{at}: content parts must be text or image_url parts", "messages")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def messages(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Each message: an object with a string role; content a string, null or a list of parts: text parts only are
    joined into one string, parts with images stay a list (_content). Only what a chat template may use goes on:
    role, content, name and tool_call_id (strings), tool_calls (an array of objects); other fields are dropped, so
    nothing unbounded reaches the template or the pickler. At most `Limits.images` images in all (images.py)."""
    if not isinstance(value, list):
        raise invalid("messages is not an array", "messages")
    if not value:
        raise invalid("messages array is empty", "messages")
    if len(value) > limits.messages:
        raise invalid(f"messages array must have no more than {limits.messages} messages", "messages")
    out = []
    count = ImageCount(limits)
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid("message is not an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid("message role is missing or not a string", "messages")
        content = message.get("content")
        if isinstance(content, list):
            content = _content(content, f"messages[{i}]", role, limits, count)
        elif content is not None and not isinstance(content, str):
            raise invalid("message content is not a string or an array of content parts", "messages")
        kept: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
        for name in MESSAGE_STRINGS:
            if message.get(name) is not None:
                if not isinstance(message[name], str):
                    raise invalid(f"message {name} is not a string", "messages")
                kept[name] = message[name]
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
                raise invalid("message tool_calls is not an array of objects", "messages")
            kept["tool_calls"] = tool_calls
        out.append(kept)
    return tuple(out)


def tokenize_prompt(prompt: Any, limits: Limits, read: dict) -> tuple[tuple[str, ...], bool]:
    """(prompts, batched): a string, or a list of strings (answered as a list of lists)."""
    if isinstance(prompt, str):
        return (prompt,), False
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.prompts:
            raise invalid(f"prompt array must have no more than {limits.prompts} prompts", "prompt")
        return tuple(prompt), True
    raise invalid("prompt is not a string or array of strings", "prompt")
