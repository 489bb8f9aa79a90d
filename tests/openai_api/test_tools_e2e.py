"""End to end: tool calls and reasoning through the official `openai` client against the real server and default
model (the proof). The default model's template (ChatML) knows no tools, so the server writes them into the
prompt in the hermes format and parses `<tool_call>` blocks; tool_choice "required" and a named tool constrain
the output with a grammar, so their calls are checked against the tool's schema (jsonschema), unary and streamed.

Validity is asserted, never the exact text. The schema bounds its string (maxLength) so a constrained call fits well
inside MAX_TOKENS and ends on "stop"; the requests of this file are few and short.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers import WEATHER_PARAMETERS, Server

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
PARAMETERS = WEATHER_PARAMETERS
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": {}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS)


def test_named_tool_unary(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    check_weather_call(call.function.name, call.function.arguments)
    assert not choice.message.content


def test_required_streamed_deltas_concatenate_to_valid_json(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                if tc.id:
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    check_weather_call(calls[0]["name"], calls[0]["arguments"])


def test_tool_result_round_trips(client, model_name):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    before = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > before.usage.prompt_tokens + 20  # the call and its result were in the prompt


ANSWER = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 40}},
    "required": ["summary"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": ANSWER, "strict": True}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_beside_a_response_format(client, model_name, tool_choice):
    """An agent with an output type and a forced tool (openai-agents, instructor) sends a response_format with
    tool_choice required / named: the call comes, constrained by the tool's parameters, unary and streamed; the turn
    that gets the tool's result back (tool_choice auto) answers in the format."""
    forced = {"tools": TOOLS[:1], "tool_choice": tool_choice, "response_format": ANSWER_FORMAT}
    r = client.chat.completions.create(
        model=model_name, messages=ASK, parallel_tool_calls=False, max_tokens=MAX_TOKENS, **forced
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    check_weather_call(call.function.name, call.function.arguments)
    arguments, finish = "", None
    for chunk in client.chat.completions.create(
        model=model_name, messages=ASK, parallel_tool_calls=False, max_tokens=MAX_TOKENS, stream=True, **forced
    ):
        for c in chunk.choices:
            arguments += "".join(tc.function.arguments or "" for tc in c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    check_weather_call("get_weather", arguments)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}
    turn = [*ASK, choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(
        model=model_name, messages=turn, tools=TOOLS[:1], response_format=ANSWER_FORMAT, max_tokens=MAX_TOKENS
    )
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls, answer
    jsonschema.validate(json.loads(answer.choices[0].message.content), ANSWER)


def test_tool_choice_none_is_plain_content(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=model_name, messages=ASK, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": the tools are not in the prompt


@pytest.fixture(scope="module")
def thinking(model_dir, tmp_path_factory):
    with Server(
        model_dir, tmp_path_factory.mktemp("thinking") / "serve.log", "--workers", "1", "--reasoning-parser", "think"
    ) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v3", api_key="unused", max_retries=0, timeout=120)


THOUGHT_FORMAT = {"type": "regex", "schema": r"<think>[a-z ]{1,24}</think>[A-Za-z ]{1,24}"}
# every token is at least one character and the format at most 63, so the grammar closes (EOS) within this budget:
# the answer must end on "stop", never on "length"
THOUGHT_TOKENS = 72


def test_reasoning_parser_moves_the_thought(thinking):
    model = thinking.models.list().data[0].id
    r = thinking.chat.completions.create(
        model=model, messages=ASK, max_tokens=THOUGHT_TOKENS, extra_body={"response_format": THOUGHT_FORMAT}
    )
    message = r.choices[0].message.model_dump()
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert message["content"] and "<think>" not in message["content"] and "</think>" not in message["content"]
    stream = thinking.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=THOUGHT_TOKENS,
        extra_body={"response_format": THOUGHT_FORMAT},
        stream=True,
    )
    reasoning = content = ""
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            finish = c.finish_reason or finish
    assert finish == "stop" and reasoning and content, (finish, reasoning, content)
    assert "<think>" not in content and "</think>" not in content
    cut = thinking.chat.completions.create(
        model=model, messages=ASK, max_tokens=6, extra_body={"response_format": THOUGHT_FORMAT}
    )
    cut_message = cut.choices[0].message.model_dump()
    assert cut.choices[0].finish_reason == "length" and cut_message["reasoning_content"] is not None
    assert not cut_message["content"]  # cut mid-thought: the half thought is reasoning, never content


# ---------------------------------------------------------------- tool schemas as client libraries send them
class Address(BaseModel):
    street: str = Field(max_length=20)
    city: str = Field(max_length=12)


class Booking(BaseModel):
    """Book a table"""

    restaurant: str = Field(max_length=16)
    guest: Address
    billing: Address | None = None  # anyOf with null


class Node(BaseModel):
    name: str = Field(max_length=8)
    children: list[Node] = Field(max_length=2)


BOOK = [{"role": "user", "content": "Book a table at Chez Paul for me, I live at 1 rue de Rivoli, Paris."}]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_nested_pydantic_model_as_a_forced_tool(client, model_name, choice):
    """openai's pydantic_function_tool emits `$defs` and `$ref` for a nested model (and anyOf with null for an
    Optional one): the call's arguments are constrained by that schema and parse back into the model, through the
    SDK's own `parse` (parsed_arguments), unary and streamed."""
    tool = openai.pydantic_function_tool(Booking)
    assert "$defs" in tool["function"]["parameters"]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "Booking"}}
    kw = dict(model=model_name, messages=BOOK, tools=[tool], tool_choice=tool_choice, max_tokens=256, temperature=0)
    r = client.chat.completions.parse(**kw, parallel_tool_calls=False)  # required may otherwise call it again
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "Booking" and isinstance(call.function.parsed_arguments, Booking)
    assert Booking.model_validate_json(call.function.arguments) == call.function.parsed_arguments
    with client.chat.completions.stream(**kw, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Booking)


