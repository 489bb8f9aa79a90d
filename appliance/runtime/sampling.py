"""Batched next-token sampling in numpy.

Processors, in order (each vectorised over the batch; a row whose parameter is neutral is left alone):
  1. logit_bias    logits[t] += bias[t]
  2. penalties     repetition (transformers: over prompt + generated; positive logits divided, negative
                   multiplied), then frequency/presence (OpenAI: over generated tokens only;
                   logits[t] -= count[t] * frequency + (count[t] > 0) * presence)
  3. min_tokens    stop tokens (EOS unless ignore_eos, plus stop_token_ids) -> -inf while fewer than min_tokens
                   tokens have been generated
     grammar       structured output (runtime/grammar.py): tokens the row's grammar disallows -> -inf, last, so
                   it wins over every mask above (a row they left empty: raw logits under the grammar mask)
  4. greedy rows (temperature < 1e-5, as vLLM): argmax of the processed logits, ties -> lowest id.
     Sampling rows: / temperature -> top_k -> top_p -> min_p -> typical_p -> inverse-CDF draw over the
     surviving tokens in token-id order, with one uniform from the sequence's own Generator. Every step is
     row-local, so a seed gives the same tokens whatever else shares the batch.
top_p is renormalised after top_k (transformers, vLLM); min_p is relative to the best token (so order-free).
typical_p (locally typical sampling, Meister et al. 2022) comes last, as transformers' TypicalLogitsWarper does:
on the distribution the earlier filters left (renormalised), it keeps the tokens whose surprisal -log p is
closest to that distribution's entropy, closest first, until they hold typical_p of the mass (the token that
crosses it, and any tied with it, included; so at least one token).
Rankings (top_k, top_p, logprobs) break ties towards the lowest token id.
Reported logprobs are the model's raw log-softmax, before bias, penalties, grammar masks and temperature.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from appliance.params import SamplingParams
from appliance.runtime.grammar import apply_grammar_masks
from appliance.runtime.stopping import stop_token_ids

if TYPE_CHECKING:
    from appliance.runtime.bans import Bans
    from appliance.runtime.grammar import GrammarMatcher  # noqa: F401 (the annotation above)

GREEDY_EPS = 1e-5
_BLOCK = 64  # ids per block: blocked top-m preselection and blocked inverse-CDF sums
_NUCLEUS_START = 64  # top_p: candidates ranked first; a larger nucleus takes a value sort of its row
_TYPICAL_START = 256  # typical_p: candidates sorted first; 8x more while they hold less than typical_p


class TokenCounts:
    """Distinct token ids with their counts: O(1) per add, numpy views for vectorised penalties, no V-sized
    state (penalties touch only tokens that occurred, so the per-step cost is O(distinct tokens), not O(V))."""

    def __init__(self, ids: Sequence[int] = ()):
        uniq, cnt = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        n, cap = len(uniq), max(64, 2 * len(uniq))
        self._ids, self._cnt = np.zeros(cap, np.int64), np.zeros(cap, np.int32)
        self._ids[:n], self._cnt[:n], self.n = uniq, cnt, n
        self._pos = dict(zip(uniq.tolist(), range(n)))

    def add(self, token_id: int) -> None:
        j = self._pos.get(token_id)
        if j is None:
            if self.n == len(self._ids):
                self._ids, self._cnt = np.resize(self._ids, 2 * self.n), np.resize(self._cnt, 2 * self.n)
            j = self._pos[token_id] = self.n
            self._ids[j], self._cnt[j] = token_id, 0
            self.n += 1
        self._cnt[j] += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.n]

    @property
    def counts(self) -> np.ndarray:
        return self._cnt[: self.n]


@dataclass
class SequenceSampler:
    """Per-sequence sampling state. The engine calls `append(token)` after every step (sample_batch does not:
    the engine decides which tokens are kept). seq_index separates the n > 1 children of one seeded request
    (child 0 uses the seed as is, so n=1 and n>1 agree on the first sequence)."""

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    eos_ids: Collection[int] = ()
    seq_index: int = 0
    output_ids: list[int] = field(default_factory=list, init=False)
    # set by the engine when the request asks for them (Admission._start): the grammar's matcher
    # (runtime/grammar.py) and the banned-sequence state (runtime/bans.py: bad words, no_repeat_ngram)
    grammar: GrammarMatcher | None = field(default=None, init=False)
    bans: Bans | None = field(default=None, init=False)

    def __post_init__(self):
        p = self.params
        seed = p.seed if p.seed is None or self.seq_index == 0 else [p.seed, self.seq_index]
        self.rng = np.random.default_rng(seed)  # None: fresh OS entropy
        self.stop_set = stop_token_ids(p, self.eos_ids)  # frozenset: the engine's O(1) stop-token check
        self.stop_ids = np.array(sorted(self.stop_set), dtype=np.int64)  # the same tokens, for the min_tokens mask
        self.bias_ids = np.array(list(p.logit_bias), dtype=np.int64)
        self.bias_vals = np.array(list(p.logit_bias.values()), dtype=np.float32)
        # repetition: prompt + generated (transformers); frequency/presence: generated only (OpenAI)
        self.seen = TokenCounts(self.prompt_ids) if p.repetition_penalty != 1.0 else None
        self.generated = TokenCounts() if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 else None

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def masking_stops(self) -> bool:
        return self.num_generated < self.params.min_tokens and len(self.stop_ids) > 0

    def append(self, token_id: int) -> None:
        token_id = int(token_id)
        self.output_ids.append(token_id)
        if self.seen is not None:
            self.seen.add(token_id)
        if self.generated is not None:
            self.generated.add(token_id)
        if self.grammar is not None:
            self.grammar.consume(token_id)


@dataclass
class SampleOutput:
    token_ids: np.ndarray  # int64[B]
    logprobs: np.ndarray  # float32[B]: the chosen token under the raw log-softmax (NaN: row did not ask)
    top_ids: np.ndarray  # int64[B, k], k = max requested logprobs over the batch; best first
    top_logprobs: np.ndarray  # float32[B, k] (NaN in rows that did not ask)


_tls = threading.local()


def _scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Reused float32 work buffers: fresh B x V arrays every step cost page faults that can exceed the math."""
    bufs = _tls.__dict__.setdefault("bufs", {})
    n = int(np.prod(shape))
    if (b := bufs.get(name)) is None or b.size < n:
        b = bufs[name] = np.empty(n, np.float32)
    return b[:n].reshape(shape)


