"""LangChain's chat models against the real server, each over its own API: `ChatOpenAI` (/v1, chat completions and
`use_responses_api`), `ChatOllama` (/api) and `ChatAnthropic` (/v1/messages): invoke, stream (with its stop
strings left out and its usage), tools, `with_structured_output` with a nested model, and the embeddings classes.

tests/openai_api/test_langchain.py runs ChatOpenAI's tool choices and structured-output methods in depth on the shared
server; tests/ollama_api/test_ollama_e2e.py a ChatOllama smoke test on Ollama's."""

from __future__ import annotations

import jsonschema
import pytest

from .matrix import (
    JSON_TOKENS,
    PERSON_PROMPT,
    TEXT_PROMPT,
    TEXT_TOKENS,
    TIMEOUT,
    WEATHER_PARAMETERS,
    WEATHER_PROMPT,
    Person,
    calling,
    check_usage,
    cut_at_stop,
    get_weather,
    need,
    settled,
    stop_in,
)

langchain_openai = need("langchain_openai")
langchain_ollama = need("langchain_ollama")
langchain_anthropic = need("langchain_anthropic")
anthropic = need("anthropic")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py


def _openai(v1: str, model_name: str, max_tokens: int = TEXT_TOKENS, **kw):
    return langchain_openai.ChatOpenAI(
        base_url=v1,
        api_key="unused",
        model=model_name,
        max_tokens=max_tokens,
        temperature=0,
        max_retries=0,
        timeout=TIMEOUT,
        **kw,
    )


def _ollama(base: str, tag: str, num_predict: int = TEXT_TOKENS):
    return langchain_ollama.ChatOllama(base_url=base, model=tag, num_predict=num_predict, temperature=0)


def _anthropic(base: str, model_name: str, max_tokens: int = TEXT_TOKENS):
    return langchain_anthropic.ChatAnthropic(
        base_url=base, api_key="unused", model=model_name, max_tokens=max_tokens, temperature=0, max_retries=0
    )


def _joined(chunks) -> object:
    total = None
    for chunk in chunks:
        total = chunk if total is None else total + chunk
    assert total is not None, "no chunk"
    return total


@pytest.fixture
def chat(v1, base, model_name, ollama_tag):
    """The chat model class named `kind` on its API."""

    def make(kind: str, max_tokens: int = TEXT_TOKENS):
        if kind == "ChatOpenAI":
            return _openai(v1, model_name, max_tokens)
        if kind == "ChatOllama":
            return _ollama(base, ollama_tag, max_tokens)
        return _anthropic(base, model_name, max_tokens)

    return make


KINDS = ["ChatOpenAI", "ChatOllama", "ChatAnthropic"]


@pytest.mark.parametrize("kind", KINDS)
def test_invoke_and_stream(chat, kind):
    """The streamed chunks add up to the unary message (greedy), with the same usage."""
    llm = chat(kind)
    with calling(f"langchain {kind}", "invoke(prompt), stream(prompt)"):
        message = settled(lambda: llm.invoke(TEXT_PROMPT))
        assert isinstance(message.content, str) and message.content, message
        u = message.usage_metadata
        check_usage(u["input_tokens"], u["output_tokens"], u["total_tokens"], budget=TEXT_TOKENS)
        kw = {"stream_usage": True} if kind == "ChatOpenAI" else {}
        total = _joined(llm.stream(TEXT_PROMPT, **kw))
        assert total.content == message.content, (total.content, message.content)
        assert total.usage_metadata["output_tokens"] == u["output_tokens"], total.usage_metadata


@pytest.mark.parametrize("kind", KINDS)
def test_stop_is_left_out(chat, kind):
    """A stop string the answer holds: invoke and stream both end right before it."""
    llm = chat(kind)
    with calling(f"langchain {kind}", "invoke(prompt, stop=[...]), stream(prompt, stop=[...])"):
        free = settled(lambda: llm.invoke(TEXT_PROMPT)).content
        stop = stop_in(free)
        unary = llm.invoke(TEXT_PROMPT, stop=[stop]).content
        assert unary == cut_at_stop(free, stop), (unary, stop)
        streamed = _joined(llm.stream(TEXT_PROMPT, stop=[stop])).content
        assert streamed == unary, (streamed, stop)


