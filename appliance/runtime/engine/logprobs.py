"""Logprobs as the requester sees them: the sampled token's (with its top alternatives) and the prompt's.

Prompt logprobs need the logits of every prompt position, not only the last: the step asks the backend for them
(StepBatch.all_logits) only for the sequences whose fed positions predict prompt tokens still missing (position
i's logits predict token i + 1), so a long prompt computed in chunks is recorded chunk by chunk.
"""

from __future__ import annotations

import numpy as np

from appliance.outputs import TokenLogprob
from appliance.runtime.beam_search import log_softmax
from appliance.runtime.sampling import SampleOutput, ranked
from appliance.runtime.sequence import Sequence
from appliance.runtime.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token's own text for logprobs (a lone byte of a multi-byte character shows as U+FFFD). Ids past
    the tokenizer's vocabulary (models pad their embedding) have no text."""
    try:
        return tokenizer.token_bytes(token).decode("utf-8", errors="replace")
    except IndexError:
        return ""


def sampled_logprobs(tokenizer: Tokenizer, seq: Sequence, token: int, out: SampleOutput, j: int) -> list[TokenLogprob]:
    """The sampled token's entry (row j of `out`) with seq.params.logprobs top alternatives."""
    k = seq.params.logprobs or 0
    top = [
        (int(i), token_text(tokenizer, int(i)), float(lp)) for i, lp in zip(out.top_ids[j][:k], out.top_logprobs[j][:k])
    ]
    return [TokenLogprob(token, token_text(tokenizer, token), float(out.logprobs[j]), top)]


def first_prompt_logprob(tokenizer: Tokenizer, seq: Sequence) -> list[TokenLogprob]:
    """The prompt logprobs before any step: nothing predicts the first prompt token, its logprob is None."""
    first = seq.token_ids[0]
    return [TokenLogprob(first, token_text(tokenizer, first), None)]


def wants_prompt_logits(seq: Sequence, n: int) -> bool:
    """Whether this step must return the logits of every position seq feeds (n of them): some of them predict
    prompt tokens whose logprobs are still missing (position i's logits predict token i + 1)."""
    done = seq.prompt_logprobs
    if done is None or len(done) >= seq.prompt_len:
        return False
    return seq.num_computed <= len(done) - 1 < seq.num_computed + n


def record_prompt_logprobs(tokenizer: Tokenizer, seq: Sequence, start: int, rows: np.ndarray) -> None:
    """Record the logprobs of the prompt tokens that rows (logits of positions start...) predict."""
    done, k = seq.prompt_logprobs, seq.params.prompt_logprobs or 0
    assert done is not None  # rows are only asked for while prompt logprobs are missing (wants_prompt_logits)
    a, b = len(done) - 1 - start, min(len(rows), seq.prompt_len - 1 - start)
    if a < 0 or a >= b:
        return
    raw = np.asarray(rows[a:b], np.float32)
    lp = log_softmax(raw)
    targets = seq.token_ids[start + a + 1 : start + b + 1]
    top = ranked(raw, k) if k else None
    for r, t in enumerate(targets):
        alts = [(int(i), token_text(tokenizer, int(i)), float(lp[r, i])) for i in top[r]] if top is not None else []
        done.append(TokenLogprob(int(t), token_text(tokenizer, int(t)), float(lp[r, t]), alts))
