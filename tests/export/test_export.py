"""The export tool on tiny random models of every supported family: manifest, files, and logits that match
transformers over a prefill and one decode step, so the KV-cache plumbing is checked and not just the first step.

Each tiny model, its transformers reference and each export are built once per session (about 3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from appliance.manifest import Manifest
from export.exporter import ExportError, export_model
from export.graph import WeightOptions
from export.metadata import write_metadata
from export.openvino_backend import first_step
from tests import tiny_models

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello world! The appliance serves tiny models."
LAYOUTS = {name: spec[2] for name, spec in {**tiny_models.FAMILIES, **tiny_models.EXTRA_FAMILIES}.items()}
# Max |exported - transformers| on logits of magnitude ~1 (the random models' scale).
ATOL = {
    ("openvino", "fp32"): 1e-4,
    ("onnx", "fp32"): 1e-4,
    ("openvino", "fp16"): 2e-3,
    ("onnx", "fp16"): 2e-2,  # ONNX fp16 also computes in f16, OpenVINO in f32
    ("openvino", "int8"): 5e-2,
    ("onnx", "int8"): 5e-2,
    ("openvino", "int4"): 0.3,
    ("onnx", "int4"): 0.3,
}
CASES = (
    [(f, "openvino", "fp16") for f in LAYOUTS]
    + [(f, "onnx", "fp32") for f in LAYOUTS]
    + [("llama", "openvino", w) for w in ("fp32", "int8", "int4")]
    + [("llama", "onnx", w) for w in ("fp16", "int8", "int4")]
    + [("gpt2", "onnx", "int4")]
)  # GPT-2's Gemm layers must be quantized too

Exported = Callable[[str, str, str], tuple[Path, Manifest]]
Reference = Callable[[str], tuple[np.ndarray, np.ndarray]]


@pytest.fixture(scope="session")
def reference(tiny: Callable[[str], Path]) -> Reference:
    """(token ids of PROMPT from the model's own tokenizer.json, transformers fp32 logits at every position)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def get(family: str) -> tuple[np.ndarray, np.ndarray]:
        if family not in cache:
            folder = tiny(family)
            ids = np.array([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids], np.int64)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            with torch.no_grad():
                cache[family] = ids, model(torch.from_numpy(ids)).logits.numpy()
        return cache[family]

    return get


def _step_feed(manifest: Manifest, tokens: np.ndarray, start: int) -> dict[str, np.ndarray]:
    length = tokens.shape[1]
    feed = {
        "input_ids": tokens,
        "attention_mask": np.ones((1, start + length), np.int64),
        "position_ids": np.arange(start, start + length, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, np.int32),
    }
    return {k: v for k, v in feed.items() if k in manifest.inputs}


def _openvino_two_steps(out: Path, manifest: Manifest, ids: np.ndarray) -> list[np.ndarray]:
    """Prefill all but the last token, then decode the last one from the graph's own state."""
    import openvino as ov

    compiled = ov.Core().compile_model(out / manifest.model_file, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    split = ids.shape[1] - 1
    return [
        request.infer(_step_feed(manifest, ids[:, :split], 0))["logits"].copy(),
        request.infer(_step_feed(manifest, ids[:, split:], split))["logits"].copy(),
    ]


def _onnx_two_steps(out: Path, manifest: Manifest, ids: np.ndarray) -> list[np.ndarray]:
    """Same, feeding present.* of the first step back as past_key_values.*."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / manifest.model_file), providers=["CPUExecutionProvider"])
    past = {
        f"past_key_values.{layer}.{kind}": np.zeros((1, manifest.num_kv_heads, 0, manifest.head_dim), np.float32)
        for layer in range(manifest.num_layers)
        for kind in ("key", "value")
    }
    split = ids.shape[1] - 1
    logits = []
    for tokens, start in ((ids[:, :split], 0), (ids[:, split:], split)):
        feed = {**_step_feed(manifest, tokens, start), **past}
        results = dict(zip(manifest.outputs, session.run(manifest.outputs, feed), strict=True))
        logits.append(results.pop("logits"))
        past = {name.replace("present.", "past_key_values."): value for name, value in results.items()}
    return logits


def _check_manifest(manifest: Manifest, folder: Path, family: str, backend: str, weight_format: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    heads = config.num_attention_heads
    assert (manifest.name, manifest.backend, manifest.weight_format, manifest.source) == (
        family,
        backend,
        weight_format,
        str(folder),
    )
    assert (manifest.model_type, manifest.architecture) == (config.model_type, config.architectures[0])
    assert (
        manifest.num_layers,
        manifest.num_attention_heads,
        manifest.hidden_size,
        manifest.vocab_size,
        manifest.max_context,
    ) == (config.num_hidden_layers, heads, config.hidden_size, config.vocab_size, config.max_position_embeddings)
    assert manifest.num_kv_heads == (getattr(config, "num_key_value_heads", None) or heads)
    assert manifest.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // heads)
    assert manifest.kv_dtype == "f32"  # f16 weights or not, both backends keep KV tensors f32 at the boundary
    eos = [tiny_models.EOS_ID, tiny_models.BOS_ID] if LAYOUTS[family].get("eos_list") else [config.eos_token_id]
    assert (manifest.eos_token_ids, manifest.bos_token_id) == (eos, tiny_models.BOS_ID)
    if backend == "openvino":
        assert manifest.stateful and manifest.outputs == ["logits"] and "beam_idx" in manifest.inputs
    else:
        kv_names = [f"{layer}.{kind}" for layer in range(manifest.num_layers) for kind in ("key", "value")]
        assert not manifest.stateful
        assert {f"past_key_values.{name}" for name in kv_names} <= set(manifest.inputs)
        assert manifest.outputs == ["logits", *(f"present.{name}" for name in kv_names)]


def _check_files(out: Path, manifest: Manifest, family: str) -> None:
    for name in (
        manifest.model_file,
        manifest.tokenizer_file,
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
    ):
        assert (out / name).is_file(), name
    generation = json.loads((out / manifest.generation_config_file).read_text())
    assert generation["eos_token_id"] in (manifest.eos_token_ids, manifest.eos_token_ids[0])
    if LAYOUTS[family]["template"] is None:
        assert manifest.chat_template_file is None and not (out / "chat_template.jinja").exists()
    else:
        assert (out / manifest.chat_template_file).read_text() == tiny_models.CHAT_TEMPLATE
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no staging left


@pytest.mark.parametrize("family,backend,weight_format", CASES, ids=["-".join(c) for c in CASES])
def test_export(family: str, backend: str, weight_format: str, tiny, exported: Exported, reference: Reference) -> None:
    out, manifest = exported(family, backend, weight_format)
    assert Manifest.load(out) == manifest
    _check_manifest(manifest, tiny(family), family, backend, weight_format)
    _check_files(out, manifest, family)
    ids, expected = reference(family)
    if backend == "openvino":
        import openvino as ov
        from openvino._offline_transformations import paged_attention_transformation

        paged_attention_transformation(ov.Core().read_model(out / manifest.model_file))
        prefill, decode = _openvino_two_steps(out, manifest, ids)
    else:
        prefill, decode = _onnx_two_steps(out, manifest, ids)
    atol = ATOL[backend, weight_format]
    np.testing.assert_allclose(prefill, expected[:, :-1], atol=atol, rtol=0)
    np.testing.assert_allclose(decode, expected[:, -1:], atol=atol, rtol=0)


def test_quantized_weights_are_recorded(exported: Exported) -> None:
    ov_int4 = exported("llama", "openvino", "int4")[1].weight_compression
    onnx_int4 = exported("llama", "onnx", "int4")[1].weight_compression
    gpt2_int4 = exported("gpt2", "onnx", "int4")[1].weight_compression
    assert (ov_int4["mode"], ov_int4["group_size"], ov_int4["group_size_fallback"]) == ("int4_asym", 128, "adjust")
    # The graph itself, not only the manifest: asymmetric int4 is u4 values with u4 zero points (symmetric: i4, no
    # zero point, faster on AVX2 but further from fp32; openvino_backend._quantization_config says why).
    import openvino as ov

    graph = ov.Core().read_model(exported("llama", "openvino", "int4")[0] / "openvino_model.xml")
    four_bit = [
        op
        for op in graph.get_ordered_ops()
        if op.get_type_name() == "Constant" and op.get_element_type() in (ov.Type.u4, ov.Type.i4)
    ]
    assert four_bit and {op.get_element_type() for op in four_bit} == {ov.Type.u4}
    assert any(op.get_friendly_name().endswith("/zero_point") for op in four_bit)
    assert (onnx_int4["mode"], onnx_int4["block_size"]) == ("int4_sym", 32)
    assert gpt2_int4["quantized_matmuls"] == 8  # 2 blocks x 4 Gemm; GPT-2's tied lm_head is not an initializer


def test_nncf_weight_options(tiny, tmp_path: Path, reference: Reference) -> None:
    """`--sym --group-size -1 --lm-head int4 --ratio 0.5` reach NNCF and the manifest, and the graph still works."""
    options = WeightOptions(group_size=-1, sym=True, ratio=0.5, lm_head="int4")
    manifest = export_model(tiny("llama"), tmp_path / "nncf", "openvino", "int4", weights=options)
    info = manifest.weight_compression
    assert (info["mode"], info["group_size"], info["ratio"]) == ("int4_sym", "per-channel", 0.5)
    assert info["backup_mode"] == "int4 for the embeddings and lm_head"
    ids, expected = reference("llama")
    got = first_step(tmp_path / "nncf", ids)
    assert np.isfinite(got).all() and np.abs(got - expected).max() < 1.0  # per-channel int4 of a random model


def test_onnx_external_data(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: Reference) -> None:
    """Past the threshold (2 GiB in real use) tensors go to model.onnx_data, and the graph still runs."""
    from export import onnx_backend

    monkeypatch.setattr(onnx_backend, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "gpt2-onnx-fp16"
    manifest = export_model(tiny("gpt2"), out, "onnx", "fp16")
    assert (out / onnx_backend.DATA_FILE).stat().st_size > (out / manifest.model_file).stat().st_size
    ids, expected = reference("gpt2")
    prefill, _ = _onnx_two_steps(out, manifest, ids)
    np.testing.assert_allclose(prefill, expected[:, :-1], atol=ATOL["onnx", "fp16"], rtol=0)


def test_force_replaces_and_failure_leaves_nothing(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model"
    out.mkdir()  # an empty placeholder is free (export.default_model stages this way)
    assert export_model(tiny("gpt2"), out, "onnx", "fp32", name="served").name == "served"
    (out / "stale.txt").write_text("old export")
    with pytest.raises(ExportError, match="output exists"):
        export_model(tiny("gpt2"), out, "onnx", "fp32")
    export_model(tiny("gpt2"), out, "onnx", "fp32", force=True)
    assert not (out / "stale.txt").exists() and Manifest.load(out).name == "gpt2"

    def broken(*args: object) -> None:
        raise RuntimeError("converter crashed")

    monkeypatch.setattr("export.onnx_backend.convert", broken)
    with pytest.raises(RuntimeError, match="converter crashed"):
        export_model(tiny("gpt2"), tmp_path / "never", "onnx", "fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_metadata_variants(tmp_path: Path) -> None:
    """Named chat templates (tool-use variants) and a generation config without eos, which falls back on config."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text("{}")
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 5, "temperature": 0.7}))
    metadata = write_metadata(src, dst, {"bos_token_id": 1, "eos_token_id": 7, "pad_token_id": None})
    assert (metadata.chat_template_file, metadata.eos_token_ids, metadata.bos_token_id) == (
        "chat_template.jinja",
        [7],
        5,
    )
    assert (dst / "chat_template.jinja").read_text() == "D"
    assert json.loads((dst / "generation_config.json").read_text())["temperature"] == 0.7


