"""What the client-matrix tests share: the library import rule, failure messages that name the library and the call,
the models and tool every library is driven with, and the checks on what comes back.

The default model is SmolLM2-135M: the tests assert wire shapes, usage arithmetic, schema validity (the server
constrains the output to the schema) and the absence of stop strings, never what the model says.

lm-eval has no file here: beside the lock pip resolves only lm-eval 0.4.1 (not the current 0.4.13), and it would
bring 27 packages into the lock (datasets, pandas, pyarrow, peft, evaluate, sacrebleu, ...), while its task data
cannot be fetched offline. Its wire protocol is tested instead: test_openai_sdk.py sends its loglikelihood request
(echo + logprobs + max_tokens 0)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Literal, TypeVar

from pydantic import BaseModel, Field

from tests.helpers import ours_missing

# Bounds of every generation: small enough for the matrix's CI budget, large enough for a nested object or a tool
# call (the server's grammar ends them early) and for two turns of an agent.
TEXT_TOKENS = 24
JSON_TOKENS = 160
AGENT_TOKENS = 200
TIMEOUT = 300  # hang guard only: nothing asserts how fast anything is

TEXT_PROMPT = "Write three short sentences about the sea."
WEATHER_PROMPT = "What is the weather in Paris?"
PERSON_PROMPT = "Describe a person who lives in Paris."


def need(module: str) -> ModuleType:
    """The client library, imported. The project installs every library here (pyproject.toml's test extra,
    requirements/clients-no-deps.txt): missing under CI is a failure, outside CI (a hand-made venv) a skip."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        ours_missing(f"{module} is not installed ({exc}): `make dev-venv` installs the client libraries", True)


@contextlib.contextmanager
def calling(library: str, call: str) -> Iterator[None]:
    """Every failure inside (the library's exception or an assertion on its answer) names the library and the call,
    as a user of that library would write it."""
    try:
        yield
    except Exception as exc:
        raise AssertionError(f"{library}: {call}: {type(exc).__name__}: {exc}") from exc


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Person(BaseModel):
    """A person and where they live (a nested model: Pydantic writes `home` as a $ref into $defs)."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    home: Address


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=16)
    sky: Literal["sunny", "cloudy", "rainy"]
    temperature_c: int = Field(ge=-50, le=50)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_ANSWER = "Sunny, 21 degrees."


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"{WEATHER_ANSWER} in {city}"


T = TypeVar("T")


def settled(call: Callable[[], T]) -> T:
    """`call`'s answer the second time it is made: the reference a test compares a greedy answer to (streamed
    against unary, with a stop string against without). The first run of a prompt fills the prefix cache, and a
    run on the cached prefix computes with other numerics than the cold one, so at a near-tie the two may part
    (tests/helpers.py says why); every later run of the prompt reuses the same cached blocks, as the compared
    request does."""
    call()
    return call()


def stop_in(text: str) -> str:
    """A stop string the greedy answer `text` holds past its start: the same request with it must stop there. Derived
    from the answer, so no test depends on what the model says."""
    for word in text.split()[1:]:
        if len(word) >= 2 and text.find(word) > 0:
            return word
    raise AssertionError(f"the answer has no word to stop at: {text!r}")


def cut_at_stop(text: str, stop: str) -> str:
    """OpenAI's rule: the output ends right before the stop string's first occurrence, the stop string left out."""
    return text[: text.index(stop)]


def check_usage(prompt: int, completion: int, total: int | None = None, *, budget: int | None = None) -> None:
    """Token counts of one answer: positive, the total their sum, the completion within its budget."""
    assert prompt > 0 and completion > 0, (prompt, completion)
    if total is not None:
        assert total == prompt + completion, (prompt, completion, total)
    if budget is not None:
        assert completion <= budget, (completion, budget)
