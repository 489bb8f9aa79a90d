"""llama-index against the real server: its Ollama LLM (llama-index-llms-ollama, over /api) for complete and chat,
unary, streamed and async, `structured_predict` with a nested model (through Ollama's `format`) and
`chat_with_tools`; its OpenAI embedding class (llama-index-embeddings-openai) over /v1.

tests/openai_api/test_client_structured.py runs llama-index's OpenAILike (structured_predict, as_structured_llm) on the
shared server."""

from __future__ import annotations

import asyncio

import pytest

from .matrix import (
    JSON_TOKENS,
    PERSON_PROMPT,
    TEXT_PROMPT,
    TEXT_TOKENS,
    TIMEOUT,
    WEATHER_PROMPT,
    Person,
    calling,
    get_weather,
    need,
    settled,
)

ollama_llm = need("llama_index.llms.ollama")
openai_embedding = need("llama_index.embeddings.openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "llama-index"


def _llm(base: str, tag: str, num_predict: int = TEXT_TOKENS):
    return ollama_llm.Ollama(
        model=tag,
        base_url=base,
        temperature=0,
        request_timeout=TIMEOUT,
        additional_kwargs={"num_predict": num_predict},
    )


def test_complete_and_chat(base, ollama_tag):
    from llama_index.core.llms import ChatMessage

    llm = _llm(base, ollama_tag)
    with calling(LIBRARY, "Ollama.complete(prompt), Ollama.stream_complete(prompt)"):
        done = settled(lambda: llm.complete(TEXT_PROMPT))
        assert done.text
        *_, last = llm.stream_complete(TEXT_PROMPT)
        assert last.text == done.text, (last.text, done.text)  # each streamed response holds the text so far
    messages = [ChatMessage(role="user", content=TEXT_PROMPT)]
    with calling(LIBRARY, "Ollama.chat(messages), Ollama.stream_chat(messages), Ollama.achat(messages)"):
        chat = settled(lambda: llm.chat(messages))
        assert chat.message.role == "assistant" and chat.message.content
        *_, last = llm.stream_chat(messages)
        assert last.message.content == chat.message.content
        assert asyncio.run(llm.achat(messages)).message.content == chat.message.content


def test_structured_predict_nested(base, ollama_tag):
    from llama_index.core.prompts import PromptTemplate

    llm = _llm(base, ollama_tag, JSON_TOKENS)
    with calling(LIBRARY, "Ollama.structured_predict(Person, PromptTemplate(...))"):
        person = llm.structured_predict(Person, PromptTemplate("{ask}"), ask=PERSON_PROMPT)
        assert isinstance(person, Person), person


def test_chat_with_tools(base, ollama_tag):
    """Ollama's API has no tool_choice: a prose answer is the model's choice; a call that comes names the tool and
    carries its arguments."""
    from llama_index.core.tools import FunctionTool

    llm = _llm(base, ollama_tag, JSON_TOKENS)
    tool = FunctionTool.from_defaults(fn=get_weather)
    with calling(LIBRARY, "Ollama.chat_with_tools([get_weather], user_msg=...)"):
        response = llm.chat_with_tools([tool], user_msg=WEATHER_PROMPT)
        calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
        assert calls or response.message.content, response
        for call in calls:
            assert call.tool_name == "get_weather" and isinstance(call.tool_kwargs, dict), call


def test_openai_embedding(v1, embedding_model):
    embed = openai_embedding.OpenAIEmbedding(model_name=embedding_model, api_base=v1, api_key="unused", max_retries=0)
    with calling(LIBRARY, "OpenAIEmbedding.get_text_embedding_batch([...]), get_query_embedding(...)"):
        docs = embed.get_text_embedding_batch(["The sea is wide.", "Paris is in France."])
        query = embed.get_query_embedding("Where is Paris?")
        assert len(docs) == 2 and len(docs[0]) == len(docs[1]) == len(query) > 0
