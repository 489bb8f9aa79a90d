"""An Ollama `/api/chat` or `/api/generate` body -> the OpenAI chat / completions request it means.

Translating the body (not re-implementing validation) keeps one set of rules: the translated body goes through
`parse_chat` / `parse_completion`, so messages, tools, stop strings, max_tokens and every other bound of
appliance/limits.py are checked exactly as on the OpenAI side. What Ollama has and OpenAI lacks is decided here:

- `options`: the sampling ones map onto OpenAI's fields (repeat_penalty -> repetition_penalty, num_predict ->
  max_tokens); load-time and resource options (RESOURCE_OPTIONS) change no output and are accepted and ignored;
  any other option (mirostat, tfs_z, ...) would change the output in a way we cannot, so it is a 400, never
  silently dropped.
- `num_ctx`: the request's context window (Job.context_window): the prompt and the output together stay within it,
  at most the model's context (Ollama clamps a larger one the same way). The engine caps max_tokens to what the
  prompt leaves of it and drops a chat's oldest messages that do not fit, as Ollama does; a prompt that still does
  not fit is a 400 (appliance/server/jobs.py says why no tokens are cut off its start).
- `keep_alive` (top level): how long the model stays loaded after this request (appliance/keep_alive.py: Ollama's
  spellings); a request with nothing to say (no messages, an empty prompt) only loads the model, or with
  keep_alive 0 unloads it.
- `num_predict`: a positive value is max_tokens (the same limit: 400 above `--max-tokens-limit`); -1 (until the
  context ends), -2 (fill the context) and 0 (Ollama's runner: no limit) all mean "not set": until a stop condition
  or the end of the context, as OpenAI's unset max_tokens.
- `format`: "json" -> any JSON object, a JSON schema -> that schema (constrained decoding, response_format).
- `images` (base64 JPEG, PNG or WebP files, appliance/api/images.py): a chat message's go before its text; on
  `/api/generate` they go with the prompt through the chat template, so `raw` with images is a 400.
- `suffix`, a non-empty `context`, a custom `template`: 400 (no fill-in-the-middle, context continuation or
  per-request templates yet).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from appliance.api.context import json_body
from appliance.api.errors import invalid
from appliance.api.images import ImageCount, base64_image
from appliance.api.request import ChatRequest, CompletionRequest
from appliance.keep_alive import parse_keep_alive
from appliance.limits import Limits
from appliance.openai_api.chat import parse_chat
from appliance.openai_api.completions import parse_completion

# Ollama option -> the OpenAI field it is
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "typical_p": "typical_p",  # (0, 1], 1 = off, as Ollama
}
# load-time / resource options: how Ollama places and runs the model, never what it writes
RESOURCE_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",  # tokens kept when Ollama shifts a full context; the appliance never shifts
        "penalize_newline",  # Ollama's own engine ignores it (deprecated)
    }
)
# options whose no-op value is accepted (it asks for what the appliance does anyway); other values are a 400
NEUTRAL = {"tfs_z": 1.0, "mirostat": 0, "repeat_last_n": -1}
TEMPLATES = ("", "{{ .Prompt }}")  # a `template` that is the prompt itself: the same as no template


@dataclass(frozen=True)
class OllamaRequest:
    """What the Ollama routes need besides the OpenAI request: the kind of answer and its spelling."""

    model: str  # as the client sent it (Ollama echoes it)
    stream: bool
    think: bool | None  # None: not asked (thinking is returned apart when the model has a reasoning parser)
    chat: ChatRequest | None = None  # /api/chat and templated /api/generate
    completion: CompletionRequest | None = None  # /api/generate with raw: the prompt as it is
    load_only: bool = False  # no messages / empty prompt: Ollama loads the model and answers done_reason "load"
    keep_alive: float | None = None  # seconds (math.inf: forever); None: the model's default
    num_ctx: int | None = None  # the request's context window (prompt + output)


def body_json() -> Any:
    """The body of a request on `/api/*`: JSON whatever its Content-Type, as Ollama reads it (litellm's `ollama/`
    and `ollama_chat/` providers send none, `curl -d` a form type); not JSON is a 400 (adapter.json_body)."""
    return json_body(any_content_type=True)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("Received json is not an object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("model is required", "model")  # Ollama's message
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean", name)
    return value


def _think(body: dict) -> bool | None:
    value = body.get("think")
    if value is None or isinstance(value, bool):
        return value
    if value in ("low", "medium", "high"):  # gpt-oss's levels: thinking on (the level is not a knob here)
        return True
    raise invalid('think must be a boolean or one of "low", "medium", "high"', "think")


def keep_alive(body: dict) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise invalid(str(exc), "keep_alive") from None


def num_ctx(body: dict) -> int | None:
    opts = body.get("options")
    value = opts.get("num_ctx") if isinstance(opts, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid("num_ctx must be a positive integer", "num_ctx")
    return value


def options(body: dict, limits: Limits) -> dict[str, Any]:
    """`options` -> OpenAI fields (their checks are validation's, on the translated body)."""
    opts = body.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise invalid("options must be an object", "options")
    out: dict[str, Any] = {}
    for name, value in opts.items():
        if value is None or name in RESOURCE_OPTIONS:
            continue
        if name in SAMPLING_OPTIONS:
            out[SAMPLING_OPTIONS[name]] = _sampling_value(name, value)
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int):
                raise invalid("num_predict must be an integer", "num_predict")
            if value > 0:
                out["max_tokens"] = value
            elif value not in (0, -1, -2):
                raise invalid("num_predict must be positive, or -1 (until the context ends) or -2 (fill it)", name)
        elif name == "num_ctx":
            num_ctx(body)  # checked; it is the job's context window (OllamaRequest.num_ctx), not an OpenAI field
        elif name in NEUTRAL:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != NEUTRAL[name]:
                raise invalid(f"option {name} is not supported (only its neutral value {NEUTRAL[name]})", name)
        else:
            raise invalid(f"option {name} is not supported", name)
    return out


