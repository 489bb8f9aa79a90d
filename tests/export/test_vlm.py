"""The VLM export on tiny random Qwen2-VL and Idefics3 models: the manifest's vision record, and in f32 the exported
parts against transformers: the image features for one random image, and the language model's logits on a chat
prompt whose embeddings carry those features (built from the manifest's image-token scheme, as the engine will);
and openvino_genai's VLMPipeline on the same export against transformers' greedy answer.

Each family is built and exported once per session (about 40 s on 2 cores for both).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.manifest import MANIFEST_NAME, Manifest, Vision
from export.vlm import LANGUAGE_MODEL, export_vlm
from tests import tiny_vlms

F32 = {"INFERENCE_PRECISION_HINT": "f32"}
FEATURE_ATOL = 1e-4  # max |exported - transformers| on image features of magnitude ~1
LOGIT_ATOL = 1e-4
QUESTION = "What does the gauge read?"

Exported = Callable[[str], tuple[Path, Path, Manifest]]


@pytest.fixture(scope="module")
def exported(vlm_export) -> Exported:
    """Each family built and exported once a session (tests/conftest.py), shared with tests/runtime/test_vision*."""
    return vlm_export


def _infer(out: Path, file: str, feed: dict[str, Any]) -> np.ndarray:
    import openvino as ov

    compiled = ov.Core().compile_model(out / file, "CPU", F32)
    return np.array(compiled.create_infer_request().infer(feed)[compiled.outputs[0]])


def _prompt(src: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _language_model(out: Path, manifest: Manifest, ids: np.ndarray, features: np.ndarray, positions: np.ndarray):
    """Logits of one prefill: the text embeddings with the image token rows replaced, in order, by `features`."""
    assert manifest.vision is not None
    embeds = _infer(out, manifest.vision.parts["text_embeddings"], {"input": ids})
    mask = ids[0] == manifest.vision.image_token_id
    assert mask.sum() == len(features)
    embeds[0, mask] = features
    feed = {
        "inputs_embeds": embeds,
        "attention_mask": np.ones_like(ids),
        "position_ids": positions,
        "beam_idx": np.zeros(1, np.int32),
    }
    return _infer(out, LANGUAGE_MODEL, feed)


def _compare_logits(logits: np.ndarray, expected: np.ndarray) -> None:
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, atol=LOGIT_ATOL, rtol=0)
    assert logits[0, -1].argmax() == expected[0, -1].argmax()  # greedy next token


def test_qwen2_vl_parity(exported: Exported) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessor

    src, out, manifest = exported("qwen2_vl")
    vision = manifest.vision
    assert vision is not None and vision.scheme == "qwen2_vl"
    images = Qwen2VLImageProcessor.from_pretrained(src)(images=[tiny_vlms.image()], return_tensors="pt")
    pixels, grid = images["pixel_values"], images["image_grid_thw"]
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.cat(model.model.get_image_features(pixels, grid)).numpy()
        rotary = model.model.visual.rot_pos_emb(grid).numpy()
    # The two vision parts: patch embeddings, then the transformer + 2x2 merger (one image: no cross-image mask).
    assert rotary.shape[1] == vision.rotary_dim
    patches = _infer(out, vision.parts["vision_embeddings"], {"hidden_states": pixels.numpy()})
    n = len(patches)
    merger_feed = {
        "hidden_states": patches,
        "attention_mask": np.zeros((1, n, n), np.float32),
        "rotary_pos_emb": rotary,
    }
    features = _infer(out, vision.parts["vision_merger"], merger_feed)
    assert features.shape == expected.shape == (n // vision.merge_size**2, manifest.hidden_size)
    assert np.abs(features - expected).max() < FEATURE_ATOL

    # The grid follows from the manifest's resize rule alone (transformers' smart_resize), and the prompt gets one
    # <|image_pad|> per merged patch (grid t * h * w / merge**2).
    assert [int(x) for x in grid[0, 1:]] == _qwen2_vl_grid(vision, *tiny_vlms.IMAGE_SIZE)
    tokens = int(grid.prod()) // vision.merge_size**2
    image = f"<|vision_start|>{'<|image_pad|>' * tokens}<|vision_end|>"
    text = _prompt(src).replace("<|vision_start|><|image_pad|><|vision_end|>", image)
    ids = np.array([AutoTokenizer.from_pretrained(src)(text)["input_ids"]], np.int64)
    assert (ids[0] == vision.image_start_token_id).sum() == (ids[0] == vision.image_end_token_id).sum() == 1
    input_ids = torch.from_numpy(ids)
    with torch.no_grad():
        reference = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid).logits.numpy()
        positions = model.model.get_rope_index(input_ids, grid, None, torch.ones_like(input_ids))[0].numpy()
    assert positions.shape == (3, 1, ids.shape[1])  # M-RoPE: temporal, height, width
    _compare_logits(_language_model(out, manifest, ids, features, positions), reference)


def _qwen2_vl_grid(vision: Vision, height: int, width: int) -> list[int]:
    """Patch rows and columns of an image: each side rounded to a multiple of patch * merge pixels, scaled down or up
    (aspect kept) into [min_pixels, max_pixels]."""
    assert vision.min_pixels is not None and vision.max_pixels is not None
    factor = vision.patch_size * vision.merge_size
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > vision.max_pixels:
        beta = math.sqrt(height * width / vision.max_pixels)
        h, w = (max(factor, math.floor(side / beta / factor) * factor) for side in (height, width))
    elif h * w < vision.min_pixels:
        beta = math.sqrt(vision.min_pixels / (height * width))
        h, w = (math.ceil(side * beta / factor) * factor for side in (height, width))
    return [h // vision.patch_size, w // vision.patch_size]


def _idefics3_image_text(vision: Vision, rows: int, cols: int) -> str:
    """The prompt text one image becomes, from the manifest (its `Vision` docstring's rule)."""
    wrap, tokens = vision.image_wrap_token, "<image>" * (vision.tokens_per_tile or 0)
    grid = "".join(
        "".join(f"{wrap}<row_{r}_col_{c}>{tokens}" for c in range(1, cols + 1)) + "\n" for r in range(1, rows + 1)
    )
    return f"{grid}\n{wrap}{vision.global_image_token}{tokens}{wrap}"


def _idefics3_position_ids(mask: Any, patch_size: int, side: int) -> Any:
    """Idefics3VisionEmbeddings' patch positions for the tiles' valid patches (transformers computes them inside
    the vision model; optimum's IR takes them as an input). The fractions are i / n * (1 - 1e-6), as transformers
    has them since 4.55 (before: arange(0, 1 - 1e-6, 1 / n), which buckets differently)."""
    import torch

    patches = mask.unfold(1, patch_size, patch_size).unfold(2, patch_size, patch_size).sum((-1, -2)) > 0
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    positions = torch.zeros(len(mask), side * side, dtype=torch.long)
    for i, valid in enumerate(patches):
        rows, cols = int(valid[:, 0].sum()), int(valid[0].sum())
        h = torch.bucketize(torch.arange(rows) / rows * (1 - 1e-6), boundaries, right=True)
        w = torch.bucketize(torch.arange(cols) / cols * (1 - 1e-6), boundaries, right=True)
        positions[i][valid.view(-1)] = (h[:, None] * side + w).flatten()
    return patches, positions


def test_idefics3_parity(exported: Exported) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    src, out, manifest = exported("idefics3")
    vision = manifest.vision
    assert vision is not None and vision.scheme == "idefics3" and vision.tile_size is not None
    processor = AutoProcessor.from_pretrained(src)
    inputs = processor(text=_prompt(src), images=[[tiny_vlms.image()]], return_tensors="pt")
    pixels, pixel_mask = inputs["pixel_values"][0], inputs["pixel_attention_mask"][0]
    tiles = (vision.resize_longest_edge // vision.tile_size) ** 2 + 1  # a square test image's grid, plus the global
    assert len(pixels) <= tiles and pixels.shape[-1] == vision.tile_size
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.model.get_image_features(pixels[None], pixel_mask[None]).numpy()
    patch_mask, positions = _idefics3_position_ids(pixel_mask, vision.patch_size, vision.tile_size // vision.patch_size)
    feed = {
        "pixel_values": pixels.numpy(),
        "patch_attention_mask": patch_mask.numpy(),
        "patch_position_ids": positions.numpy(),
    }
    features = _infer(out, vision.parts["vision_embeddings"], feed)
    assert features.shape == expected.shape == (len(pixels), vision.tokens_per_tile, manifest.hidden_size)
    assert np.abs(features - expected).max() < FEATURE_ATOL

    ids = inputs["input_ids"].numpy()
    assert (ids == vision.image_token_id).sum() == len(pixels) * vision.tokens_per_tile
    layout = processor.image_processor([[tiny_vlms.image()]], return_row_col_info=True)
    rows, cols = layout["rows"][0][0], layout["cols"][0][0]
    assert rows * cols + 1 == len(pixels) and vision.image_splitting
    expanded = _prompt(src).replace("<image>", _idefics3_image_text(vision, rows, cols))
    assert processor.tokenizer(expanded, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        reference = model(**inputs).logits.numpy()
    positions_1d = np.arange(ids.shape[1], dtype=np.int64)[None]
    _compare_logits(
        _language_model(out, manifest, ids, features.reshape(-1, manifest.hidden_size), positions_1d), reference
    )


def test_int4_and_cli(exported: Exported, tmp_path: Path) -> None:
    """int4 compresses the language model as a text export does and says so; the CLI sends a VLM folder here and
    refuses a backend optimum-intel's split does not exist for."""
    import openvino as ov

    src = exported("idefics3")[0]
    manifest = export_vlm(src, tmp_path / "int4", "openvino", "int4")
    info = manifest.weight_compression
    assert (info["mode"], info["vision and text embeddings"]) == ("int4_asym", "fp16 weights")
    graph = ov.Core().read_model(tmp_path / "int4" / LANGUAGE_MODEL)
    assert any(op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.u4 for op in graph.get_ops())
    ids = np.array([[1, 5, 9]], np.int64)
    embeds = _infer(tmp_path / "int4", manifest.vision.parts["text_embeddings"], {"input": ids})  # type: ignore[union-attr]
    feed = {"inputs_embeds": embeds, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None]}
    assert np.isfinite(_infer(tmp_path / "int4", LANGUAGE_MODEL, {**feed, "beam_idx": np.zeros(1, np.int32)})).all()
    from export.__main__ import main

    assert main([str(src), str(tmp_path / "onnx"), "--backend", "onnx"]) == 2 and not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("family", tiny_vlms.FAMILIES)
def test_vlm_manifest(family: str, exported: Exported) -> None:
    src, out, manifest = exported(family)
    assert Manifest.load(out) == manifest and manifest.is_vlm and not manifest.is_encoder
    config = json.loads((src / "config.json").read_text())
    vision = manifest.vision
    assert vision is not None
    assert vision.image_token_id == config["image_token_id"]
    for role, file in vision.parts.items():
        assert (out / file).is_file() and (out / file.replace(".xml", ".bin")).is_file(), role
    assert (out / LANGUAGE_MODEL).is_file() and manifest.model_file == LANGUAGE_MODEL
    assert manifest.inputs == ["attention_mask", "position_ids", "inputs_embeds", "beam_idx"] and manifest.stateful
    preprocessor = json.loads((src / "preprocessor_config.json").read_text())
    assert (vision.image_mean, vision.image_std) == (preprocessor["image_mean"], preprocessor["image_std"])
    assert (out / vision.image_processor_file).read_text() == (src / "preprocessor_config.json").read_text()
    assert (out / manifest.tokenizer_file).is_file() and manifest.chat_template_file is not None
    if family == "qwen2_vl":
        assert set(vision.parts) == {"text_embeddings", "vision_embeddings", "vision_merger"}
        assert vision.mrope_section == [2, 3, 3] and vision.max_pixels == preprocessor["max_pixels"]
        import openvino as ov

        merger = ov.Core().read_model(out / vision.parts["vision_merger"])
        assert merger.input("rotary_pos_emb").get_partial_shape()[1].get_length() == vision.rotary_dim
    else:
        assert set(vision.parts) == {"text_embeddings", "vision_embeddings"} and vision.mrope_section is None
        assert vision.tokens_per_tile == json.loads((src / "processor_config.json").read_text())["image_seq_len"]


def test_manifest_vision_round_trip(tmp_path: Path) -> None:
    """A text-only manifest has no `vision` key (its file is as before); a VLM's loads back equal; a manifest written
    before the field, or one with fields a newer exporter added to `vision`, still loads."""
    base = dict(
        name="m", backend="openvino", weight_format="fp16", model_file="openvino_model.xml", architecture="A",
        model_type="llama", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=8, hidden_size=8,
        vocab_size=10, max_context=16, kv_dtype="f32", stateful=True,
    )  # fmt: skip
    text = Manifest(**base)
    text.save(tmp_path)
    assert "vision" not in json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert Manifest.load(tmp_path) == text and not text.is_vlm
    vision = Vision(
        scheme="qwen2_vl", parts={"text_embeddings": "t.xml"}, part_inputs={"text_embeddings": ["input"]},
        image_token_id=5, patch_size=14, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        mrope_section=[2, 3, 3],
    )  # fmt: skip
    vlm = Manifest(**base, vision=vision)
    vlm.save(tmp_path)
    assert Manifest.load(tmp_path) == vlm
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    data["vision"]["future_field"] = 1
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    assert Manifest.load(tmp_path).vision == vision
    assert asdict(vlm)["vision"]["mrope_section"] == [2, 3, 3]


def test_static_shapes_refuse_a_vlm_export(exported: Exported, capsys: pytest.CaptureFixture[str]) -> None:
    """A VLM is served by the paged backend only (tests/runtime/test_vlm_engine.py): static shapes (NPU, --static)
    refuse it by name at start-up and in the engine itself, rather than failing on a missing input."""
    from appliance.cli import main
    from appliance.config import EngineConfig
    from appliance.runtime.engine.core import Engine

    _, out, _ = exported("idefics3")
    with pytest.raises(ValueError, match="paged OpenVINO backend only"):
        Engine(out, EngineConfig(static=True))
    assert main(["config", "--model", str(out), "--static"]) == 78  # EX_CONFIG: `serve` checks the same settings
    assert "paged OpenVINO backend only" in capsys.readouterr().err
    assert main(["config", "--model", str(out)]) == 0


class _Tokens:
    """A genai streamer that keeps the generated token ids (genai hands them over one or a few at a time)."""

    def __new__(cls) -> Any:
        import openvino_genai as genai

        class Tokens(genai.StreamerBase):
            def __init__(self) -> None:
                super().__init__()
                self.ids: list[int] = []

            def write(self, token: int | list[int]) -> Any:
                self.ids += [token] if isinstance(token, int) else list(token)
                return genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        return Tokens()


def _transformers_greedy(src: Path, new_tokens: int) -> list[int]:
    """transformers' greedy tokens for the Qwen2-VL chat (one image, then QUESTION), exactly `new_tokens` of them."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessor

    images = Qwen2VLImageProcessor.from_pretrained(src)(images=[tiny_vlms.image()], return_tensors="pt")
    tokens = int(images["image_grid_thw"].prod()) // 4  # 2x2 merge
    text = _prompt(src).replace("<|image_pad|>", "<|image_pad|>" * tokens)
    input_ids = AutoTokenizer.from_pretrained(src)(text, return_tensors="pt")["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=images["pixel_values"],
            image_grid_thw=images["image_grid_thw"],
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :]]


@pytest.mark.parametrize("family", tiny_vlms.FAMILIES)
def test_genai_vlm_pipeline(family: str, exported: Exported) -> None:
    """openvino_genai's VLMPipeline (what OVMS serves VLMs with, and what bench/vlm.py compares us with) loads the
    export, tokenizer files included, and its greedy answer to an image and a question is transformers' token for
    token in f32. genai 2026.4 has no Idefics3 pipeline: it refuses the model type by name (when it stops refusing,
    extend the parity to it)."""
    import openvino as ov
    import openvino_genai as genai

    from export.vlm import GENAI_DETOKENIZER, GENAI_TOKENIZER

    src, out, _ = exported(family)
    assert (out / GENAI_TOKENIZER).is_file() and (out / GENAI_DETOKENIZER).is_file()
    if family == "idefics3":  # in a child process: what genai's refusing constructor leaves behind once crashed
        # (a segfault) the next test's torch call in this one
        code = "import json, sys, openvino_genai as g; g.VLMPipeline(sys.argv[1], 'CPU', **json.loads(sys.argv[2]))"
        child = subprocess.run(
            [sys.executable, "-c", code, str(out), json.dumps(F32)], capture_output=True, text=True, timeout=300
        )
        assert child.returncode != 0 and "Unsupported 'idefics3' VLM model type" in child.stderr, child.stderr[-2000:]
        return
    new_tokens = 12
    pipe = genai.VLMPipeline(str(out), "CPU", **F32)
    config = genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    streamer = _Tokens()
    image = ov.Tensor(np.array(tiny_vlms.image())[None])
    pipe.generate(QUESTION, images=[image], generation_config=config, streamer=streamer)
    assert streamer.ids == _transformers_greedy(src, new_tokens)


def test_bench_vlm_genai_side(exported: Exported, tmp_path: Path) -> None:
    """bench/vlm.py's genai side runs on a VLM export (batch 1, 4 concurrent, the repeated picture) and writes its
    table's rows; its other side, our server, is the same command without `--sides genai`."""
    from bench import vlm

    out = exported("qwen2_vl")[1]
    result = tmp_path / "vlm.json"
    assert vlm.main(["--model", str(out), "--sides", "genai", "--quick", "--out", str(result)]) == 0
    data = json.loads(result.read_text())
    assert [row["cell"] for row in data["summary"]] == ["c=1", "c=4", "repeat"]
    assert all(row["genai_ttft_ms"] > 0 and row["genai_decode_tok_s"] > 0 for row in data["summary"])
    assert data["summary"][-1]["genai_repeat_ratio"] > 0
    assert {(r["side"], r["cell"]) for r in data["runs"]} == {("genai", 1), ("genai", 4), ("genai", "repeat")}
