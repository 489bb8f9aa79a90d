"""openai (OpenAI's own SDK) against the real server on /v1, the base URL the docs give OpenAI clients: stop
strings (never in the output unless asked, streamed or not), chat and completions unary and streamed with usage, a
tool round trip, `parse` with a nested model (as response_format and as a function tool), response_format beside a
forced tool, the Responses API's structured output and streamed events, embeddings, and lm-eval's loglikelihood
request (echo + logprobs + max_tokens 0).

tests/e2e/test_server_e2e.py, tests/openai_api/test_responses_e2e.py and tests/openai_api/test_embeddings.py cover the
SDK on /v3 in depth
(errors, n, logprobs, the Responses store, embedding formats)."""

from __future__ import annotations

import base64
import json

import jsonschema
import pytest

from .matrix import (
    JSON_TOKENS,
    PERSON_PROMPT,
    TEXT_PROMPT,
    TEXT_TOKENS,
    TIMEOUT,
    WEATHER_ANSWER,
    WEATHER_PARAMETERS,
    WEATHER_PROMPT,
    Person,
    calling,
    check_usage,
    cut_at_stop,
    need,
    settled,
    stop_in,
)

openai = need("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "openai"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER_PARAMETERS},
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "strict": True, "schema": Person.model_json_schema()},
}
CHAT = [{"role": "user", "content": TEXT_PROMPT}]


@pytest.fixture(scope="module")
def client(v1):
    return openai.OpenAI(base_url=v1, api_key="unused", max_retries=0, timeout=TIMEOUT)


def _streamed_text(stream, chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return "".join(c.choices[0].text for c in stream if c.choices)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_string_never_in_the_output(client, model_name, chat):
    """A stop string the greedy answer holds: unary and streamed answers end right before it; only
    `include_stop_str_in_output: true` keeps it."""
    create = client.chat.completions.create if chat else client.completions.create
    ask = {"messages": CHAT} if chat else {"prompt": "The sea is"}
    ask = {**ask, "model": model_name, "max_tokens": TEXT_TOKENS, "temperature": 0}

    def text(r) -> str:
        return r.choices[0].message.content if chat else r.choices[0].text

    call = f"{'chat.completions' if chat else 'completions'}.create(stop=[...], stream=...)"
    with calling(LIBRARY, call):
        free = text(settled(lambda: create(**ask)))
        stop = stop_in(free)
        unary = create(**ask, stop=[stop])
        assert unary.choices[0].finish_reason == "stop" and text(unary) == cut_at_stop(free, stop), (unary, stop)
        streamed = _streamed_text(create(**ask, stop=[stop], stream=True), chat)
        assert streamed == text(unary), (streamed, stop)
        kept = _streamed_text(
            create(**ask, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}), chat
        )
        assert kept == text(unary) + stop, (kept, stop)


def test_chat_unary_and_streamed(client, model_name):
    ask = {"model": model_name, "messages": CHAT, "max_tokens": TEXT_TOKENS, "temperature": 0}
    with calling(LIBRARY, "chat.completions.create(stream=True, stream_options={'include_usage': True})"):
        unary = settled(lambda: client.chat.completions.create(**ask))
        u = unary.usage
        check_usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, budget=TEXT_TOKENS)
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        last = chunks[-1]
        assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            u.prompt_tokens,
            u.completion_tokens,
        ), last
        assert _streamed_text(chunks, True) == unary.choices[0].message.content
    with calling(LIBRARY, "chat.completions.stream(...): content.delta events"):
        with client.chat.completions.stream(**ask) as stream:  # get_final_completion raises at max_tokens: the SDK's
            deltas = [e.delta for e in stream if e.type == "content.delta"]  # rule, so the deltas are compared
        assert "".join(deltas) == unary.choices[0].message.content


def test_completions_unary_and_streamed(client, model_name):
    ask = {"model": model_name, "prompt": "The sea is", "max_tokens": TEXT_TOKENS, "temperature": 0}
    with calling(LIBRARY, "completions.create(stream=True, stream_options={'include_usage': True})"):
        unary = settled(lambda: client.completions.create(**ask))
        u = unary.usage
        check_usage(u.prompt_tokens, u.completion_tokens, u.total_tokens, budget=TEXT_TOKENS)
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == u.completion_tokens, chunks[-1]
        assert _streamed_text(chunks, False) == unary.choices[0].text


def test_loglikelihood_request(client, model_name):
    """What lm-eval's `local-completions` sends to score a continuation: the prompt echoed with its logprobs."""
    with calling(LIBRARY, "completions.create(echo=True, logprobs=1, max_tokens=0)"):
        r = client.completions.create(
            model=model_name, prompt="The capital of France is Paris", echo=True, logprobs=1, max_tokens=0
        )
        choice = r.choices[0]
        assert choice.text == "The capital of France is Paris", choice
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])


