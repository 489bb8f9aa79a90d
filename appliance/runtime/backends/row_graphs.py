"""Graphs of static shapes for steps of a few tokens, each token a row of its own.

A step of one token runs a graph with every shape static but the KV pool's (`graph`): the CPU plugin then infers no
shapes per call, and our ops, which it runs as reference nodes, skip the ~7 us clone each such inference costs them
(~113 calls a step at Qwen2.5-1.5B). Compiled beside the graph of dynamic shapes it shares its constants; it took
Qwen2.5-1.5B's decode step to 0.923-0.952 of the time on the dynamic graph (Zen 4 EPYC, engines side by side,
interleaved, medians of 6-12 pairs).

Where our attention runs in it (kernels/attention.py), a graph of T rows takes any step of up to T tokens: each token
is a row with its own past length and its sequence's block table, and the op writes every row's key and value before
any row attends, so the tokens of one sequence attend causally as in the plugin's paged attention, and every other
node works row by row. So the default 135M model, whose layers are all under the kernels' floor and whose graph of
dynamic shapes is OpenVINO's alone (kernels.ONE_TOKEN), verifies speculative drafts and decodes small batches on
ours too. Its steps at batch 1 over a 480-token context, one sequence feeding n tokens (2-vCPU Xeon with AMX,
interleaved, medians of 12): n = 2 / 3 / 4 / 6 / 8 took 8.8 / 10.1 / 10.7 / 13.8 / 17.4 ms as rows against 16.4 /
17.2 / 18.2 / 25.5 / 26.7 on the dynamic graph (one token: 7.5); Qwen2.5-1.5B's n = 2 / 3 / 4 / 6 42.6 / 44.6 / 49.2 /
55.6 ms against 52.9 / 53.9 / 56.9 / 62.9 on its dynamic graph of ours (`bench.speculative --only shapes`), which
also paid 6 ms each time the fed shape changed. Two engines in one process, one with the graph of one row alone,
alternated, C concurrent requests of 128 prompt and 64 new tokens, medians of 6-8 rounds: the default model's
aggregate tok/s 1.79x at C = 2 and 4, 1.56x at 8; Qwen2.5-1.5B's 1.11x, 1.10x, 1.11x; batch-1 decode unchanged
(step 1.020 / 1.004 in either order of making the engines).

ROWS holds what prompt lookup's verification feeds at batch 1 (1 + k for k = 1, 2, 3, 5: the policy's table) and the
batches up to 8; a step of fewer tokens than a graph's rows repeats its last row (the same key and value written
twice to one slot, the same logits): 5 tokens in the graph of 6 took 13.6-14.2 ms, in that of 8 15.7. Each graph
holds its own activations (~20 MB at the default model: its engine's RSS 454 MB with the graph of one row, 567
with these six, where its LM head is ours: kernels/rewrite.py SYMMETRIC_I8; each graph holding a copy of OpenVINO's
head made it 606) and takes ~0.8 s to compile there; compiled side by side (the backend's _row_graphs) the six
took the default model's load from 8.0-9.7 s to 5.9-6.5 (3.7-4.4 with the graph of one row alone; a slow hour of
the 2-vCPU Xeon with AMX). Where the plugin's attention stays in the graph (a cache ours do not
read), only the graph of one token is built: its paged attention makes no promise about the order of the rows'
writes and reads.
"""

from __future__ import annotations

import os

import numpy as np
import openvino as ov

ROWS = (1, 2, 3, 4, 6, 8)  # the graphs' rows: a step takes the smallest that holds its tokens
# Other rows, e.g. "1" (the graph of one token alone), for side-by-side measurements.
ROWS_ENV = "APPLIANCE_ROW_GRAPHS"


def rows_wanted() -> tuple[int, ...]:
    """ROWS, or ROWS_ENV's (ascending, 1 first: the graph of one row decides whether more are built)."""
    given = os.environ.get(ROWS_ENV, "").replace(",", " ").split()
    return tuple(sorted({1, *(int(r) for r in given if int(r) > 0)})) if given else ROWS


def graph(model: ov.Model, rows: int, table: int) -> ov.Model:
    """`model` (constants shared, not copied) with `rows` single-token rows, each with a block table of `table`
    entries (row_inputs pads them). The KV pool's dimension stays as it is (our attention reads the pool by address;
    a static one made the plugin hold a copy of the pool: attention.py); so does logits_indices past one row, since
    a step needs the logits of its sequences' last tokens, not of every row."""
    out = model.clone()
    shapes = {"input_ids": [rows], "position_ids": [rows], "past_lens": [rows], "block_indices": [rows * table]}
    shapes |= {"subsequence_begins": [rows + 1], "block_indices_begins": [rows + 1]}
    if rows == 1:
        shapes["logits_indices"] = [1]
    out.reshape(shapes)
    return out


def ranges(counts: np.ndarray) -> np.ndarray:
    """concatenate(arange(c) for c in counts), vectorised."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)


def row_inputs(
    rows: int,
    table: int,
    ids: np.ndarray,
    positions: np.ndarray,
    lens: np.ndarray,
    used: np.ndarray,
    blocks: np.ndarray,
    block_begins: np.ndarray,
) -> dict[str, np.ndarray]:
    """The inputs of a step of len(ids) <= rows tokens (ids and positions flat over its sequences, `lens` tokens
    each, `used` blocks each of `blocks` from `block_begins`) as a graph of `rows` rows takes them: one row a token
    at its own position, with its sequence's blocks; the last row repeated up to `rows`."""
    seq = np.repeat(np.arange(len(lens)), lens)
    pad = rows - len(ids)
    if pad:
        seq = np.concatenate([seq, np.full(pad, seq[-1])])
        ids = np.concatenate([ids, np.full(pad, ids[-1])])
        positions = np.concatenate([positions, np.full(pad, positions[-1])])
    counts = used[seq]
    picked = blocks[np.repeat(block_begins[:-1][seq], counts) + ranges(counts)]
    table_of_rows = np.zeros(rows * table, np.int32)
    table_of_rows[: len(picked)] = picked
    begins = np.zeros(rows + 1, np.int32)
    np.cumsum(counts, out=begins[1:])
    return {
        "input_ids": ids,
        "position_ids": positions,
        "past_lens": positions.astype(np.int32),
        "subsequence_begins": np.arange(rows + 1, dtype=np.int32),
        "block_indices": table_of_rows,
        "block_indices_begins": begins,
    }
