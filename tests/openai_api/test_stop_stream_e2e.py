"""End to end, with the official `openai` client: `include_stop_str_in_output: false` with `stream: true` (once a
400, OVMS's rule) streams the text a unary answer has: no stop string, the stream ending where it began. Without
the field a stream on `/v3` still includes the stop string (OVMS's default, unchanged); on `/v1` it does not
(OpenAI's rule: never unless `include_stop_str_in_output: true`), completions and chat alike.

Each stream is checked against its own tokens (logprobs carry every generated token, also those whose text was held
back), so the checks hold where batching or bf16 lets two greedy runs differ; the unary answer is compared with the
stream only when both generated the same tokens.
"""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

COUNT = [{"role": "user", "content": "Count from 1 to 20 separated by commas."}]
MAX_TOKENS = 48


def tokens_text(tokens: list[bytes], finish: str | None, stop: str | None) -> str:
    """The generated tokens' text; an EOS that ended the answer is no text of it."""
    if finish == "stop" and tokens and (stop is None or stop not in b"".join(tokens).decode(errors="replace")):
        tokens = tokens[:-1]
    return b"".join(tokens).decode(errors="replace")


def unary(client, model, stop: str | None) -> tuple[str, str, str]:
    """(content, its tokens' text, finish_reason)"""
    r = client.chat.completions.create(
        model=model, messages=COUNT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stop=stop
    )
    c = r.choices[0]
    tokens = [bytes(t.bytes or []) for t in c.logprobs.content]
    return c.message.content or "", tokens_text(tokens, c.finish_reason, stop), c.finish_reason


def streamed(client, model, stop: str, **extra) -> tuple[str, str, str | None]:
    """(the content deltas joined, the text of every token the stream generated, finish_reason)"""
    content, tokens, finish = "", [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=COUNT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        stop=[stop],
        stream=True,
        extra_body=extra,
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            tokens += [bytes(t.bytes or []) for t in (c.logprobs.content or [] if c.logprobs else [])]
            finish = c.finish_reason or finish
    return content, tokens_text(tokens, finish, stop), finish


def stop_of(text: str) -> tuple[str, int]:
    """A stop string of 4 characters from the middle of `text`, at its first occurrence, and where it is."""
    at = next((i for i in range(len(text) // 3, len(text) - 4) if text.find(text[i : i + 4]) == i), None)
    assert at is not None, text
    return text[at : at + 4], at


def test_stream_without_the_stop_string_equals_the_unary_answer(client, model_name):
    text, _, _ = unary(client, model_name, None)
    stop, at = stop_of(text)

    content, tokens, finish = streamed(client, model_name, stop, include_stop_str_in_output=False)
    assert stop not in content
    if stop in tokens:  # the stream ends exactly where the stop string began in its own text
        assert (content, finish) == (tokens[: tokens.find(stop)], "stop")
    else:  # it went elsewhere: nothing held back is lost
        assert content == tokens and finish == "length"
    if tokens.startswith(text[: at + 4]):  # it went as the first answer did: the case was reached
        assert (content, finish) == (text[:at], "stop")

    answer, answer_tokens, answer_finish = unary(client, model_name, stop)
    if answer_tokens == tokens:  # the same tokens: the same text, the same ending
        assert (content, finish) == (answer, answer_finish)

    # without the field a stream includes the stop string (OVMS's default)
    content, tokens, finish = streamed(client, model_name, stop)
    if stop in tokens:
        assert (content, finish) == (tokens[: tokens.find(stop) + len(stop)], "stop")


@pytest.fixture(scope="module")
def client_v1(server) -> openai.OpenAI:
    """The `openai` client on `/v1`, OpenAI's prefix (the `client` fixture is on OVMS's `/v3`)."""
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_v1_chat_streams_no_stop_string_unless_asked(client, client_v1, model_name):
    text, _, _ = unary(client, model_name, None)
    stop, _ = stop_of(text)
    content, tokens, finish = streamed(client_v1, model_name, stop)  # no include_stop_str_in_output: OpenAI's rule
    assert stop not in content
    if stop in tokens:
        assert (content, finish) == (tokens[: tokens.find(stop)], "stop")
    answer, _, _ = unary(client_v1, model_name, stop)
    assert stop not in answer
    content, tokens, finish = streamed(client_v1, model_name, stop, include_stop_str_in_output=True)
    if stop in tokens:  # asked for: the stream ends with it
        assert (content, finish) == (tokens[: tokens.find(stop) + len(stop)], "stop")


def completion_stream(c: openai.OpenAI, model: str, stop: str, **extra) -> tuple[str, str, str | None]:
    """A streamed completion: (the text deltas joined, the text of every token generated, finish_reason)."""
    text, tokens, finish = "", "", None
    for chunk in c.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        stop=[stop],
        stream=True,
        extra_body=extra,
    ):
        for ch in chunk.choices:
            text += ch.text
            tokens += "".join(ch.logprobs.tokens or []) if ch.logprobs else ""
            finish = ch.finish_reason or finish
    return text, tokens, finish


PROMPT = "Count from 1 to 20: 1, 2, 3,"


def test_completions_stop_strings_on_v1_and_v3(client, client_v1, model_name):
    """The issue's case: a streamed completion carried the stop string its unary answer leaves out. On /v1 neither
    does; on /v3 the stream keeps OVMS's default and carries it."""
    text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    stop, _ = stop_of(text.choices[0].text)
    streamed_v1, tokens, finish = completion_stream(client_v1, model_name, stop)
    assert stop not in streamed_v1
    if stop in tokens:
        assert (streamed_v1, finish) == (tokens[: tokens.find(stop)], "stop")
    unary_v1 = client_v1.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert stop not in unary_v1.choices[0].text
    streamed_v3, tokens, finish = completion_stream(client, model_name, stop)
    if stop in tokens:
        assert (streamed_v3, finish) == (tokens[: tokens.find(stop) + len(stop)], "stop")
