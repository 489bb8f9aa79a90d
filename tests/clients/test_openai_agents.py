"""openai-agents (the OpenAI Agents SDK) against the real server, as its users write agents: an `Agent` with an
`output_type` and a function tool, under `tool_choice` auto, "required" and the tool's name, on both its model
classes (`OpenAIResponsesModel` over /v1/responses, `OpenAIChatCompletionsModel` over /v1/chat/completions), with
`Runner.run` and `Runner.run_streamed`; and a conversation continued with `previous_response_id`.

What the SDK sends for a forced tool with an `output_type` is the tool choice and the output format in one request
(`text.format` / `response_format`): the call is constrained by the tool's schema, the next turn's text (after the
SDK resets `tool_choice`) by the format. A forced choice must reach the tool, and the final output must validate.
agents 0.24 raises on any `response.incomplete` (its own rule): `max_tokens` leaves room for both turns.

tests/openai_api/test_responses_e2e.py runs a tool agent with a `str` output on its own server."""

from __future__ import annotations

import asyncio

import pytest

from .matrix import AGENT_TOKENS, TIMEOUT, WEATHER_ANSWER, WEATHER_PROMPT, Weather, calling, need

agents = need("agents")
openai = need("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "openai-agents"
MODELS = {"responses": agents.OpenAIResponsesModel, "chat": agents.OpenAIChatCompletionsModel}


@pytest.fixture(autouse=True, scope="module")
def _no_tracing():
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's platform


def _agent(v1: str, model_name: str, kind: str, tool_choice: str | None, calls: list[str]):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"{WEATHER_ANSWER} in {city}"

    client = openai.AsyncOpenAI(base_url=v1, api_key="unused", max_retries=0, timeout=TIMEOUT)
    settings = agents.ModelSettings(
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=AGENT_TOKENS, temperature=0.0
    )
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather. Use the get_weather tool.",
        tools=[get_weather],
        output_type=Weather,
        model=MODELS[kind](model=model_name, openai_client=client),
        model_settings=settings,
    )


async def _run(agent, prompt: str, stream: bool, **kwargs):
    if not stream:
        return await agents.Runner.run(agent, prompt, max_turns=4, **kwargs)
    result = agents.Runner.run_streamed(agent, prompt, max_turns=4, **kwargs)
    kinds = {event.type async for event in result.stream_events()}
    assert "raw_response_event" in kinds, kinds  # the model's own stream events reached the SDK
    return result


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("tool_choice", ["auto", "required", "get_weather"])
@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_output_type_with_a_function_tool(v1, model_name, kind, tool_choice, stream):
    calls: list[str] = []
    agent = _agent(v1, model_name, kind, tool_choice, calls)
    runner = "Runner.run_streamed" if stream else "Runner.run"
    with calling(
        LIBRARY, f"{runner}(Agent(output_type=Weather, tool_choice={tool_choice!r})) on {MODELS[kind].__name__}"
    ):
        result = asyncio.run(_run(agent, WEATHER_PROMPT, stream))
        assert isinstance(result.final_output, Weather), result.final_output
        called = [item for item in result.new_items if item.type == "tool_call_item"]
        outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
        assert len(called) == len(outputs) == len(calls), (called, outputs, calls)
        if tool_choice != "auto":  # forced: the first turn is the call, the SDK then lets the model answer
            assert calls, "a forced tool_choice, and the agent never called its tool"
            assert all(c.raw_item.name == "get_weather" for c in called if hasattr(c.raw_item, "name"))


async def _two_turns(agent, stream: bool):
    """Turn 2 sends only its new input and the id of turn 1's response (one event loop: the agent's client is
    bound to it)."""
    first = await _run(agent, "What is the weather in Rome?", stream)
    second = await _run(agent, "And in Oslo?", stream, previous_response_id=first.last_response_id)
    return first, second


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_previous_response_id(v1, model_name, stream):
    """The server puts turn 1 (its input and output) back in front of turn 2's input."""
    agent = _agent(v1, model_name, "responses", None, [])
    runner = "Runner.run_streamed" if stream else "Runner.run"
    with calling(LIBRARY, f"{runner}(..., previous_response_id=result.last_response_id)"):
        first, second = asyncio.run(_two_turns(agent, stream))
        assert first.last_response_id and isinstance(first.final_output, Weather), first
        assert isinstance(second.final_output, Weather), second.final_output
        assert second.last_response_id not in (None, first.last_response_id)
        if not stream:  # a streamed run's raw responses carry no usage until the SDK has read them all
            turn1 = first.raw_responses[-1].usage.input_tokens
            assert second.raw_responses[0].usage.input_tokens > turn1, (turn1, second.raw_responses[0].usage)
