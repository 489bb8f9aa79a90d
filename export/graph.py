"""What both backends report about an exported graph, the one-step probe both run to verify it, and the interface
exporter.py drives them through."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from export.source import Dims, ExportError

TASK = "text-generation-with-past"


@dataclass(frozen=True)
class GraphInfo:
    inputs: list[str]
    outputs: list[str]
    stateful: bool
    kv_dtype: str  # f32 | f16: what the KV state / present.* tensors hold
    kv_heads: int | None  # as the graph declares them (None: dynamic), checked against config.json
    head_dim: int | None

    def check_geometry(self, dims: Dims) -> None:
        """The graph's KV state must be what config.json says, or the runtime would mis-size its cache."""
        if (self.kv_heads, self.head_dim) not in ((dims.num_kv_heads, dims.head_dim), (None, None)):
            raise ExportError(
                f"the graph's KV cache has {self.kv_heads} heads x {self.head_dim} dims but the "
                f"config says {dims.num_kv_heads} x {dims.head_dim}; the runtime would mis-size it"
            )


@dataclass(frozen=True)
class WeightOptions:
    """How int8/int4 weights are made (`python -m export --group-size/--sym/--ratio/--lm-head/--requantize`).
    The defaults are the measured choice (docs/performance-log.md, "per ISA"); the others are NNCF's knobs, for models
    whose accuracy needs them."""

    group_size: int | None = None  # OpenVINO int4 group (default 128; -1: per output channel) / ONNX block size
    sym: bool = False  # symmetric int4/int8 (no zero point); ONNX is always symmetric
    ratio: float = 1.0  # OpenVINO int4: the share of layers in int4, the rest int8
    lm_head: str = "int8"  # OpenVINO int4: the embeddings and LM head in int8 (NNCF's backup) or "int4" as well
    requantize: bool = False  # OpenVINO int4/int8: NNCF even when the source is on a 4-bit grid (export/grid.py)

    def nncf(self) -> bool:
        """Whether an NNCF knob was asked for: then int4 and int8 always go through NNCF."""
        return self != WeightOptions()


def first_step_feed(inputs: list[str], input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """input_ids / attention_mask / position_ids for a first step with no past, restricted to what the graph takes."""
    batch, length = input_ids.shape
    feed = {
        "input_ids": input_ids,
        "attention_mask": np.ones((batch, length), np.int64),
        "position_ids": np.tile(np.arange(length, dtype=np.int64), (batch, 1)),
    }
    return {k: v for k, v in feed.items() if k in inputs}


class ExportBackend(Protocol):
    """A backend module (export/openvino_backend.py, export/onnx_backend.py), as exporter.py calls it, stage by
    stage. Modules satisfy this structurally; exporter.py has mypy check both."""

    MODEL_FILE: str  # the graph file the runtime loads, recorded in the manifest

    def convert(self, model: Any, scratch: Path, weight_format: str) -> None:
        """The transformers model to a graph in `scratch` (fp16 may be written directly, else fp32)."""

    def compress(self, scratch: Path, dest: Path, weight_format: str, options: WeightOptions) -> dict[str, Any]:
        """The graph in `scratch` compressed to `weight_format` into `dest`; what was done, for the manifest."""

    def describe(self, dest: Path) -> GraphInfo:
        """Inputs, outputs and KV layout of the graph written to `dest`."""

    def check(self, dest: Path) -> None:
        """Raise ExportError if the runtime could not serve the graph in `dest`."""

    def first_step(self, dest: Path, input_ids: np.ndarray) -> np.ndarray:
        """Logits of a first step with no past on `input_ids` [batch, length], in f32 compute."""
