"""Unit tests of the Messages adapter's two halves, without a server: request.py (an Anthropic body -> the chat
request, its refusals and bounds) and shape.py (model text -> content blocks and stream events). The end-to-end
tests with the `anthropic` SDK are tests/anthropic_api/test_anthropic_api.py; these cover what the default model cannot
show (a
reasoning model's thought, several calls, text around calls)."""

from __future__ import annotations

import json

import pytest

from appliance.anthropic_api.request import parse_messages
from appliance.anthropic_api.shape import MessageShape
from appliance.api.errors import ApiError
from appliance.api.generation import Choice
from appliance.limits import Limits

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields) -> dict:
    return {"model": "m", "max_tokens": 16, "messages": USER, **fields}


def refused(b: dict, words: str, limits: Limits = Limits()) -> None:
    with pytest.raises(ApiError) as info:
        parse_messages(b, limits)
    assert info.value.status == 400 and words in info.value.message, info.value.message


def test_blocks_become_chat_messages():
    req = parse_messages(
        body(
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain", "is_error": True},
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            stop_sequences=["END", ""],
            temperature=0.5,
            metadata={"user_id": "u"},
        )
    )
    chat = req.chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2]["content"] == "Let me look."
    assert chat.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chat.messages[3] == {"role": "tool", "content": "Error: rain", "tool_call_id": "toolu_1"}
    assert chat.tool_choice == "named" and chat.tool_name == "get_weather" and not chat.parallel_tool_calls
    assert chat.tools[0]["function"]["parameters"] == TOOL["input_schema"]
    assert chat.sampling == {"max_tokens": 16, "temperature": 0.5, "stop": ("END",), "include_stop_str_in_output": True}
    assert req.stop_sequences == ("END",) and req.one_call


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"tool_choice": {"type": {}}}, "tool_choice must be"),  # an unhashable type: a 400, not a 500 (fuzz)
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "source must be"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document' are not"),
        ({"messages": [*USER, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"messages": [{"role": "system", "content": "x"}]}, 'role is "user" or "assistant"'),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not supported"),
        ({"tools": [{"name": "t"}]}, "input_schema"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "not one of tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, ">= 1024"),
        ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "less than max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"stop_sequences": ["x"] * 17}, "no more than 16"),
        ({"stop_sequences": ["x" * 257]}, "at most 256"),
    ],
)
def test_refusals(fields, words):
    refused(body(**fields), words)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokenz": 8}, "max_tokenz: Extra inputs are not permitted"),
        ({"frequency_penalty": 1.0}, "frequency_penalty: Extra inputs are not permitted"),
        ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages.0.name: Extra inputs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "lang": "fr"}]}]},
            "messages.0.content.0.lang: Extra inputs",
        ),
        ({"system": [{"type": "text", "text": "x", "priority": 1}]}, "system.0.priority: Extra inputs"),
        ({"tools": [{**TOOL, "input_schemas": {}}]}, "tools.0.input_schemas: Extra inputs"),
        ({"tools": [TOOL], "tool_choice": {"type": "auto", "max_calls": 1}}, "tool_choice.max_calls: Extra inputs"),
        ({"thinking": {"type": "disabled", "budget": 5}}, "thinking.budget: Extra inputs"),
        ({"thinking": {"type": "disabled", "display": "omitted"}}, '"omitted" is not supported'),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "runs none"),
        ({"tools": [{**TOOL, "strict": True}]}, "strict is honoured"),
    ],
)
def test_unknown_fields_are_refused(fields, words):
    """Anthropic answers 400 for a field it does not know: one that constrains the output must not be dropped."""
    refused(body(**fields), words)


def test_sdk_fields_that_do_not_constrain_the_output_are_accepted():
    """Every field of the SDK's params that does not change the output is accepted (and ignored), at each level."""
    cached = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
    req = parse_messages(
        body(
            metadata={"user_id": "u"},
            service_tier="auto",
            speed="standard",
            inference_geo="us",
            container="c",
            diagnostics={"previous_message_id": "msg_1"},
            user_profile_id="p",
            workspace_id="w",
            context_management={"edits": []},
            system=[{"type": "text", "text": "Be brief.", **cached}],
            thinking={"type": "disabled", "display": "summarized"},
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "weather?", "citations": None, **cached}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}, "caller": None},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "toolset_name": None}]},
            ],
            tools=[{**TOOL, **cached, "strict": True, "input_examples": [{"city": "Paris"}], "defer_loading": False}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            **cached,
        )
    )
    assert req.chat.tool_choice == "required" and req.chat.tools[0]["function"]["strict"] is True


def test_bounds_are_the_chat_ones():
    limits = Limits(messages=3, tools=1)
    refused(body(messages=USER * 4), "no more than 3 messages", limits)
    # tool results are chat messages of their own: they count too
    results = [{"type": "tool_result", "tool_use_id": str(i), "content": "x"} for i in range(3)]
    refused(
        body(messages=[{"role": "user", "content": [*results, {"type": "text", "text": "?"}]}]),
        "no more than 3",
        limits,
    )
    refused(body(tools=[TOOL, {**TOOL, "name": "b"}]), "no more than 1 functions", limits)
    refused(
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 2}], max_tokens=10**12),
        "max_tokens",
    )


def run(shape: MessageShape, pieces: list[str], finish: str = "stop") -> tuple[list[dict], dict]:
    """The stream events of `pieces` (the last one finishing) and the unary answer of the same text."""
    c = Choice(0)
    events: list[dict] = []
    for i, text in enumerate(pieces):
        events += shape.delta(c, text, None, finish if i == len(pieces) - 1 else None)
    c.finish_reason = finish
    return events, shape.choice(c, False)


def rebuilt(events: list[dict]) -> list[dict]:
    """Content as an SDK accumulates it from the events."""
    content: list[dict] = []
    partial: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(content)
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                content[e["index"]][key] += delta[key]
    for index, text in partial.items():
        content[index]["input"] = json.loads(text)
    return content


def test_thought_text_and_calls_stream_as_the_unary_blocks():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "<think>It rains?</think>\n\nChecking.\n" + call
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    events, answer = run(MessageShape("hermes", reasoning=True, thinking=True), pieces)
    assert [b["type"] for b in answer["content"]] == ["thinking", "text", "tool_use"]
    assert answer["content"][0]["thinking"] == "It rains?" and answer["content"][1]["text"] == "Checking."
    assert answer["content"][2]["input"] == {"city": "Paris"} and answer["stop_reason"] == "tool_use"
    assert rebuilt(events) == answer["content"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]


def test_thought_left_out_unless_thinking_and_one_call_kept():
    call = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    _, answer = run(MessageShape("hermes", reasoning=True, one_call=True), ["<think>x</think>", call + "\n" + call])
    assert [b["type"] for b in answer["content"]] == ["tool_use"]


def test_stop_sequence_cut_and_named():
    events, answer = run(MessageShape(stop_sequences=("END", "D")), ["Hello ", "world END"])
    assert answer["content"] == [{"type": "text", "text": "Hello world "}]
    assert answer["stop_reason"] == "stop_sequence" and answer["stop_sequence"] == "END"
    assert rebuilt(events) == answer["content"]
    _, answer = run(MessageShape(stop_sequences=("END",)), ["Hello"], finish="length")
    assert answer["stop_reason"] == "max_tokens" and answer["stop_sequence"] is None
