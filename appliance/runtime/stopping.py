"""When a sequence stops: stop strings on the text stream, and stop tokens / length limits per token."""

from __future__ import annotations

from collections.abc import Collection, Sequence, Set
from dataclasses import replace

from appliance.params import SamplingParams


class StopStringMatcher:
    """Stop-string matching over streamed text pieces, holding back as little as possible.

    `feed()` emits everything except the longest suffix that could still grow into a stop string. Which stop
    wins when several match: the one that *completes first* in the stream (smallest end position), ties broken
    by the earliest start (the longer string, so more is cut). That is the only rule that gives the same result
    however the text is split into pieces, since generation must halt as soon as any stop string is complete.
    Nothing after the stop is ever emitted; the stop string itself only when include_stop_str_in_output.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched (OpenAI's stop_reason)

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return new_text, False
        buf = self.held + new_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            # held is shorter than any stop and holds none, so str.find's first hit is this stop's earliest end
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, s = best
            self.stopped, self.stop_str, self.held = True, s, ""
            return buf[:end] if self.include else buf[:start], True
        hold = self._partial_len(buf)
        self.held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """Generation ended for another reason: the held-back text was not a stop after all."""
        out, self.held = self.held, ""
        return out


def stop_token_ids(params: SamplingParams, eos_ids: Collection[int]) -> frozenset[int]:
    """Tokens that end the sequence: EOS (unless ignore_eos) and stop_token_ids (which ignore_eos leaves on).
    Built once per sequence (SequenceSampler.stop_set): every membership test after that is O(1), however long
    a client's stop_token_ids list is."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def check_token_stop(
    token_id: int,
    num_generated: int,
    params: SamplingParams,
    stops: Set[int],
    context_full: bool,
    token_ids: Sequence[int] = (),
) -> str | None:
    """finish_reason after sampling `token_id`, or None to continue.

    stops: the sequence's stop tokens, stop_token_ids(params, eos) (a set: O(1) per check). num_generated counts
    generated tokens including this one. A stop token ends the sequence only once at least min_tokens tokens came
    before it (the sampler masks stop tokens until then, so this matters only to callers that do not mask). "stop"
    beats "length" when both apply. context_full: prompt + generated tokens fill the model's context, so no
    further token fits. token_ids: the sequence's tokens, token_id included (read only for
    params.stop_token_sequences).

    params.stop_token_sequences (Friendli's multi-token stop_tokens): "stop" when the generated tokens end with
    one of them, all of it generated (a prompt tail does not count) and its last token after min_tokens tokens,
    as a stop token (these are not masked before min_tokens: a sequence is no single token to mask). Its last
    token is this choice's stop token and is treated as one: kept in token_ids, its text left out unless
    include_stop_str_in_output (engine/text.py text_step). The tokens before it are ordinary text: they were
    streamed before anyone could know they would complete a stop sequence, so unary and streamed outputs agree.
    A client that wants none of it in the text uses a stop string instead.
    """
    if num_generated > params.min_tokens:
        if token_id in stops:
            return "stop"
        if params.stop_token_sequences and _ends_with_stop_sequence(token_id, num_generated, params, token_ids):
            return "stop"
    if (params.max_tokens is not None and num_generated >= params.max_tokens) or context_full:
        return "length"
    return None


def _ends_with_stop_sequence(
    token_id: int, num_generated: int, params: SamplingParams, token_ids: Sequence[int]
) -> bool:
    n = len(token_ids)
    for seq in params.stop_token_sequences:
        k = len(seq)
        if k and seq[-1] == token_id and k <= num_generated and k <= n and list(token_ids[n - k :]) == list(seq):
            return True
    return False


def resolve_prompt_limits(params: SamplingParams, prompt_len: int, max_context: int) -> SamplingParams:
    """params with the prompt-relative limits turned into max_tokens / min_tokens for this prompt; the same object
    when none is set (the common case).

    - max_total_tokens (Friendli: prompt + generated): max_tokens = max_total_tokens - prompt_len, or the given
      max_tokens if that is smaller (both bounds hold). ValueError (a 400) when it leaves no token to generate.
    - min_total_tokens (Friendli): min_tokens = max(min_tokens, min_total_tokens - prompt_len).
    - min_tokens_to_limit (Cerebras min_tokens -1): min_tokens = max_tokens (as resolved above), or without
      max_tokens max_context - prompt_len: the stop tokens stay masked until the length limit.
    A min_tokens above max_tokens is not an error (as with min_tokens itself): max_tokens ends the sequence.
    """
    if params.max_total_tokens is None and params.min_total_tokens is None and not params.min_tokens_to_limit:
        return params
    max_tokens, min_tokens = params.max_tokens, params.min_tokens
    if params.max_total_tokens is not None:
        room = params.max_total_tokens - prompt_len
        if room <= 0:
            raise ValueError(
                f"max_total_tokens ({params.max_total_tokens}) must be greater than the number of prompt tokens "
                f"({prompt_len}): it counts prompt + generated tokens"
            )
        max_tokens = room if max_tokens is None else min(max_tokens, room)
    if params.min_total_tokens is not None:
        min_tokens = max(min_tokens, params.min_total_tokens - prompt_len)
    if params.min_tokens_to_limit:
        min_tokens = max(min_tokens, max_tokens if max_tokens is not None else max_context - prompt_len)
    return replace(params, max_tokens=max_tokens, min_tokens=max(0, min_tokens))
