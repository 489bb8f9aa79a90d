"""End to end: LangChain's `ChatOpenAI` (langchain-openai, a test dependency) against the real server, unchanged, as
an agent framework uses it: `bind_tools(..., tool_choice=...)` (unary and streamed) and `with_structured_output` (the
json_schema and function_calling methods). The proof that a real agent-style client works.

Nothing may reach the internet: LangChain only needs tiktoken for token counting (never called here) and traces
to LangSmith only when told to (the environment variables are cleared); conftest.py's `loopback_only` guard on
`socket.connect` fails the test if anything connects anywhere but loopback.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

MAX_TOKENS = 96


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20, description="the city's name")
    unit: Literal["celsius", "fahrenheit"]


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=12)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def llm(server, model_name):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.base + "/v3",
        api_key="unused",
        model=model_name,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=300,
    )


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def tools():
    from langchain_core.tools import tool

    return {"GetWeather": GetWeather, "multiply": tool(multiply)}


# GetWeather's schema is strict (LangChain adds additionalProperties false): without it the grammar lets the model
# add properties, and the 135M model rambles in an extra "description" until max_tokens. multiply stays as LangChain
# sends a tool by default.
STRICT = {"GetWeather": {"strict": True}, "multiply": {}}
ARGS_MODELS = {"GetWeather": GetWeather}  # multiply's arguments: checked against its signature below


def check_args(name: str, args: dict) -> None:
    if name == "multiply":
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values()), args
    else:
        ARGS_MODELS[name].model_validate(args)


@pytest.mark.parametrize(
    ("name", "choice"),
    [("GetWeather", "GetWeather"), ("multiply", "multiply"), ("multiply", "any")],
    ids=["pydantic-named", "tool-named", "tool-required"],
)
def test_bind_tools_calls_the_tool(llm, name, choice):
    """tool_choice = the tool's name (OpenAI's named choice) or "any" (LangChain's word for "required")."""
    bound = llm.bind_tools([tools()[name]], tool_choice=choice, **STRICT[name])
    message = bound.invoke("What is the weather in Paris?" if name == "GetWeather" else "What is 6 times 7?")
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == name and call["id"]
    check_args(name, call["args"])
    assert message.response_metadata.get("finish_reason") == "tool_calls"


def test_bind_tools_streamed(llm):
    """Streamed tool_call deltas add up (AIMessageChunk.__add__ joins the argument fragments) to a valid call."""
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True)
    total = None
    for chunk in bound.stream("What is the weather in Berlin?"):
        total = chunk if total is None else total + chunk
    assert total is not None and total.tool_calls, total
    call = total.tool_calls[0]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    assert not total.invalid_tool_calls, total.invalid_tool_calls


def test_tool_result_round_trips(llm):
    """The assistant's tool call and the tool's answer go back into the conversation; the model then answers."""
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True)
    question = HumanMessage("What is the weather in Rome?")
    call_message = bound.invoke([question])
    call = call_message.tool_calls[0]
    answer = llm.bind_tools([GetWeather], tool_choice="none").invoke(
        [question, call_message, ToolMessage("Sunny, 24 degrees.", tool_call_id=call["id"])]
    )
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    structured = llm.with_structured_output(Pet, method=method, strict=True)
    pet = structured.invoke("Describe a pet.")
    assert isinstance(pet, Pet), pet
