"""instructor against the real server: a nested Pydantic model through each of its modes that reach an OpenAI or
Anthropic API: TOOLS (a named forced tool), TOOLS_STRICT, JSON_SCHEMA (response_format), RESPONSES_TOOLS (the
Responses API: a named forced tool *and* `text.format` in one request), partial streaming (`create_partial`), and
`from_anthropic`. instructor re-asks on a validation error unless max_retries=0: a first answer that does not
validate fails the test.

instructor 1.17 caps openai < 3.4 and jiter < 0.15: it is installed without its dependencies
(requirements/clients-no-deps.txt) and runs on the lock's openai, which this test proves it can. tests/
test_client_structured.py runs TOOLS mode with a deeper model on the shared server."""

from __future__ import annotations

import pytest

from .matrix import JSON_TOKENS, PERSON_PROMPT, TIMEOUT, Person, calling, need

instructor = need("instructor")
openai = need("openai")
anthropic = need("anthropic")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "instructor"
MESSAGES = [{"role": "user", "content": PERSON_PROMPT}]
ASK = {"messages": MESSAGES, "response_model": Person, "max_tokens": JSON_TOKENS, "max_retries": 0}


def _openai(v1: str, mode):
    return instructor.from_openai(
        openai.OpenAI(base_url=v1, api_key="unused", max_retries=0, timeout=TIMEOUT), mode=mode
    )


@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_from_openai(v1, model_name, mode):
    client = _openai(v1, instructor.Mode[mode])
    with calling(LIBRARY, f"from_openai(OpenAI(...), mode=Mode.{mode}).create(response_model=Person)"):
        person = client.create(model=model_name, temperature=0, **ASK)
        assert isinstance(person, Person), person


def test_create_partial(v1, model_name):
    """The streamed partial objects grow into the whole model."""
    client = _openai(v1, instructor.Mode.TOOLS)
    with calling(LIBRARY, "from_openai(OpenAI(...)).create_partial(response_model=Person)"):
        partials = list(client.create_partial(model=model_name, temperature=0, **ASK))
        assert len(partials) > 1, partials
        Person.model_validate(partials[-1].model_dump())


def test_from_anthropic(base, model_name):
    """Anthropic's SDK dropped its `temperature` argument; the server still takes it (greedy, as the others)."""
    client = instructor.from_anthropic(
        anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT)
    )
    with calling(
        LIBRARY, f"from_anthropic(Anthropic(...), mode=Mode.{client.mode.name}).create(response_model=Person)"
    ):
        person = client.create(model=model_name, extra_body={"temperature": 0}, **ASK)
        assert isinstance(person, Person), person