@pytest.mark.parametrize("kind", KINDS)
def test_structured_output_nested(chat, kind):
    llm = chat(kind, JSON_TOKENS)
    with calling(f"langchain {kind}", "with_structured_output(Person).invoke(prompt)"):
        person = llm.with_structured_output(Person).invoke(PERSON_PROMPT)
        assert isinstance(person, Person), person


@pytest.mark.parametrize("kind", KINDS)
def test_tool_round_trip(chat, kind):
    """bind_tools with "any" (LangChain's word for a forced call; Ollama's API has no tool_choice, there a prose
    answer is the model's choice), then the tool's answer back in a ToolMessage."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = chat(kind, JSON_TOKENS)
    forced = kind != "ChatOllama"
    choice = {"tool_choice": "any"} if forced else {}
    weather = tool(get_weather)
    with calling(f"langchain {kind}", f"bind_tools([get_weather], **{choice}).invoke(prompt)"):
        question = HumanMessage(WEATHER_PROMPT)
        call_message = llm.bind_tools([weather], **choice).invoke([question])
        assert call_message.tool_calls or not forced, call_message
        for call in call_message.tool_calls:
            assert call["name"] == "get_weather" and call["id"], call
            jsonschema.validate(call["args"], {**WEATHER_PARAMETERS, "properties": {"city": {"type": "string"}}})
        assert not call_message.invalid_tool_calls, call_message.invalid_tool_calls
    if not call_message.tool_calls:
        return
    with calling(f"langchain {kind}", "bind_tools([get_weather]).invoke([..., AIMessage(tool_calls), ToolMessage])"):
        call = call_message.tool_calls[0]
        answer = llm.bind_tools([weather]).invoke(
            [question, call_message, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
        )
        assert answer.content or answer.tool_calls, answer


def test_anthropic_usage_counts_the_prompt_once(base, model_name):
    """langchain-anthropic adds Anthropic's cache reads to input_tokens (they are not part of it in Anthropic's
    API): on a repeated prompt whose prefix the server cached, input_tokens is still the prompt's size."""
    prompt = TEXT_PROMPT + " " + "The sea is wide and deep and blue. " * 16
    counted = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0).messages.count_tokens(
        model=model_name, messages=[{"role": "user", "content": prompt}]
    )
    llm = _anthropic(base, model_name, max_tokens=4)
    with calling("langchain ChatAnthropic", "invoke(prompt) twice: usage_metadata"):
        for _ in range(2):
            usage = llm.invoke(prompt).usage_metadata
            assert usage["input_tokens"] == counted.input_tokens, (usage, counted)
        assert usage["input_token_details"]["cache_read"] > 0, usage  # the repeat hit the prefix cache


def test_responses_api(v1, model_name):
    llm = _openai(v1, model_name, JSON_TOKENS, use_responses_api=True)
    with calling("langchain ChatOpenAI(use_responses_api=True)", "invoke(prompt)"):
        message = llm.invoke(TEXT_PROMPT)
        assert message.text and message.response_metadata.get("id", "").startswith("resp_"), message
    with calling("langchain ChatOpenAI(use_responses_api=True)", "with_structured_output(Person).invoke(prompt)"):
        assert isinstance(llm.with_structured_output(Person).invoke(PERSON_PROMPT), Person)


@pytest.mark.parametrize("kind", ["OpenAIEmbeddings", "OllamaEmbeddings"])
def test_embeddings(v1, base, embedding_model, kind):
    if kind == "OpenAIEmbeddings":  # the length check tokenizes with tiktoken, which downloads its encodings
        model = langchain_openai.OpenAIEmbeddings(
            base_url=v1, api_key="unused", model=embedding_model, check_embedding_ctx_length=False
        )
    else:
        model = langchain_ollama.OllamaEmbeddings(base_url=base, model=embedding_model)
    with calling(f"langchain {kind}", "embed_documents([...]), embed_query(...)"):
        docs = model.embed_documents(["The sea is wide.", "Paris is in France."])
        query = model.embed_query("Where is Paris?")
        assert len(docs) == 2 and len(docs[0]) == len(docs[1]) == len(query) > 0
        assert all(isinstance(x, float) for x in query)
