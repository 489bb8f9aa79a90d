"""bench.bandwidth's byte accounting (what the batch-1 limit divides by): a GGUF's tensor bytes from its header, and
an OpenVINO export's weights read per decode step from its IR, and the probe's arithmetic on timed passes. Not timed:
the probe itself is a benchmark."""

from __future__ import annotations

import pytest

from bench.bandwidth import concurrent_rate, export_weight_bytes, gguf_bytes_per_token, gguf_tensor_bytes, limit_row


def test_gguf_tensor_bytes_add_up_to_the_file() -> None:
    from export.default_model import gguf_path

    path = gguf_path()
    t = gguf_tensor_bytes(path)
    size = path.stat().st_size
    # SmolLM2-135M Q4_1: 272 tensors; the header and metadata are a few MB at most, the rest is tensor data
    assert t["n_tensors"] == 272
    assert size - 4 * 2**20 < t["total"] < size
    # tied embeddings: no output.weight, the token table is read whole as the output matrix and is counted
    assert t["output"] == 0 and t["token_embd"] > 0
    assert gguf_bytes_per_token(path) == t["total"]


@pytest.mark.default_model
def test_export_weights_read_per_step_are_the_matmul_constants(model_dir) -> None:
    w = export_weight_bytes(model_dir)
    size = (model_dir / "openvino_model.bin").stat().st_size
    # fp16 export, tied embeddings: every weight feeds a MatMul (the LM head reads the shared table), nothing is
    # gather-only; the counted constants are (almost) the whole weights file
    assert w["gather_only_bytes"] == 0
    assert 0.95 * size < w["matmul_bytes"] <= size


def test_limit_row() -> None:
    row = limit_row(1e9, 20.0, 100.0)  # 1 GB per token at 20 GB/s: 50 ms, 20 tok/s; 100 ms measured: half of it
    assert row["limit_ms"] == 50.0 and row["limit_tok_s"] == 20.0 and row["share_of_limit"] == 0.5


def test_the_probe_rates_the_window_where_every_thread_read():
    """A thread that starts late is not counted idle (its pair read at 2 chunks a second once both ran, where the
    wall rate says 1.33); threads that took turns read at what they got; too short a window says nothing."""
    early = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0)]
    late = [(2.5, 3.5), (3.5, 4.5), (4.5, 5.5)]
    assert concurrent_rate([early, late], [1, 1]) == pytest.approx(2.0)
    turns = [[(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)], [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]]
    assert concurrent_rate(turns, [1, 1]) == pytest.approx(2 * 2 / 3)
    assert concurrent_rate([early, [(3.8, 5.2)]], [1, 1]) == 0.0