def test_tool_round_trip(client, model_name):
    ask = {"model": model_name, "max_tokens": JSON_TOKENS, "temperature": 0, "tools": [TOOL]}
    question = {"role": "user", "content": WEATHER_PROMPT}
    with calling(LIBRARY, "chat.completions.create(tools=[get_weather], tool_choice='required')"):
        r = client.chat.completions.create(
            **ask, messages=[question], tool_choice="required", parallel_tool_calls=False
        )
        assert r.choices[0].finish_reason == "tool_calls", r
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    with calling(LIBRARY, "chat.completions.create(messages=[..., assistant tool_calls, tool result])"):
        answer = {"role": "tool", "tool_call_id": call.id, "content": WEATHER_ANSWER}
        follow = client.chat.completions.create(
            **ask, messages=[question, r.choices[0].message.model_dump(exclude_none=True), answer], tool_choice="none"
        )
        assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls, follow


def test_response_format_beside_a_forced_tool(client, model_name):
    """A forced call has no text for the format to constrain: the call follows the tool's schema, and the turn after
    the tool's answer follows the format."""
    ask = {"model": model_name, "max_tokens": JSON_TOKENS, "temperature": 0, "response_format": PERSON_FORMAT}
    question = {"role": "user", "content": PERSON_PROMPT + " Look up the weather where they live first."}
    with calling(LIBRARY, "chat.completions.create(response_format=json_schema, tools=[...], tool_choice='required')"):
        r = client.chat.completions.create(
            **ask, messages=[question], tools=[TOOL], tool_choice="required", parallel_tool_calls=False
        )
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    with calling(LIBRARY, "chat.completions.create(response_format=json_schema, tools=[...]) after the tool's answer"):
        answer = {"role": "tool", "tool_call_id": call.id, "content": WEATHER_ANSWER}
        history = [question, r.choices[0].message.model_dump(exclude_none=True), answer]
        follow = client.chat.completions.create(**ask, messages=history, tools=[TOOL], tool_choice="none")
        Person.model_validate_json(follow.choices[0].message.content)
    with calling(LIBRARY, "chat.completions.create(response_format=json_schema, tool_choice={named})"):
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(**ask, messages=[question], tools=[TOOL], tool_choice=named)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather", r


def test_parse_nested_model(client, model_name):
    ask = {"model": model_name, "max_tokens": JSON_TOKENS, "temperature": 0}
    messages = [{"role": "user", "content": PERSON_PROMPT}]
    with calling(LIBRARY, "chat.completions.parse(response_format=Person)"):
        r = client.chat.completions.parse(**ask, messages=messages, response_format=Person)
        assert isinstance(r.choices[0].message.parsed, Person), r
    with calling(LIBRARY, "chat.completions.parse(tools=[pydantic_function_tool(Person)])"):
        tool = openai.pydantic_function_tool(Person)
        assert "$defs" in json.dumps(tool["function"]["parameters"])
        r = client.chat.completions.parse(
            **ask, messages=messages, tools=[tool], tool_choice="required", parallel_tool_calls=False
        )
        [call] = r.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Person), call


def test_responses_parse_and_stream(client, model_name):
    with calling(LIBRARY, "responses.parse(text_format=Person)"):
        r = client.responses.parse(
            model=model_name, input=PERSON_PROMPT, text_format=Person, max_output_tokens=JSON_TOKENS
        )
        assert r.status == "completed" and isinstance(r.output_parsed, Person), r
        u = r.usage
        check_usage(u.input_tokens, u.output_tokens, u.total_tokens, budget=JSON_TOKENS)
    with calling(LIBRARY, "responses.stream(...): output_text deltas and the final response"):
        deltas, final = [], None
        with client.responses.stream(model=model_name, input=TEXT_PROMPT, max_output_tokens=TEXT_TOKENS) as stream:
            for event in stream:  # get_final_response waits for response.completed: not sent when incomplete
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
        assert final is not None and deltas and "".join(deltas) == final.output_text


def test_responses_text_format_beside_a_forced_tool(client, model_name):
    tool = {**TOOL["function"], "type": "function", "strict": True}
    fmt = {"type": "json_schema", "name": "person", "strict": True, "schema": Person.model_json_schema()}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        with calling(LIBRARY, f"responses.create(text={{'format': json_schema}}, tool_choice={choice!r})"):
            r = client.responses.create(
                model=model_name,
                input=WEATHER_PROMPT,
                tools=[tool],
                tool_choice=choice,
                text={"format": fmt},
                parallel_tool_calls=False,
                max_output_tokens=JSON_TOKENS,
            )
            [call] = [item for item in r.output if item.type == "function_call"]
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_embeddings(client, embedding_model):
    texts = ["The sea is wide.", "Paris is in France."]
    with calling(LIBRARY, "embeddings.create(input=[...]) (the SDK asks for base64)"):
        r = client.embeddings.create(model=embedding_model, input=texts)
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens > 0
        width = len(r.data[0].embedding)
        assert width > 64 and all(isinstance(x, float) for x in r.data[1].embedding)
    with calling(LIBRARY, "embeddings.create(dimensions=64, encoding_format='base64')"):
        short = client.embeddings.create(model=embedding_model, input=texts[0], dimensions=64)
        assert len(short.data[0].embedding) == 64
        raw = client.embeddings.create(model=embedding_model, input=texts[0], encoding_format="base64")
        assert len(base64.b64decode(raw.data[0].embedding)) == 4 * width