def test_recursive_pydantic_model_as_a_forced_tool(client, model_name):
    """A recursive model ("$ref": "#/$defs/Node" inside Node): every complete call validates against it."""
    tool = openai.pydantic_function_tool(Node)
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A family tree: Ann has two kids, Bob and Cy."}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "Node"
    if choice.finish_reason == "tool_calls":
        Node.model_validate_json(call.function.arguments)
    else:  # the model nested past max_tokens: the call comes back cut, as OpenAI returns it
        assert choice.finish_reason == "length" and call.function.arguments.startswith('{"name": ')


LONG_NOTE = {  # arguments far longer than max_tokens allows: the call is always cut inside its note
    "type": "function",
    "function": {
        "name": "take_note",
        "parameters": {
            "type": "object",
            "properties": {"note": {"type": "string", "minLength": 400, "maxLength": 500}},
            "required": ["note"],
        },
    },
}


def _check_cut(finish_reason: str | None, content: str | None, calls: list[tuple[str, str]]) -> None:
    """A call max_tokens cut: returned with its name and the arguments so far, finish_reason "length"."""
    assert finish_reason == "length" and not content
    [(name, arguments)] = calls
    assert name == "take_note"
    head = '{"note": "'
    assert head.startswith(arguments) or arguments.startswith(head), arguments
    with pytest.raises(ValueError):
        json.loads(arguments)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_call_max_tokens_cut_is_returned_as_far_as_it_got(client, model_name, choice):
    """OpenAI returns a tool call cut by max_tokens with finish_reason "length" and the arguments so far; so does
    the server, unary and streamed (it once returned neither content nor calls: everything generated was lost)."""
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "take_note"}}
    kw = dict(model=model_name, messages=ASK, tools=[LONG_NOTE], tool_choice=tool_choice, max_tokens=48)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    _check_cut(
        c.finish_reason,
        c.message.content,
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
    )
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices:
            content += d.delta.content or ""
            for tc in d.delta.tool_calls or []:
                call = calls.setdefault(tc.index, ["", ""])
                call[0] += tc.function.name or ""
                call[1] += tc.function.arguments or ""
            finish = d.finish_reason or finish
    _check_cut(finish, content, [(name, args) for name, args in calls.values()])


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_the_tool(client, model_name):
    bad = {"type": "function", "function": {"name": "broken", "parameters": {"$ref": "#/$defs/Missing"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_name, messages=ASK, tools=[TOOLS[0], bad], tool_choice="required", max_tokens=8
        )
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "tools", body
    assert "'broken'" in body["message"] and "Lark" not in body["message"], body
