"""Unit tests of the Responses adapter (appliance/openai_api/responses.py) and its store (response_store.py): a
Responses body -> the chat request, refusals, the event order of `ResponseEvents`, and the SQLite store's bounds,
owners and file mode. The end-to-end proof through the `openai` SDK is tests/openai_api/test_responses_e2e.py."""

from __future__ import annotations

import stat
import time

import pytest

from appliance.api.errors import ApiError
from appliance.limits import Limits
from appliance.openai_api.response_store import ResponseStore
from appliance.openai_api.responses import ResponseEvents, parse_responses

M = "m"


def test_string_input_and_instructions_become_chat_messages():
    req = parse_responses({"model": M, "input": "hi", "instructions": "be brief"}, Limits())
    assert req.chat.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    assert req.messages == [{"role": "user", "content": "hi"}]  # the next turn's prefix carries no instructions
    assert req.store and req.input_items[0]["type"] == "message" and req.input_items[0]["id"].startswith("msg_")


def test_items_calls_and_outputs():
    req = parse_responses(
        {
            "model": M,
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"type": "message", "role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ],
        },
        Limits(),
    )
    roles = [m["role"] for m in req.chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert req.chat.messages[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": "{}"}
    assert req.chat.messages[3]["tool_call_id"] == "call_1"


def test_tools_format_and_sampling_map_onto_chat():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    req = parse_responses(
        {
            "model": M,
            "input": "x",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
        },
        Limits(),
    )
    assert req.chat.sampling["max_tokens"] == 7 and req.chat.sampling["temperature"] == 0.5
    assert req.chat.tools[0]["function"]["name"] == "f" and req.chat.tool_choice == "named"
    assert req.chat.tool_name == "f" and not req.chat.parallel_tool_calls
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    req = parse_responses({"model": M, "input": "x", "text": {"format": fmt}}, Limits())
    assert req.chat.sampling["grammar"].param == "text.format"  # what the engine's refusal of the schema names
    assert req.chat.conversation == "input"  # and of the conversation


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"background": 0}, "background"),  # 0 == False in Python: still not a boolean
        ({"top_logprobs": False}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to require
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),  # no reasoning parser on this model
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",  # as OpenAI's Responses API names it
        ),
        ({"input": [{"type": "file_search_call"}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"metadata": {"k": "v" * 600}}, "metadata"),
    ],
)
def test_refusals_name_their_field(extra, param):
    with pytest.raises(ApiError) as info:
        parse_responses({"model": M, "input": "x", **extra}, Limits())
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_bounds_are_chats():
    limits = Limits(messages=2)
    with pytest.raises(ApiError, match="no more than 2"):
        parse_responses({"model": M, "input": [{"role": "user", "content": "x"}] * 3}, limits)
    with pytest.raises(ApiError, match="no more than 2"):  # the previous conversation counts too
        parse_responses({"model": M, "input": "x"}, limits, previous=[{"role": "user", "content": "y"}] * 2)


def test_reasoning_is_accepted_with_a_reasoning_parser():
    body = {"model": M, "input": "x", "reasoning": {"effort": "low"}}
    req = parse_responses(body, Limits(), reasoning_parser="think")
    assert req.reasoning == {"effort": "low"}


@pytest.mark.parametrize(
    ("reasoning", "thinking"),
    [
        (None, None),  # the template's default
        ({"effort": "none"}, False),
        ({"effort": "minimal"}, False),
        ({"effort": "low"}, True),
        ({"effort": "high", "summary": "auto"}, True),
        ({"summary": "concise"}, None),
    ],
)
def test_reasoning_effort_is_the_thinking_switch(reasoning, thinking):
    body = {"model": M, "input": "x", **({"reasoning": reasoning} if reasoning else {})}
    assert parse_responses(body, Limits(), reasoning_parser="think").thinking is thinking


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"effort": "low"}, "reasoning"),  # no reasoning parser: nothing can think
        ({"summary": "auto"}, "reasoning"),
        ({"effort": "extreme"}, "reasoning.effort"),
        ({"summary": "long"}, "reasoning.summary"),
        ({"budget": 3}, "reasoning"),
    ],
)
def test_reasoning_a_model_cannot_honour_is_a_400(reasoning, param):
    with pytest.raises(ApiError) as info:
        parse_responses({"model": M, "input": "x", "reasoning": reasoning}, Limits())
    assert info.value.status == 400 and info.value.param == param, info.value.message
    none = parse_responses({"model": M, "input": "x", "reasoning": {"effort": "none"}}, Limits())
    assert none.thinking is None  # `none` on a model without thoughts: nothing to switch off, accepted


def test_a_thought_comes_out_as_a_reasoning_item():
    """The chat shape with the `think` reasoning parser, fed as the engine streams (tags split across chunks):
    the thought is a reasoning item before the message, in the stream and in the final output alike."""
    from appliance.api.generation import Choice
    from appliance.openai_api.chat import ChatShape

    req = parse_responses(
        {"model": M, "input": "x", "reasoning": {"effort": "high"}}, Limits(), reasoning_parser="think"
    )
    shape = ChatShape.for_request(req.chat, "", "think")
    choice = Choice(0)
    ev = ResponseEvents({"id": "resp_1", "object": "response"})
    events = list(ev.opening())
    pieces = ["<thi", "nk>Six times", " seven.</th", "ink>\n\n", "It is ", "42."]
    for i, text in enumerate(pieces):
        for chunk in shape.delta(choice, text, None, "stop" if i == len(pieces) - 1 else None):
            events += ev.feed(chunk["delta"])
    events += ev.close()
    assert [i["type"] for i in ev.output] == ["reasoning", "message"]
    assert ev.output[0]["content"] == [{"type": "reasoning_text", "text": "Six times seven."}]
    assert ev.output[1]["content"][0]["text"] == "It is 42."
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Six times seven." and ev.assistant_messages() == [{"role": "assistant", "content": "It is 42."}]


