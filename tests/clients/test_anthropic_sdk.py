"""anthropic (Anthropic's own SDK) against the real server's Messages API (/v1/messages): usage as Anthropic counts
it (input_tokens excludes the prompt's cache reads, clients add the two), unary and streamed; `messages.parse`
with a nested Pydantic model; a forced tool whose input_schema is a nested model; `messages.stream`.

tests/anthropic_api/test_anthropic_api.py runs the rest of the SDK's path (stop sequences, the raw event order, a
tool_result
round trip, count_tokens with tools, errors, API keys) on its own server."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

from .matrix import JSON_TOKENS, PERSON_PROMPT, TEXT_PROMPT, TEXT_TOKENS, TIMEOUT, Person, calling, need, settled

anthropic = need("anthropic")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "anthropic"
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK dropped its temperature argument; the server takes it
# long enough to fill whole KV blocks: the prefix cache shares full blocks only
LONG = [{"role": "user", "content": TEXT_PROMPT + " " + "The sea is wide and deep and blue. " * 16}]


@pytest.fixture(scope="module")
def client(base):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT)


def _prompt_tokens(usage) -> int:
    """The prompt's size the way Anthropic's clients add it up."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_usage_excludes_cache_reads(client, model_name):
    counted = client.messages.count_tokens(model=model_name, messages=LONG).input_tokens
    with calling(LIBRARY, "messages.create(...) twice: usage"):
        for _ in range(2):
            m = client.messages.create(model=model_name, max_tokens=4, messages=LONG, **GREEDY)
            assert _prompt_tokens(m.usage) == counted, (m.usage, counted)
            assert 0 < m.usage.output_tokens <= 4
        assert m.usage.cache_read_input_tokens > 0, m.usage  # the repeat hit the prefix cache
        assert m.usage.input_tokens == counted - m.usage.cache_read_input_tokens


def test_usage_streamed(client, model_name):
    counted = client.messages.count_tokens(model=model_name, messages=LONG).input_tokens
    with calling(LIBRARY, "messages.stream(...): message_start usage and get_final_message().usage"):
        client.messages.create(
            model=model_name, max_tokens=1, messages=LONG, **GREEDY
        )  # the prefix is cached from here on
        with client.messages.stream(model=model_name, max_tokens=4, messages=LONG, **GREEDY) as stream:
            events = list(stream)
            final = stream.get_final_message()
        start = next(e for e in events if e.type == "message_start").message.usage
        assert _prompt_tokens(start) == counted, (start, counted)
        assert _prompt_tokens(final.usage) == counted and final.usage.cache_read_input_tokens > 0, final.usage


def test_stream_text_is_the_unary_text(client, model_name):
    ask = {
        "model": model_name,
        "max_tokens": TEXT_TOKENS,
        "messages": [{"role": "user", "content": TEXT_PROMPT}],
        **GREEDY,
    }
    with calling(LIBRARY, "messages.stream(...).text_stream vs messages.create(...)"):
        unary = settled(lambda: client.messages.create(**ask))
        with client.messages.stream(**ask) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == "".join(b.text for b in unary.content if b.type == "text") and streamed
        assert final.stop_reason == unary.stop_reason and final.usage.output_tokens == unary.usage.output_tokens


class Home(BaseModel):
    city: str
    country: Literal["France", "Italy", "Spain"]


class Resident(BaseModel):
    """A nested model whose constraints survive the SDK: `messages.parse` moves those it deems unsupported
    (maxLength, minimum) into descriptions, so a Person's bounds would reach the server as prose only."""

    name: str
    home: Home


def test_parse_nested_model(client, model_name):
    with calling(LIBRARY, "messages.parse(output_format=Resident)"):
        m = client.messages.parse(
            model=model_name,
            max_tokens=JSON_TOKENS,
            messages=[{"role": "user", "content": PERSON_PROMPT}],
            output_format=Resident,
            **GREEDY,
        )
        assert m.stop_reason == "end_turn", m
        assert isinstance(m.parsed_output, Resident), m.parsed_output


def test_forced_tool_with_a_nested_input_schema(client, model_name):
    tool = {"name": "record_person", "description": "Record a person.", "input_schema": Person.model_json_schema()}
    with calling(LIBRARY, "messages.create(tools=[nested input_schema], tool_choice={'type': 'any'})"):
        m = client.messages.create(
            model=model_name,
            max_tokens=JSON_TOKENS,
            messages=[{"role": "user", "content": PERSON_PROMPT}],
            tools=[tool],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            **GREEDY,
        )
        assert m.stop_reason == "tool_use", m
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "record_person" and use.id.startswith("toolu_")
        Person.model_validate(use.input)
