"""End to end, with the official `openai` client: `include_stop_str_in_output: false` with `stream: true` (once a
400, OVMS's rule) streams the text a unary answer has: no stop string, the stream ending where it began. Without
the field a stream still includes the stop string (OVMS's default, unchanged).

Each stream is checked against its own tokens (logprobs carry every generated token, also those whose text was held
back), so the checks hold where batching or bf16 lets two greedy runs differ; the unary answer is compared with the
stream only when both generated the same tokens.
"""

from __future__ import annotations

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


def test_stream_without_the_stop_string_equals_the_unary_answer(client, model_name):
    text, _, _ = unary(client, model_name, None)
    # a stop string of 4 characters from the middle of the answer, at its first occurrence
    at = next((i for i in range(len(text) // 3, len(text) - 4) if text.find(text[i : i + 4]) == i), None)
    assert at is not None, text
    stop = text[at : at + 4]

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