def _sampling_value(name: str, value: Any) -> Any:
    """Ollama's spellings of "off" -> OpenAI's: top_k <= 0 is all tokens, a negative seed is a random one."""
    if name == "top_k" and isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        return -1
    if name == "seed" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return None
    return value


def response_format(body: dict) -> dict | None:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise invalid('format must be "json" or a JSON schema (an object)', "format")


def _images(value: Any, where: str, limits: Limits, count: ImageCount) -> list[dict]:
    """Ollama's `images` (base64 strings, JPEG, PNG or WebP) -> chat image parts (appliance/api/images.py)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"{where} must be an array of base64 strings", "images")
    parts = []
    for j, text in enumerate(value):
        count.next(f"{where}[{j}]")
        parts.append({"type": "image", "image": base64_image(text, f"{where}[{j}]", limits)})
    return parts


def _message(m: Any, where: str, limits: Limits, count: ImageCount) -> Any:
    """An Ollama message -> OpenAI's (tool calls' arguments stay objects: the chat template takes them so; images
    before the text, as chat parts)."""
    if not isinstance(m, dict):
        return m  # validation says what is wrong
    out = {k: v for k, v in m.items() if k not in ("images", "thinking", "tool_name")}
    images = _images(m.get("images"), f"{where}.images", limits, count)
    if images:
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise invalid(f"{where}.content must be a string", "messages")
        out["content"] = [*images, *([{"type": "text", "text": content}] if content else [])]
    if m.get("role") == "tool" and isinstance(m.get("tool_name"), str):
        out["name"] = m["tool_name"]
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {"type": "function", "function": c.get("function")} if isinstance(c, dict) else c for c in calls
        ]
    return out


def _common(body: dict, limits: Limits) -> dict:
    openai: dict[str, Any] = {"model": body.get("model"), "stream": False}
    openai.update(options(body, limits))
    fmt = response_format(body)
    if fmt is not None:
        openai["response_format"] = fmt
    for name in ("logprobs", "top_logprobs"):  # chat's fields and checks (top_logprobs 0..20, with logprobs)
        if body.get(name) is not None:
            openai[name] = body[name]
    return openai


def parse_ollama_chat(body: Any, limits: Limits) -> OllamaRequest:
    req = _chat(_object(body), limits)
    return dataclasses.replace(req, keep_alive=keep_alive(body), num_ctx=num_ctx(body))


def parse_ollama_generate(body: Any, limits: Limits) -> OllamaRequest:
    req = _generate(_object(body), limits)
    return dataclasses.replace(req, keep_alive=keep_alive(body), num_ctx=num_ctx(body))


def _chat(body: dict, limits: Limits) -> OllamaRequest:
    stream, think = _bool(body, "stream", True), _think(body)
    openai = _common(body, limits)
    messages = body.get("messages")
    if not messages:
        return OllamaRequest(body["model"], stream, think, load_only=True)
    count = ImageCount(limits)
    if isinstance(messages, list):
        openai["messages"] = [_message(m, f"messages[{i}]", limits, count) for i, m in enumerate(messages)]
    else:
        openai["messages"] = messages
    if body.get("tools"):
        openai["tools"] = body["tools"]
    return OllamaRequest(body["model"], stream, think, chat=parse_chat(openai, limits))


def _generate(body: dict, limits: Limits) -> OllamaRequest:
    stream, think = _bool(body, "stream", True), _think(body)
    raw = _bool(body, "raw", False)
    if body.get("suffix"):
        raise invalid("suffix is not supported: no fill-in-the-middle yet", "suffix")
    if body.get("context"):
        raise invalid("context is not supported: send the conversation to /api/chat instead", "context")
    template = body.get("template")
    if template is not None and (not isinstance(template, str) or template.strip() not in TEMPLATES):
        raise invalid("a custom template is not supported: the model's own chat template applies", "template")
    openai = _common(body, limits)
    prompt, system = body.get("prompt"), body.get("system")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("prompt must be a string", "prompt")
    if system is not None and not isinstance(system, str):
        raise invalid("system must be a string", "system")
    if not prompt:
        return OllamaRequest(body["model"], stream, think, load_only=True)
    model = body["model"]
    images = _images(body.get("images"), "images", limits, ImageCount(limits))
    if raw or (template is not None and template.strip() == TEMPLATES[1]):
        if images:
            raise invalid(
                "images need the model's chat template, which raw (or the template {{ .Prompt }}) leaves out: send "
                "them without raw, or to /api/chat",
                "images",
            )
        if "logprobs" in openai or "top_logprobs" in openai:
            raise invalid("logprobs are not supported with raw (use /v3/completions)", "logprobs")
        openai["prompt"] = prompt
        return OllamaRequest(model, stream, think, completion=parse_completion(openai, limits))
    openai["messages"] = [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": [*images, {"type": "text", "text": prompt}] if images else prompt},
    ]
    chat = dataclasses.replace(parse_chat(openai, limits), conversation="prompt")  # the conversation is `prompt`
    return OllamaRequest(model, stream, think, chat=chat)


def with_model(req: OllamaRequest, served: str) -> OllamaRequest:
    """The request aimed at the served model `served` (the client may have said `served:latest`)."""
    if req.chat is not None:
        return dataclasses.replace(
            req, chat=dataclasses.replace(req.chat, edge=dataclasses.replace(req.chat.edge, model=served))
        )
    if req.completion is not None:
        edge = dataclasses.replace(req.completion.edge, model=served)
        return dataclasses.replace(req, completion=dataclasses.replace(req.completion, edge=edge))
    return req


def arguments_object(arguments: str) -> Any:
    """A parsed call's arguments (JSON text) as the object Ollama sends."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
