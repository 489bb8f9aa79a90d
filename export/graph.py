"""What both backends report about an exported graph, and the one-step probe both run to verify it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TASK = "text-generation-with-past"


@dataclass(frozen=True)
class GraphInfo:
    inputs: list[str]
    outputs: list[str]
    stateful: bool
    kv_dtype: str                       # f32 | f16: what the KV state / present.* tensors hold
    kv_heads: int | None                # as the graph declares them (None: dynamic), checked against config.json
    head_dim: int | None


def first_step_feed(inputs: list[str], input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """input_ids / attention_mask / position_ids for a first step with no past, restricted to what the graph takes."""
    batch, length = input_ids.shape
    feed = {"input_ids": input_ids,
            "attention_mask": np.ones((batch, length), np.int64),
            "position_ids": np.tile(np.arange(length, dtype=np.int64), (batch, 1))}
    return {k: v for k, v in feed.items() if k in inputs}
