"""Tools and tool turns in the chat prompt, engine side: which call format the model writes, and what it reads.

- The format (`hermes`, `llama3_json`, `mistral`: appliance/api/tool_calls.py parses them) is read off the
  chat template, as OVMS's tool_parser setting names it: `[TOOL_CALLS]` -> mistral, `<|python_tag|>` -> llama3_json,
  else hermes (Qwen2.5/3's `<tool_call>`, and the format the fallback prompt below teaches). `--tool-parser`
  overrides it. The reasoning parser is `think` when the template mentions `<think>` (`--reasoning-parser`).
- A template that uses `tools` gets them as its `tools` variable, and assistant tool calls with their arguments as
  an object (the OpenAI SDK sends a JSON string; transformers templates iterate or `tojson` a dict).
- A template that does not (the default model's ChatML) would drop them: then the tools are written into the
  system message in the chosen format (a short instruction + each function's JSON), assistant calls are written
  into the assistant's text as the model would write them, and tool results become a user turn, so tools work
  with any model and a conversation with tool turns still renders.
"""

from __future__ import annotations

import json
import re
from typing import Any

from appliance.params import REASONING_FORMATS, TOOL_CALL_FORMATS

AUTO = "auto"


def template_source(chat_template: Any) -> str:
    """Every template text of a tokenizer's chat_template (a string, {name: text} or [{name, template}])."""
    if isinstance(chat_template, str):
        return chat_template
    if isinstance(chat_template, dict):
        return "\n".join(str(v) for v in chat_template.values())
    if isinstance(chat_template, list):
        return "\n".join(str(d.get("template", "")) for d in chat_template if isinstance(d, dict))
    return ""


def _setting(setting: str, names: tuple[str, ...], what: str) -> str | None:
    """A serve flag's parser name (None: auto); ValueError names the choices."""
    if setting == AUTO:
        return None
    if setting not in names:
        raise ValueError(f"unknown {what} parser {setting!r}: auto or one of {', '.join(names)}")
    return setting


def choose_tool_parser(chat_template: Any, setting: str = AUTO) -> str:
    if chosen := _setting(setting, TOOL_CALL_FORMATS, "tool"):
        return chosen
    source = template_source(chat_template)
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source:
        return "llama3_json"
    return TOOL_CALL_FORMATS[0]


def choose_reasoning_parser(chat_template: Any, setting: str = AUTO) -> str:
    if chosen := _setting(setting, REASONING_FORMATS, "reasoning"):
        return chosen
    return "think" if "<think>" in template_source(chat_template) else "none"


def uses_tools(chat_template: Any) -> bool:
    """The template reads the `tools` variable inside a Jinja tag (prose that says "tools" does not count)."""
    return re.search(r"\{[%{][^}]*\btools\b", template_source(chat_template)) is not None


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _calls(message: dict) -> list[dict]:
    """The message's tool calls as {name, arguments: dict} (OpenAI nests them in `function`)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        out.append({"name": str(fn.get("name", "")), "arguments": _arguments(fn.get("arguments", {}))})
    return out


def _native_call(call: dict) -> dict:
    fn = call.get("function")
    if isinstance(fn, dict):
        return {**call, "function": {**fn, "arguments": _arguments(fn.get("arguments", {}))}}
    return {**call, "arguments": _arguments(call.get("arguments", {}))}


def calls_text(calls: list[dict], parser: str) -> str:
    """Calls written as the model writes them in `parser`'s format."""
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps(calls)
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def tools_instruction(tools: list[dict], parser: str) -> str:
    functions = "\n".join(json.dumps(t) for t in tools)
    if parser == "llama3_json":
        example = '{"name": <function-name>, "parameters": <args-json-object>}'
        how = f"To call a function, respond with only a JSON object of the form {example}, several separated by '; '."
    elif parser == "mistral":
        how = 'To call functions, respond with [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    else:
        how = (
            "For each function call, return a JSON object with the function name and arguments within "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. The functions:\n"
        f"<tools>\n{functions}\n</tools>\n\n{how}"
    )


def _result_text(message: dict, parser: str) -> str:
    content = message.get("content") or ""
    if parser == "hermes":
        return f"<tool_response>\n{content}\n</tool_response>"
    name = message.get("name") or message.get("tool_call_id") or "the tool"
    return f"Result of {name}: {content}"


def chat_inputs(
    messages: list[dict], tools: list[dict] | None, chat_template: Any, parser: str
) -> tuple[list[dict], dict]:
    """(messages, template kwargs) for Tokenizer.encode_chat."""
    if uses_tools(chat_template):
        fixed = [
            {**m, "tool_calls": [_native_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages
        ]
        return fixed, ({"tools": tools} if tools else {})
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":  # consecutive results: one user turn (templates that need alternation)
            text = _result_text(m, parser)
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m.get("tool_calls"):
            written = calls_text(_calls(m), parser)
            content = m.get("content") or ""
            out.append({"role": m.get("role", "assistant"), "content": f"{content}\n{written}" if content else written})
        else:
            out.append(dict(m))
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        instruction = tools_instruction(tools, parser)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{instruction}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out, {}