def _scatter(rows_ids: list[tuple[int, np.ndarray]], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, ids) for a fancy-indexed update, and the mask of pairs kept (ids outside the logits dropped)."""
    r = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids in rows_ids])
    c = np.concatenate([ids for _, ids in rows_ids])
    ok = (c >= 0) & (c < vocab)
    return r[ok], c[ok], ok


def apply_processors(logits: np.ndarray, seqs: list[SequenceSampler], out: np.ndarray | None = None) -> np.ndarray:
    """Steps 1-3 into `out` (float32, logits' shape; allocated if None). Returns logits itself, uncopied, when no
    sequence uses any of them."""
    if not any(
        len(s.bias_ids) or s.seen is not None or s.generated is not None or s.masking_stops or s.bans or s.grammar
        for s in seqs
    ):
        return logits
    x = np.empty(logits.shape, np.float32) if out is None else out
    np.copyto(x, logits)
    V = x.shape[1]
    if biased := [(i, s) for i, s in enumerate(seqs) if len(s.bias_ids)]:
        r, c, ok = _scatter([(i, s.bias_ids) for i, s in biased], V)
        x[r, c] += np.concatenate([s.bias_vals for _, s in biased])[ok]  # (row, id) pairs unique: no add.at
    if rep := [(i, s.seen.ids) for i, s in enumerate(seqs) if s.seen is not None]:
        r, c, ok = _scatter(rep, V)
        rp = np.repeat(
            np.array([seqs[i].params.repetition_penalty for i, _ in rep], np.float32), [len(ids) for _, ids in rep]
        )[ok]
        v = x[r, c]
        x[r, c] = np.where(v < 0, v * rp, v / rp)
    if gen := [(i, s.generated) for i, s in enumerate(seqs) if s.generated is not None and s.generated.n]:
        r, c, ok = _scatter([(i, g.ids) for i, g in gen], V)
        cnt = np.concatenate([g.counts for _, g in gen])[ok].astype(np.float32)
        sizes = [g.n for _, g in gen]
        f = np.repeat(np.array([seqs[i].params.frequency_penalty for i, _ in gen], np.float32), sizes)[ok]
        p = np.repeat(np.array([seqs[i].params.presence_penalty for i, _ in gen], np.float32), sizes)[ok]
        x[r, c] -= cnt * f + p  # every listed token occurred, so presence applies to all of them
    if banned := [(i, ids) for i, s in enumerate(seqs) if s.bans is not None and len(ids := s.bans.banned(s))]:
        r, c, _ = _scatter(banned, V)
        x[r, c] = -np.inf
    if masked := [(i, s.stop_ids) for i, s in enumerate(seqs) if s.masking_stops]:
        r, c, _ = _scatter(masked, V)
        x[r, c] = -np.inf
    if any(s.grammar is not None for s in seqs):
        apply_grammar_masks(x, logits, seqs)  # appliance/runtime/grammar.py: the grammar wins over every mask above
    dead = ~np.isfinite(x.max(axis=1))  # everything masked (or NaN): fall back to the raw row, never crash
    if dead.any():
        x[dead] = logits[dead]
    return x


# -- ranking ---------------------------------------------------------------------------------------------------


def _ranked_exact(x: np.ndarray, m: int) -> np.ndarray:
    B, W = x.shape
    t = np.partition(x, W - m, axis=1)[:, W - m, None]  # the m-th largest value
    take = x >= t
    extra = take.sum(axis=1) - m
    if extra.any():  # ties at t straddle the cut: keep only the lowest-id tied entries
        r = np.nonzero(extra)[0]
        eq = x[r] == t[r]
        take[r] = (x[r] > t[r]) | (eq & (np.cumsum(eq, axis=1) <= (eq.sum(axis=1) - extra[r])[:, None]))
    idx = np.nonzero(take)[1].reshape(B, m)  # row-major: ascending ids within a row
    order = np.argsort(-np.take_along_axis(x, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1)


def _block_cols(blocks: np.ndarray, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Column ids [B, n * _BLOCK] of blocks [B, n], clipped to V - 1, and the mask of the real ones."""
    cols = (blocks[:, :, None] * _BLOCK + np.arange(_BLOCK)).reshape(len(blocks), -1)
    return np.minimum(cols, V - 1), cols < V


def ranked(x: np.ndarray, m: int) -> np.ndarray:
    """int64[B, m]: per row, the ids of the m largest values, best first, ties -> lowest id (exactly m ids).

    Small m preselects blocks of _BLOCK ids: the m blocks with the largest maxima hold every top-m value (they
    hold m values >= the m-th largest block max, so the m-th largest value is >= it and no other block reaches
    it), so m * _BLOCK values are partitioned instead of V. A row where another block ties that max uses V.
    """
    B, V = x.shape
    if m >= V:
        return np.argsort(-x, axis=1, kind="stable")
    if m * _BLOCK * 4 > V:
        return _ranked_exact(x, m)
    bmax = np.maximum.reduceat(x, np.arange(0, V, _BLOCK), axis=1)
    nb = bmax.shape[1]
    top = np.sort(np.argpartition(bmax, nb - m, axis=1)[:, nb - m :], axis=1)
    mth = np.take_along_axis(bmax, top, axis=1).min(axis=1, keepdims=True)
    cols, real = _block_cols(top, V)
    cand = np.where(real, np.take_along_axis(x, cols, axis=1), -np.inf)
    out = np.take_along_axis(cols, _ranked_exact(cand, m), axis=1)
    if (bad := (bmax >= mth).sum(axis=1) > m).any():
        out[bad] = _ranked_exact(x[bad], m)
    return out


# -- truncation and drawing, on weights w = exp(x - max) (the best token weighs 1) ------------------------------


def _exclusive_cumsum(w: np.ndarray) -> np.ndarray:
    """Mass ranked strictly above each position (float64, sequential: the same sums for any prefix length)."""
    excl = np.zeros(w.shape, np.float64)
    np.cumsum(w[:, :-1], axis=1, dtype=np.float64, out=excl[:, 1:])
    return excl


def _nucleus(w: np.ndarray, total: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """On rank-ordered weights: keep a token while the mass ranked above it is < top_p (the minimal set that
    reaches top_p; the best token always). Also: whether the nucleus closed within these columns."""
    limit = (top_p * total)[:, None]
    excl = _exclusive_cumsum(w)
    keep = excl < limit
    keep[:, 0] = True
    return keep, excl[:, -1] + w[:, -1] >= limit[:, 0]


def _top_p_full(e: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nucleus of the whole vocabulary without an argsort of it. Returns (ids, weights) [B, width], weight 0
    where dropped. The top 64 (ranked()) settle most rows. For the others, the m largest weights (np.partition,
    then a sort of just those; m = 512, 4096, ..., V) give the nucleus size n and its smallest weight t once
    they hold top_p of the mass; the nucleus is every token above t plus the lowest-id tokens equal to t.
    Every stage sums the same descending values, so all agree with a full sort."""
    B, V = e.shape
    total = e.sum(axis=1, dtype=np.float64)
    limit = top_p * total
    m = min(_NUCLEUS_START, V)
    ids = ranked(e, m)
    w = np.take_along_axis(e, ids, axis=1)
    keep, done = _nucleus(w, total, top_p)
    w[~keep] = 0.0
    if done.all() or m == V:
        return ids, w
    r = np.nonzero(~done)[0]
    sub = e[r]
    n, t = np.zeros(len(r), np.int64), np.zeros(len(r), np.float32)
    pending = np.arange(len(r))
    while len(pending):
        m = min(m * 8, V)
        part = sub[pending] if m == V else np.partition(sub[pending], V - m, axis=1)[:, V - m :]
        s = np.sort(part, axis=1)[:, ::-1]
        excl = _exclusive_cumsum(s)
        closed = (excl[:, -1] + s[:, -1] >= limit[r[pending]]) | (m == V)
        k = np.maximum((excl < limit[r[pending], None]).sum(axis=1), 1)
        n[pending[closed]] = k[closed]
        t[pending[closed]] = s[closed, k[closed] - 1]
        pending = pending[~closed]
    take = sub > t[:, None]
    short = n - take.sum(axis=1)  # >= 1 tokens equal to t belong in; the lowest ids if not all of them do
    eq = sub == t[:, None]
    if (tie := short < eq.sum(axis=1)).any():
        eq[tie] &= np.cumsum(eq[tie], axis=1) <= short[tie, None]
    rows, cols = np.nonzero(take | eq)  # row-major: ascending ids, n[i] of them in row i
    width = max(int(n.max()), ids.shape[1])
    out_ids, out_w = np.zeros((B, width), np.int64), np.zeros((B, width), np.float32)
    out_ids[:, : ids.shape[1]], out_w[:, : w.shape[1]] = ids, w
    out_ids[r], out_w[r] = 0, 0.0
    pos = np.arange(len(cols)) - np.repeat(np.cumsum(n) - n, n)
    out_ids[r[rows], pos], out_w[r[rows], pos] = cols, sub[rows, cols]
    return out_ids, out_w


def _typical(w: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """Locally typical truncation of weights w [B, W] (0: dropped), transformers' TypicalLogitsWarper rule on the
    renormalised distribution p = w / S: rank tokens by |-log p - H| (H the entropy), keep every token whose
    distance is at most that of the first one at which the ranked mass reaches `mass`. Returns the weights with
    the others zeroed.

    Ties in the ranking do not move the cut (it is a distance, and the mass before and after a group of tied
    tokens is the same in any order), so the ranking needs no stable sort. Distances are float32 over the row,
    masses float64 over the candidates only: |-log p - H| = |log w - (log S - H)|. Like _top_p_full, only the m
    closest tokens (np.argpartition, m = 256, 2048, ..., W) are sorted until they hold `mass`. Measured on V =
    49152 random logits, one row: a float64 argsort of the row 3.6 ms (12 ms stable), this 1-2 ms."""
    B, W = w.shape
    total = w.sum(axis=1, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logw = np.log(w)  # -inf where dropped: those rank last (distance inf) and weigh nothing
        wlogw = np.sum(w * logw, axis=1, dtype=np.float64, where=w > 0)
    entropy = np.log(total) - wlogw / total
    shifted = np.abs(logw - (np.log(total) - entropy).astype(np.float32)[:, None])
    cut = np.full(B, np.inf, np.float32)
    pending, m = np.arange(B), _TYPICAL_START
    while len(pending):
        m = min(m, W)
        s, q = shifted[pending], w[pending]
        if m < W:
            closest = np.argpartition(s, m - 1, axis=1)[:, :m]
            s, q = np.take_along_axis(s, closest, axis=1), np.take_along_axis(q, closest, axis=1)
        order = np.argsort(s, axis=1)
        s = np.take_along_axis(s, order, axis=1)
        cum = np.cumsum(np.take_along_axis(q, order, axis=1), axis=1, dtype=np.float64) / total[pending, None]
        closed = (cum[:, -1] >= mass[pending]) | (m == W)
        last = np.minimum((cum < mass[pending, None]).sum(axis=1), m - 1)  # W - 1 if rounding never reaches it
        cut[pending[closed]] = s[closed, last[closed]]
        pending, m = pending[~closed], m * 8
    return np.where(shifted <= cut[:, None], w, 0.0).astype(w.dtype, copy=False)


def _draw_candidates(ids: np.ndarray, w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over candidate tokens (weight 0: dropped), taken in token-id order like the full-vocabulary
    draw, so a token depends only on (surviving set, weights, u), never on which path found the set."""
    order = np.argsort(ids, axis=1, kind="stable")
    ids, w = np.take_along_axis(ids, order, axis=1), np.take_along_axis(w, order, axis=1)
    cdf = np.cumsum(w, axis=1, dtype=np.float64)
    j = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    last = w.shape[1] - 1 - np.argmax(w[:, ::-1] > 0, axis=1)  # u * total rounded up to the total
    return ids[np.arange(len(ids)), np.minimum(j, last)]


def _draw_full(e: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over the whole vocabulary in id order: block sums, then within the chosen block (np.cumsum
    over V is several times slower than blocked sums)."""
    B, V = e.shape
    bsum = np.add.reduceat(e, np.arange(0, V, _BLOCK), axis=1, dtype=np.float64)
    cb = np.cumsum(bsum, axis=1)
    thr = u * cb[:, -1]
    last_blk = bsum.shape[1] - 1 - np.argmax(bsum[:, ::-1] > 0, axis=1)
    blk = np.minimum((cb <= thr[:, None]).sum(axis=1), last_blk)
    cols, real = _block_cols(blk[:, None], V)
    inner = np.where(real, np.take_along_axis(e, cols, axis=1), 0.0)
    before = np.where(blk > 0, cb[np.arange(B), np.maximum(blk - 1, 0)], 0.0)
    j = (before[:, None] + np.cumsum(inner, axis=1, dtype=np.float64) <= thr[:, None]).sum(axis=1)
    last = _BLOCK - 1 - np.argmax(inner[:, ::-1] > 0, axis=1)
    return blk * _BLOCK + np.minimum(j, last)


def _sample(x: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Temperature -> top_k -> top_p -> min_p -> typical_p -> draw for the sampling rows; x is scratch and gets
    overwritten. Rows are grouped by which truncations they use; each group is vectorised and row-local."""
    B, V = x.shape
    x /= np.array([p.temperature for p in params], dtype=np.float32)[:, None]
    k = np.array([p.top_k if 0 < p.top_k < V else 0 for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)[:, None]
    typical = np.array([p.typical_p for p in params], dtype=np.float64)
    out = np.zeros(B, dtype=np.int64)

    def typical_of(g: np.ndarray, w: np.ndarray) -> np.ndarray:
        """w (the rows g, 0: dropped) after typical_p, in place; rows with typical_p 1 untouched."""
        if (t := typical[g] < 1.0).any():
            w[t] = _typical(w[t], typical[g][t])
        return w

    def rows_of(g: np.ndarray) -> np.ndarray:
        return x if len(g) == B else x[g]

    if (g := np.nonzero(k)[0]).size:  # top_k: everything after works on the k candidates only
        sub = rows_of(g)
        ids = ranked(sub, int(k[g].max()))
        v = np.take_along_axis(sub, ids, axis=1)
        w = np.where(np.arange(ids.shape[1]) < k[g, None], np.exp(v - v[:, :1]), 0.0)
        if (t := top_p[g] < 1.0).any():  # renormalised within the top k
            keep, _ = _nucleus(w[t], w[t].sum(axis=1, dtype=np.float64), top_p[g][t])
            w[t] = np.where(keep, w[t], 0.0)
        out[g] = _draw_candidates(ids, typical_of(g, np.where(w >= min_p[g], w, 0.0)), u[g])
    for nucleus in (True, False):  # no top_k: with top_p, then without
        if not (g := np.nonzero((k == 0) & ((top_p < 1.0) == nucleus))[0]).size:
            continue
        e = rows_of(g)
        e -= e.max(axis=1, keepdims=True)
        np.exp(e, out=e)  # in place: weights; the best token weighs exactly 1, so min_p compares with min_p itself
        if nucleus:
            ids, w = _top_p_full(e, top_p[g])
            out[g] = _draw_candidates(ids, typical_of(g, np.where(w >= min_p[g], w, 0.0)), u[g])
        else:
            if (min_p[g] > 0).any():
                e[e < min_p[g]] = 0.0
            out[g] = _draw_full(typical_of(g, e), u[g])
    return out


def sample_batch(logits: np.ndarray, seqs: list[SequenceSampler]) -> SampleOutput:
    """Next token for every row of logits[B, V] (row i belongs to seqs[i]); processor order in the module doc.
    `logprobs` / `top_logprobs` are the model's raw log-softmax, before bias, penalties, temperature and
    truncation (what OpenAI and vLLM report). Does not append: the engine calls seq.append() on kept tokens."""
    raw = np.asarray(logits, dtype=np.float32)
    B, V = raw.shape
    if len(seqs) != B:
        raise ValueError(f"{B} logit rows for {len(seqs)} sequences")
    x = apply_processors(raw, seqs, out=_scratch("proc", raw.shape))
    tokens = np.argmax(x, axis=1).astype(np.int64)
    if rows := [i for i, s in enumerate(seqs) if not s.greedy]:
        xs = _scratch("sample", (len(rows), V))
        np.take(x, rows, axis=0, out=xs)
        u = np.array([seqs[i].rng.random() for i in rows])
        tokens[rows] = _sample(xs, [seqs[i].params for i in rows], u)
    # The log-softmax costs a pass over B x V: only for the rows that report logprobs (NaN elsewhere).
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    k = min(max((seqs[i].params.logprobs or 0 for i in want), default=0), V)
    logprobs = np.full(B, np.nan, np.float32)
    top_ids, top_logprobs = np.zeros((B, k), np.int64), np.full((B, k), np.nan, np.float32)
    if want:
        r = raw if len(want) == B else raw[want]
        mx = r.max(axis=1, keepdims=True)
        t = _scratch("lse", r.shape)
        np.subtract(r, mx, out=t)
        np.exp(t, out=t)
        lse = mx + np.log(t.sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
        logprobs[want] = r[np.arange(len(want)), tokens[want]] - lse[:, 0]
        if k:
            ids = ranked(r, k)
            top_ids[want], top_logprobs[want] = ids, np.take_along_axis(r, ids, axis=1) - lse
    return SampleOutput(token_ids=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)