def test_penalties_map_onto_chat_and_keep_its_bounds():
    req = parse_responses({"model": M, "input": "x", "frequency_penalty": 0.5, "presence_penalty": -1}, Limits())
    assert req.chat.sampling["frequency_penalty"] == 0.5 and req.chat.sampling["presence_penalty"] == -1
    with pytest.raises(ApiError) as info:
        parse_responses({"model": M, "input": "x", "presence_penalty": 1.5}, Limits(penalty=1.0))
    assert info.value.status == 400 and info.value.param == "presence_penalty"


def test_events_order_and_sequence_numbers():
    ev = ResponseEvents({"id": "resp_1", "object": "response"})
    events = list(ev.opening())
    for delta in (
        {"reasoning_content": "hmm"},
        {"content": "Hel"},
        {"content": "lo"},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ):
        events += ev.feed(delta)
    events += ev.close()
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [i["type"] for i in ev.output] == ["reasoning", "message", "function_call"]
    assert ev.output[1]["content"][0]["text"] == "Hello" and ev.output[2]["arguments"] == '{"a": 1}'
    assert ev.assistant_messages()[0]["tool_calls"][0]["id"] == "call_a"


def test_store_owner_bounds_and_mode(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path, retention=3600, max_bytes=2000)
    assert store.get("k1", "resp_a") is None and not store.delete("k1", "resp_a") and not path.exists()
    body = {"id": "resp_a", "output": ["x" * 500]}
    assert store.put("k1", body, [], [])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.get("k1", "resp_a").response == body  # type: ignore[union-attr]
    assert store.get("k2", "resp_a") is None and not store.delete("k2", "resp_a")
    assert store.put("k1", {"id": "resp_b", "output": ["y" * 500]}, [], [])
    assert store.put("k1", {"id": "resp_c", "output": ["z" * 1200]}, [], [])  # over 2000 bytes: the oldest goes
    assert store.get("k1", "resp_a") is None and store.get("k1", "resp_c") is not None
    assert not store.put("k1", {"id": "resp_d", "output": ["w" * 3000]}, [], [])  # larger than the budget
    short = ResponseStore(path, retention=0.05, max_bytes=10**6)
    time.sleep(0.1)
    assert short.get("k1", "resp_c") is None  # past the retention: not answered (and dropped at the next write)
    assert store.delete("k1", "resp_c") and store.get("k1", "resp_c") is None


def test_store_budget_is_per_key(tmp_path):
    """One key's writes evict only its own oldest responses: another key's stay, whatever the first one stores
    (a shared budget let one key erase every other key's conversations)."""
    store = ResponseStore(tmp_path / "r.sqlite3", retention=3600, max_bytes=2000)
    assert store.put("a", {"id": "resp_a", "output": ["a" * 1500]}, [], [])
    for i in range(20):
        assert store.put("b", {"id": f"resp_b{i}", "output": ["b" * 900]}, [], [])
    assert store.get("a", "resp_a") is not None
    kept = [i for i in range(20) if store.get("b", f"resp_b{i}") is not None]
    assert kept == [18, 19]  # b's own budget: its newest two of ~950 bytes each


THINKING_TEMPLATE = (  # Qwen3's switch, reduced: enable_thinking false writes an empty thought into the prompt
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize(("effort", "empty_thought"), [("minimal", True), ("high", False), (None, False)])
def test_the_effort_reaches_the_chat_template(model_dir, effort, empty_thought):
    """The Job the route builds carries the switch (PromptSpec.thinking) and the engine's prompt rendering passes
    it to the template as `enable_thinking`: a Qwen3-style template then writes an empty thought into the prompt."""
    from types import SimpleNamespace

    from appliance.api.request import chat_job
    from appliance.params import SamplingParams
    from appliance.runtime.tokenizer import Tokenizer
    from appliance.server.prompts import prompt_ids

    body = {"model": M, "input": "hi", **({"reasoning": {"effort": effort}} if effort else {})}
    req = parse_responses(body, Limits(), reasoning_parser="think")
    job = chat_job(req.chat, SamplingParams(), "r")
    job.prompts[0].thinking = req.thinking  # as responses_routes.create does
    tok = Tokenizer.from_dir(model_dir)
    tok.chat_template = THINKING_TEMPLATE
    engine = SimpleNamespace(tokenizer=tok, max_context=4096)
    slot = SimpleNamespace(engine=engine, parsers=lambda: ("", "think"))
    rendered = tok.decode(prompt_ids(job.prompts[0], slot))  # type: ignore[arg-type]  (special tokens left out)
    assert rendered.endswith("assistant\n" + ("<think>\n\n</think>\n\n" if empty_thought else ""))
