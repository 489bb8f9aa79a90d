"""pydantic-ai against the real server through its three model classes that reach it: `OpenAIChatModel`
(/v1/chat/completions), `OpenAIResponsesModel` (/v1/responses) and `AnthropicModel` (/v1/messages): a text agent
(its usage as pydantic-ai adds it up), a nested `output_type` (its default: an output tool forced with tool_choice
"required"), `run_stream`, `NativeOutput` (response_format / text.format) on the OpenAI models, and a function tool.

Not here: `NativeOutput` on `AnthropicModel`: pydantic-ai's profile of a model name it does not know refuses it
before any request (its own rule). tests/openai_api/test_client_structured.py runs output tools (a discriminated union
too)
on the shared server."""

from __future__ import annotations

import asyncio

import pytest

from .matrix import JSON_TOKENS, PERSON_PROMPT, TEXT_PROMPT, TEXT_TOKENS, WEATHER_PROMPT, Person, calling, need

pydantic_ai = need("pydantic_ai")
anthropic = need("anthropic")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

KINDS = ["OpenAIChatModel", "OpenAIResponsesModel", "AnthropicModel"]


@pytest.fixture
def model(v1, base, model_name):
    """pydantic-ai's model of class `kind` on the server."""

    def make(kind: str):
        if kind == "AnthropicModel":
            from pydantic_ai.models.anthropic import AnthropicModel
            from pydantic_ai.providers.anthropic import AnthropicProvider

            return AnthropicModel(model_name, provider=AnthropicProvider(base_url=base, api_key="unused"))
        from pydantic_ai.models import openai as models
        from pydantic_ai.providers.openai import OpenAIProvider

        return getattr(models, kind)(model_name, provider=OpenAIProvider(base_url=v1, api_key="unused"))

    return make


def _agent(model, output_type=str, max_tokens: int = JSON_TOKENS, **kw):
    # retries=0: a first answer that does not validate fails (pydantic-ai would ask again); one call: with
    # tool_choice "required" the tiny model may otherwise repeat the output call until max_tokens cuts one
    settings = {"max_tokens": max_tokens, "temperature": 0, "parallel_tool_calls": False}
    return pydantic_ai.Agent(model, output_type=output_type, model_settings=settings, retries=0, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_text_agent(model, kind):
    """Usage as pydantic-ai adds it up: for Anthropic, input_tokens plus the cache reads; a repeated prompt whose
    prefix the server cached must count the same as the first."""
    agent = _agent(model(kind), max_tokens=TEXT_TOKENS)
    prompt = TEXT_PROMPT + " " + "The sea is wide and deep and blue. " * 16
    with calling(f"pydantic-ai {kind}", "Agent(model).run_sync(prompt) twice: output and usage"):
        first, second = agent.run_sync(prompt), agent.run_sync(prompt)
        assert isinstance(second.output, str) and second.output, second.output
        u1, u2 = first.usage, second.usage
        assert u1.input_tokens == u2.input_tokens > 0 and 0 < u2.output_tokens <= TEXT_TOKENS, (u1, u2)
        assert u2.cache_read_tokens > 0, u2  # the repeat hit the prefix cache


@pytest.mark.parametrize("kind", KINDS)
def test_output_type_nested(model, kind):
    agent = _agent(model(kind), Person)
    with calling(f"pydantic-ai {kind}", "Agent(model, output_type=Person).run_sync(prompt)"):
        result = agent.run_sync(PERSON_PROMPT)
        assert isinstance(result.output, Person), result.output
        calls = [p for m in result.all_messages() for p in getattr(m, "parts", ()) if p.part_kind == "tool-call"]
        assert calls and calls[0].tool_name == "final_result", calls


@pytest.mark.parametrize("kind", KINDS)
def test_run_stream(model, kind):
    agent = _agent(model(kind), Person)

    async def run():
        async with agent.run_stream(PERSON_PROMPT) as stream:
            return await stream.get_output()

    with calling(f"pydantic-ai {kind}", "Agent(model, output_type=Person).run_stream(prompt)"):
        assert isinstance(asyncio.run(run()), Person)


@pytest.mark.parametrize("kind", ["OpenAIChatModel", "OpenAIResponsesModel"])
def test_native_output(model, kind):
    agent = _agent(model(kind), pydantic_ai.NativeOutput(Person))
    with calling(f"pydantic-ai {kind}", "Agent(model, output_type=NativeOutput(Person)).run_sync(prompt)"):
        assert isinstance(agent.run_sync(PERSON_PROMPT).output, Person)


@pytest.mark.parametrize("kind", KINDS)
def test_function_tool(model, kind):
    """tool_choice auto: whether the model calls the tool is its choice; a call that comes has valid arguments
    (pydantic-ai validates them against the function's signature) and its result goes back."""
    calls: list[str] = []
    agent = _agent(model(kind), max_tokens=JSON_TOKENS)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return "Sunny, 21 degrees."

    with calling(f"pydantic-ai {kind}", "Agent(model, tools=[get_weather]).run_sync(prompt)"):
        result = agent.run_sync(WEATHER_PROMPT)
        returned = [p for m in result.all_messages() for p in getattr(m, "parts", ()) if p.part_kind == "tool-return"]
        assert len(returned) == len(calls) and all(isinstance(c, str) for c in calls), (returned, calls)
        assert isinstance(result.output, str)
