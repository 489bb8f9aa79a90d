"""End to end: a nested Pydantic model as structured output through five client libraries (test dependencies,
pinned), each in its own default way of asking, against the real server and default model, unchanged:

- instructor: `from_openai(OpenAI(...))` is TOOLS mode, a forced tool (named `tool_choice`) whose parameters are
  the model's schema;
- pydantic-ai: an `Agent` with `output_type=` the model calls an output tool (`final_result`, tool_choice
  "required");
- litellm: `completion(model="openai/...", api_base=...)` with the model as a tool (`tool_choice` "required") and
  as `response_format=` the model;
- llama-index: `OpenAILike` (llama-index-core and llama-index-llms-openai-like, not the meta package, which pulls
  every integration) with `structured_predict` and `as_structured_llm` (forced function calling);
- langchain-openai: `ChatOpenAI.with_structured_output(Model)` (its default method, json_schema) and `bind_tools`
  with the model and a named tool_choice.

Pydantic writes a nested model as `$defs` plus `$ref` (an Optional one as anyOf with null, a discriminated union
as oneOf): each library sends that schema as it builds it (instructor's and litellm's as pydantic emits it,
pydantic-ai's with the discriminator stripped, LangChain's with the refs inlined). The answer must validate against
the model: the default model is tiny, its values may be nonsense, but the grammar guarantees the shape.

Nothing may reach the internet (litellm fetches its cost map at import unless told to use its local copy, LangChain
traces only when told to): conftest.py's `loopback_only` guard on `socket.connect` fails the test if anything
connects anywhere but loopback.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

MAX_TOKENS = 256
ASK = "Book a table at Chez Paul for me, I live at 1 rue de Rivoli, Paris."


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Booking(BaseModel):
    """Book a table."""

    restaurant: str = Field(max_length=16)
    guest: Address  # $ref into $defs
    billing: Address | None = None  # anyOf: [$ref, null]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Adoption(BaseModel):
    """Adopt a pet."""

    owner: Address
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]  # oneOf of two $refs


@pytest.fixture(scope="module")
def base(server) -> str:
    return server.base + "/v3"


def test_instructor_tools_mode(base, model_name):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300))
    assert client.mode == instructor.Mode.TOOLS  # its default for OpenAI
    booking, completion = client.chat.completions.create_with_completion(
        model=model_name,
        response_model=Booking,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,  # instructor's re-ask on a validation error would hide a bad first answer
    )
    assert isinstance(booking, Booking), booking
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "Booking"
    assert Booking.model_validate_json(call.function.arguments).model_dump() == booking.model_dump()


def _agent(base: str, model_name: str, output_type: type[BaseModel]):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(model_name, provider=OpenAIProvider(base_url=base, api_key="unused"))
    # retries=0: a first answer that does not validate fails the test (pydantic-ai would otherwise ask again)
    # one call: with tool_choice "required" the tiny model may otherwise repeat the call until max_tokens cuts one
    settings = {"max_tokens": MAX_TOKENS, "temperature": 0, "parallel_tool_calls": False}
    return Agent(model, output_type=output_type, model_settings=settings, retries=0)


def test_pydantic_ai_output_tool(base, model_name):
    """The default output mode: a tool call of `final_result`, tool_choice "required"."""
    result = _agent(base, model_name, Booking).run_sync(ASK)
    assert isinstance(result.output, Booking), result.output
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", ()) if p.part_kind == "tool-call"]
    assert calls and calls[0].tool_name == "final_result", calls


def test_pydantic_ai_discriminated_union(base, model_name):
    """pydantic-ai strips the discriminator and sends `oneOf` of two `$ref`s, which the grammar engine cannot prove
    disjoint without resolving the refs: a 400 unless the server inlines them."""
    result = _agent(base, model_name, Adoption).run_sync("Ann at 1 rue de Rivoli, Paris, adopts a cat.")
    assert isinstance(result.output, Adoption) and isinstance(result.output.pet, Cat | Dog), result.output


def test_pydantic_ai_streamed(base, model_name):
    async def run():
        async with _agent(base, model_name, Booking).run_stream(ASK) as stream:
            return await stream.get_output()

    assert isinstance(asyncio.run(run()), Booking)


def test_litellm_tool_and_response_format(base, model_name):
    import litellm
    import openai

    kw = dict(
        model="openai/" + model_name,
        api_base=base,
        api_key="unused",
        messages=[{"role": "user", "content": ASK}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        num_retries=0,
    )
    tool = openai.pydantic_function_tool(Booking)
    assert "$defs" in tool["function"]["parameters"]
    r = litellm.completion(**kw, tools=[tool], tool_choice="required", parallel_tool_calls=False)  # one call
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "Booking", r
    Booking.model_validate_json(call.function.arguments)
    r = litellm.completion(**kw, response_format=Booking)
    assert r.choices[0].finish_reason == "stop", r
    Booking.model_validate_json(r.choices[0].message.content)


@pytest.fixture(scope="module")
def llama_llm(base, model_name):
    from llama_index.llms.openai_like import OpenAILike

    # is_function_calling_model: structured_predict then forces a tool call (with False it sends tool_choice without
    # tools, a 400 from OpenAI and this server alike); context_window: the default model's (OpenAILike cannot ask)
    return OpenAILike(
        model=model_name,
        api_base=base,
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=300,
    )


def test_llama_index_structured_predict(llama_llm):
    from llama_index.core.prompts import PromptTemplate

    booking = llama_llm.structured_predict(Booking, PromptTemplate("{ask}"), ask=ASK)
    assert isinstance(booking, Booking), booking


def test_llama_index_structured_llm(llama_llm):
    from llama_index.core.llms import ChatMessage

    response = llama_llm.as_structured_llm(Booking).chat([ChatMessage(role="user", content=ASK)])
    assert isinstance(response.raw, Booking), response.raw
    assert Booking.model_validate_json(response.message.content) == response.raw


@pytest.fixture(scope="module")
def chat_openai(base, model_name):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base,
        api_key="unused",
        model=model_name,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=300,
    )


def test_langchain_with_structured_output_default(chat_openai):
    booking = chat_openai.with_structured_output(Booking).invoke(ASK)  # the default method: json_schema
    assert isinstance(booking, Booking), booking


def test_langchain_bind_tools_nested(chat_openai):
    message = chat_openai.bind_tools([Booking], tool_choice="Booking").invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] == "Booking" and not message.invalid_tool_calls
    Booking.model_validate(call["args"])
    assert message.response_metadata.get("finish_reason") == "tool_calls"


def test_the_schemas_are_nested():
    """What the tests above send is what they are about: Pydantic's refs and the union."""
    schema = json.dumps(Booking.model_json_schema())
    assert '"$ref": "#/$defs/Address"' in schema and '"anyOf"' in schema
    assert '"oneOf"' in json.dumps(Adoption.model_json_schema())