def _cli(*args: str, prelude: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m export ARGS`; with a prelude, the same main() after running that code (to fake a full disk)."""
    command = (
        ["-m", "export"]
        if prelude is None
        else ["-c", f"{prelude}; import sys; from export.__main__ import main; sys.exit(main(sys.argv[1:]))"]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *command, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def _config_folder(root: Path, name: str, config: dict | None) -> Path:
    folder = root / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_cli_errors(tiny, tmp_path: Path) -> None:
    llama = tiny("llama")
    existing = _config_folder(tmp_path, "existing", {})
    missing = tmp_path / "missing"
    empty = _config_folder(tmp_path, "empty", None)
    bert = _config_folder(tmp_path, "bert", {"architectures": ["BertModel"], "model_type": "bert"})
    classifier = _config_folder(
        tmp_path, "classifier", {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}
    )
    falcon = _config_folder(tmp_path, "falcon", {"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    out = tmp_path / "out"
    supported = "gemma, gpt2, gpt_neox, granite, llama, mistral, olmo2, phi, phi3, qwen2, qwen3, smollm3, stablelm"
    cases = [
        ([missing, out], f"source folder not found: {missing}"),
        ([empty, out], f"no config.json in {empty}: not a Hugging Face model folder"),
        # an encoder's model_type goes to the encoder exporter (tests/runtime/test_encoder.py), which needs weights
        ([bert, out], f"no weights in {bert} (*.safetensors, *.bin, *.pt, *.pth)"),
        (
            [classifier, out],
            f"{classifier} is not a causal language model "
            "(architectures: LlamaForSequenceClassification; model_type: llama)",
        ),
        (
            [falcon, out],
            f"unsupported architecture FalconForCausalLM (model_type falcon); supported model types: {supported}",
        ),
        ([llama, existing], f"output exists: {existing} (pass --force to replace it)"),
        ([llama, llama.parent, "--force"], f"output {llama.parent} would replace the source folder {llama}"),
        (
            [llama, out, "--group-size", "48"],
            "group size must be a power of two >= 16 (or -1: per channel, OpenVINO), got 48",
        ),
        (
            [llama, out, "--backend", "onnx", "--weight-format", "int4", "--sym"],
            "--sym, --ratio, --lm-head and --requantize apply to OpenVINO int8/int4 exports only",
        ),
        ([llama, out, "--weight-format", "int4", "--ratio", "0"], "ratio must be in (0, 1], got 0.0"),
        (
            [llama, out, "--weight-format", "int8", "--lm-head", "int4"],
            "--ratio and --lm-head apply to int4 exports only",
        ),
    ]
    for args, message in cases:
        result = _cli(*map(str, args))
        assert (result.returncode, result.stderr) == (2, f"error: {message}\n"), args
    full_disk = (
        "import shutil, collections; "
        "shutil.disk_usage = lambda p: collections.namedtuple('u', 'total used free')(1, 1, 0)"
    )
    result = _cli(str(llama), str(out), "--backend", "onnx", prelude=full_disk)
    assert (result.returncode, result.stderr) == (
        2,
        f"error: not enough free disk space in {tmp_path}: need about 0.3 GB, 0.0 GB free\n",
    )
    assert not out.exists()


@pytest.mark.slow  # a subprocess export (~15 s); the export itself is tested in-process above
def test_cli_exports(tiny, tmp_path: Path) -> None:
    """The console entry point end to end: progress on stderr, nothing from the libraries anywhere."""
    out = tmp_path / "cli-export"
    result = _cli(str(tiny("gpt2")), str(out), "--backend", "onnx", "--weight-format", "int8", "--name", "g")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "warn" not in result.stderr.lower()
    assert "verify" in result.stderr and f"exported g (GPT2LMHeadModel, onnx int8) to {out}" in result.stderr
    assert Manifest.load(out).weight_compression["mode"] == "int8_sym"


def test_every_supported_family_is_tested() -> None:
    from export.source import SUPPORTED

    assert set(LAYOUTS) == SUPPORTED
