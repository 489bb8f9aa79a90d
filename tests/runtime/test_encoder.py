"""Encoder export and runtime (appliance/runtime/encoder.py) against transformers: embeddings and rerank.

Reference: sentence-transformers' arithmetic computed by hand in torch on the transformers model
(export.encoder.torch_reference: the transformer, masked mean / CLS pooling with its 1e-9 clamp, F.normalize), so the
package itself is not needed. f32 runs force INFERENCE_PRECISION_HINT=f32 (an AVX-512-bf16 CPU computes in bf16 by
default), as the parity tests do.

Two tiers: tiny random encoders built here (tests/tiny_encoders.py; `make test-fast`), and the default embedding
model all-MiniLM-L6-v2 (the `embedding_export`/`embedding_hf` fixtures mark those tests default_model, and build
the model when the data dir has none).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.runtime.encoder import Encoder, EncoderError, fold_int8_weights, pool
from export.encoder import export_encoder, torch_reference
from export.source import ExportError
from tests import tiny_encoders

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset the device to its factory settings?",
    "Press and hold the power button for ten seconds.",
    "The warranty covers parts and labour for two years.",
    "Error E42 means the fan is blocked or disconnected.",
    "Retrieval-augmented generation combines search with a language model.",
    "Paris is the capital of France.",
    "A cat sat on the mat.",
    "Stock prices fell sharply after the announcement.",
    "She plays the violin in the city orchestra every Friday evening.",
    "Embeddings map sentences to vectors in a shared space.",
    "The meeting was moved to Thursday at 3 pm.",
    "Replace the filter every six months, or sooner in dusty rooms.",
    "Der Zug nach Berlin fährt um 8 Uhr ab.",
    "El sistema se reinicia automáticamente después de una actualización.",
    "日本語の文も埋め込みにできます。",
    "Привет, как дела?",
    "🙂 emoji and symbols: © ® ™ → ∞",
    "def add(a, b):\n    return a + b",
    "SELECT name, price FROM products WHERE price > 100 ORDER BY price;",
    "The temperature sensor reads 23.5 °C at 14:05 UTC.",
    "Why is the sky blue? Rayleigh scattering of sunlight by air molecules.",
    "Ok.",
    "x",
    "A very long sentence " + "that keeps going with more and more words about nothing in particular " * 8,
    "Install the package, then run the server on port 8000 with an API key.",
    "The firmware update failed; roll back to the previous version.",
    "Dogs are loyal companions and love to play fetch in the park.",
    "Quantum computers use qubits that can be in superposition.",
    "The recipe needs two eggs, flour, sugar and a pinch of salt.",
    "Log rotation keeps the disk from filling up with old messages.",
    "An index over the manuals answers questions in milliseconds.",
    "My order number is 12345-ABC and it has not arrived yet.",
    "Battery life drops in cold weather below freezing.",
    "The museum opens at nine and closes at five on weekdays.",
    "Use a soft cloth to clean the screen; never spray liquid directly.",
    "TLS certificates must be renewed before they expire.",
    "Mount Everest is the highest mountain above sea level.",
    "He forgot his umbrella and got soaked in the rain.",
    "A reranker orders candidate passages by relevance to the query.",
    "The cafe on the corner serves the best espresso in town.",
    "Network latency rose to 300 ms during the outage.",
    "Children learn languages faster than adults.",
    "The invoice is due within thirty days of receipt.",
    "CPU usage spiked to 100% when the backup started.",
    "Solar panels convert sunlight into electricity.",
    "Please restart the router and try again.",
    "The novel was translated into forty languages.",
    "Vaccines train the immune system to recognise pathogens.",
    "Keep the appliance away from water and heat sources.",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def reference_model(folder: Path, task: str):
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if task == "rerank" else AutoModel
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def reference(model, batch, manifest: Manifest) -> np.ndarray:
    """Each input alone (no padding in the reference), as sentence-transformers' own numbers for it."""
    import torch

    with torch.no_grad():
        return np.concatenate([torch_reference(model, [row], manifest) for row in batch])


# ================================================================ tiny random encoders (model-free)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    """kind, backend, weight_format -> (source folder, export folder); each built once a module."""
    root = tmp_path_factory.mktemp("tiny-encoders")
    sources: dict[str, Path] = {}
    exports: dict[tuple[str, str, str], Path] = {}

    def get(kind: str, backend: str = "openvino", weight_format: str = "fp32") -> tuple[Path, Path]:
        if kind not in sources:
            sources[kind] = tiny_encoders.build(kind, root / kind)
        key = (kind, backend, weight_format)
        if key not in exports:
            exports[key] = root / "-".join(key)
            export_encoder(sources[kind], exports[key], backend, weight_format)
        return sources[kind], exports[key]

    return get


@pytest.mark.parametrize(
    "kind, task, pooling, normalize, inputs",
    [
        ("embed-mean", "embed", "mean", True, ["input_ids", "attention_mask", "token_type_ids"]),
        ("embed-cls", "embed", "cls", False, ["input_ids", "attention_mask", "token_type_ids"]),
        ("embed-roberta", "embed", "mean", True, ["input_ids", "attention_mask"]),
        ("rerank", "rerank", None, False, ["input_ids", "attention_mask", "token_type_ids"]),
    ],
)
def test_manifest_declares_what_the_folder_says(tiny_encoder, kind, task, pooling, normalize, inputs):
    src, out = tiny_encoder(kind)
    manifest = Manifest.load(out)
    assert (manifest.task, manifest.pooling, manifest.normalize) == (task, pooling, normalize)
    assert manifest.inputs == inputs and manifest.is_encoder
    config = json.loads((src / "config.json").read_text())
    # sentence_bert_config's max_seq_length (48) wins over the position table; a cross-encoder has only the table
    assert manifest.max_length == (
        tiny_encoders.MAX_SEQ_LENGTH if task == "embed" else config["max_position_embeddings"]
    )
    assert manifest.dimensions == (config["hidden_size"] if task == "embed" else 1)
    assert (out / "tokenizer.json").is_file() and not (out / "chat_template.jinja").exists()


def test_old_and_llm_manifests_still_load(tmp_path):
    """A manifest written before the encoder fields existed is a causal LM's: task generate, no pooling."""
    fields = {
        "name": "m",
        "backend": "openvino",
        "weight_format": "int8",
        "model_file": "openvino_model.xml",
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "vocab_size": 1000,
        "max_context": 512,
        "kv_dtype": "f32",
        "stateful": True,
        "some_future_field": 1,
    }
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(fields))
    manifest = Manifest.load(tmp_path)
    assert (manifest.task, manifest.pooling, manifest.normalize, manifest.max_length) == ("generate", None, False, None)
    assert not manifest.is_encoder
    with pytest.raises(EncoderError, match="not an encoder"):
        Encoder(tmp_path)


@pytest.mark.parametrize("kind", ["embed-mean", "embed-cls", "embed-roberta"])
@pytest.mark.parametrize("backend", ["openvino", "onnx"])
def test_tiny_embeddings_match_transformers(tiny_encoder, kind, backend):
    src, out = tiny_encoder(kind, backend)
    encoder = Encoder(out, precision="f32")
    batch = [encoder.truncate(ids) for ids in encoder.tokenize(SENTENCES)]
    got = encoder.embed(batch)
    want = reference(reference_model(src, "embed"), batch, encoder.manifest)
    assert got.shape == (len(SENTENCES), encoder.dimensions) and got.dtype == np.float32
    assert cosines(got, want).min() >= 0.9999
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    if encoder.manifest.normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)


def test_tiny_padding_invariance(tiny_encoder):
    """A sentence alone and next to a long one (padded to its length) gives the same vector."""
    _, out = tiny_encoder("embed-mean")
    encoder = Encoder(out, precision="f32")
    short, long = encoder.tokenize(["Short one.", SENTENCES[24]])
    long = encoder.truncate(long)
    assert len(long) == encoder.max_length > 4 * len(short)
    alone = encoder.embed([short])[0]
    encoder.forward_tokens = 10**9  # one forward, the short one padded to the long ones
    batched = encoder.embed([long, short, long])[1]
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_groups_cut_batches_by_length():
    """The cheapest split into forwards: equal lengths stay together, a long one apart from short ones, every
    index once; a huge forward cost keeps the batch whole."""
    from appliance.runtime.encoder import groups

    assert groups([10] * 5) == [[0, 1, 2, 3, 4]]
    split = groups([5, 120, 6, 5, 118])
    assert sorted(map(sorted, split)) == [[0, 2, 3], [1, 4]]
    assert groups([5, 120, 6], forward=10**9) == [[0, 2, 1]]
    lengths = list(np.random.default_rng(0).integers(1, 200, 300))
    found = groups(lengths)
    assert sorted(i for g in found for i in g) == list(range(300))
    padded = sum(max(lengths[i] for i in g) * len(g) for g in found)
    assert padded < 1.2 * sum(lengths)  # nearly no padding, against 300 x 199 for one forward


def test_grouped_batches_give_one_forwards_results(tiny_encoder):
    """A batch of mixed lengths split into forwards gives each input's vector in the caller's order."""
    _, out = tiny_encoder("embed-mean")
    encoder = Encoder(out, precision="f32")
    batch = [encoder.truncate(ids) for ids in encoder.tokenize(SENTENCES[:24])]
    grouped = encoder.embed(batch)
    encoder.forward_tokens = 10**9
    np.testing.assert_allclose(grouped, encoder.embed(batch), atol=1e-5)


@pytest.mark.parametrize("backend", ["openvino", "onnx"])
def test_tiny_rerank_scores_and_order_match_the_cross_encoder(tiny_encoder, backend):
    src, out = tiny_encoder("rerank", backend)
    encoder = Encoder(out, precision="f32")
    query = "how do I reset the device"
    pairs = encoder.tokenize_pairs(query, SENTENCES[:20])
    ids, types = pairs[0]
    sep = ids.index(ids[-1])  # [CLS] q [SEP] d [SEP]: the query's segment is 0, the document's 1
    assert types[: sep + 1] == [0] * (sep + 1) and set(types[sep + 1 :]) == {1}
    got = encoder.score(pairs)
    want = reference(reference_model(src, "rerank"), pairs, encoder.manifest)
    assert got.shape == (20,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    assert np.ptp(want) > 0.5  # the scores are spread: equal order below means something
    assert list(np.argsort(-got, kind="stable")) == list(np.argsort(-want, kind="stable"))


def test_tokenize_ignores_the_files_truncation_and_truncate_keeps_specials(tiny_encoder):
    """The tiny tokenizer.json ships truncation at 16 and padding to 16, as sentence-transformers folders do."""
    from tokenizers import Tokenizer

    _, out = tiny_encoder("embed-mean")
    encoder = Encoder(out, precision="f32")
    ids = encoder.tokenize([SENTENCES[24]])[0]
    assert len(ids) > encoder.max_length and 0 not in ids  # untruncated, unpadded
    reference_tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference_tokenizer.no_padding()
    reference_tokenizer.enable_truncation(encoder.max_length)
    assert encoder.truncate(ids) == reference_tokenizer.encode(SENTENCES[24]).ids
    assert encoder.truncate(ids[:10]) == ids[:10]
    cut = encoder.tokenize_pairs("a short query", [SENTENCES[24]], truncate=True)[0][0]
    whole = encoder.tokenize_pairs("a short query", [SENTENCES[24]])[0][0]
    assert len(cut) == encoder.max_length < len(whole) and cut[:5] == whole[:5] and cut[-1] == whole[-1]


def test_pair_truncation_is_per_call_and_thread_safe(tiny_encoder):
    """Truncating and untruncating pair tokenizations at once on many threads each get their own answer (as one
    thread alone gets it), and the shared tokenizer is never reconfigured: its truncation stays off."""
    from concurrent.futures import ThreadPoolExecutor

    _, out = tiny_encoder("rerank")
    encoder = Encoder(out, precision="f32")
    long_query = SENTENCES[24]
    calls = [("a short query", True), ("a short query", False), (long_query, True), (long_query, False)] * 50
    want = {call: encoder.tokenize_pairs(call[0], SENTENCES[20:26], truncate=call[1]) for call in calls[:4]}
    assert all(len(ids) <= encoder.max_length for ids, _ in want[("a short query", True)])
    assert all(len(ids) <= encoder.max_length for ids, _ in want[(long_query, True)])
    assert any(len(ids) > encoder.max_length for ids, _ in want[("a short query", False)])
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda call: encoder.tokenize_pairs(call[0], SENTENCES[20:26], truncate=call[1]), calls))
    assert all(g == want[call] for g, call in zip(got, calls, strict=True))
    assert encoder._tokenizer.truncation is None and encoder._tokenizer.padding is None


def test_static_buckets_give_the_dynamic_results(tiny_encoder):
    """The NPU mode: fixed (batch, length) buckets, dummy rows and padding dropped."""
    _, out = tiny_encoder("embed-mean")
    dynamic = Encoder(out, precision="f32")
    static = Encoder(out, precision="f32", static=True)
    batch = [dynamic.truncate(ids) for ids in dynamic.tokenize(SENTENCES[:19])]  # 19 rows: a 16 and a 4 bucket
    np.testing.assert_allclose(static.embed(batch), dynamic.embed(batch), atol=1e-5)


def test_cpu_threads_are_not_pinned(tiny_encoder):
    """The encoder shares the cores with the chat engine: its inference threads may move between them."""
    _, out = tiny_encoder("embed-mean")
    compiled = Encoder(out, threads=2)._runner._request.get_compiled_model()  # type: ignore[attr-defined]
    assert compiled.get_property("ENABLE_CPU_PINNING") is False


def test_bad_batches_are_refused(tiny_encoder):
    _, embed_dir = tiny_encoder("embed-mean")
    _, rerank_dir = tiny_encoder("rerank")
    encoder, reranker = Encoder(embed_dir), Encoder(rerank_dir)
    too_long = encoder.tokenize([SENTENCES[24]])[0]
    with pytest.raises(EncoderError, match="at most 48"):
        encoder.embed([too_long])
    with pytest.raises(EncoderError, match="no tokens"):
        encoder.embed([[]])
    with pytest.raises(EncoderError, match="does not rerank"):
        encoder.score(reranker.tokenize_pairs("q", ["d"]))
    with pytest.raises(EncoderError, match="does not embed"):
        reranker.embed(encoder.tokenize(["d"]))
    assert encoder.embed([]).shape == (0, encoder.dimensions) and reranker.score([]).shape == (0,)


def test_export_refuses_what_it_cannot_serve(tmp_path, tiny):
    with pytest.raises(ExportError, match="unsupported encoder model_type llama"):
        export_encoder(tiny("llama"), tmp_path / "out", "openvino", "fp32")
    src = tiny_encoders.build("rerank", tmp_path / "two-labels")
    config = json.loads((src / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="one label"):
        export_encoder(src, tmp_path / "out", "openvino", "fp32")
    with pytest.raises(ExportError, match="int4"):
        export_encoder(src, tmp_path / "out", "openvino", "int4")
    assert not (tmp_path / "out").exists()


# ================================================================ the default embedding model, all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm(embedding_hf):
    return reference_model(embedding_hf, "embed")


@pytest.mark.parametrize("weight_format, floor", [("fp32", 0.9999), ("int8", 0.99)])
def test_minilm_matches_sentence_transformers(embedding_export, minilm, weight_format, floor):
    """fp32 in f32 compute: cosine >= 0.9999 to the source model's own embeddings; int8 at the device's default
    precision (what is served): >= 0.99."""
    encoder = Encoder(embedding_export(weight_format), precision="f32" if weight_format == "fp32" else None)
    assert (encoder.task, encoder.dimensions, encoder.max_length) == ("embed", 384, 256)
    batch = [encoder.truncate(ids) for ids in encoder.tokenize(SENTENCES)]
    got = encoder.embed(batch)
    want = reference(minilm, batch, encoder.manifest)
    assert cosines(got, want).min() >= floor


def test_minilm_int8_folded_weights_give_the_int8_vectors(embedding_export):
    """fold_int8_weights (what the encoder does on a CPU without VNNI): every projection of the int8 export gets f32
    weights computed once, the compiled graph's FullyConnected layers read f32 weights instead of decompressing u8
    ones on the fly, and the vectors are the plugin's own decompression's."""
    import openvino as ov

    path = embedding_export("int8")
    core = ov.Core()
    raw = core.read_model(path / Manifest.load(path).model_file)
    folded = raw.clone()
    assert fold_int8_weights(folded) == 6 * 6  # q, k, v, attention output, MLP in and out in each of 6 layers
    assert fold_int8_weights(folded) == 0  # nothing compressed is left

    encoder = Encoder(path, precision="f32")
    batch = [encoder.truncate(ids) for ids in encoder.tokenize(SENTENCES[:8])]
    ids, mask, types = encoder._pad(batch, None)
    vectors, weights = [], []
    for model in (raw, folded):
        # f32 throughout: on a VNNI CPU the plugin would otherwise quantize the u8 graph's activations to int8
        compiled = core.compile_model(
            model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
        )
        ops = compiled.get_runtime_model().get_ordered_ops()
        layers = [op for op in ops if op.get_rt_info()["layerType"].astype(str).startswith("FullyConnected")]
        weights.append({str(op.get_input_element_type(1)) for op in layers})
        hidden = compiled.create_infer_request().infer(
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )[0]
        vectors.append(pool(np.array(hidden), mask, "mean", True))
    assert weights == [{"<Type: 'uint8_t'>"}, {"<Type: 'float32'>"}]
    assert cosines(vectors[1], vectors[0]).min() >= 0.99999
    if encoder._runner.folded:  # this CPU folds: the encoder itself computes the folded graph's vectors
        np.testing.assert_allclose(encoder.embed(batch), vectors[1], atol=1e-5)


def test_minilm_tokenizer_matches_transformers(embedding_export, embedding_hf):
    from transformers import AutoTokenizer

    encoder = Encoder(embedding_export("fp32"))
    tokenizer = AutoTokenizer.from_pretrained(embedding_hf)
    want = tokenizer(SENTENCES, truncation=True, max_length=encoder.max_length)["input_ids"]
    assert [encoder.truncate(ids) for ids in encoder.tokenize(SENTENCES)] == want


def test_minilm_padding_invariance(embedding_export):
    encoder = Encoder(embedding_export("fp32"), precision="f32")
    short, long = encoder.tokenize(["Ok.", SENTENCES[24] * 3])
    long = encoder.truncate(long)
    assert len(long) == 256
    np.testing.assert_allclose(encoder.embed([long, short])[1], encoder.embed([short])[0], atol=1e-5)


def test_minilm_onnx_matches_openvino(embedding_hf, embedding_export, tmp_path):
    out = tmp_path / "onnx-fp32"
    export_encoder(embedding_hf, out, "onnx", "fp32")
    onnx_encoder = Encoder(out)
    openvino_encoder = Encoder(embedding_export("fp32"), precision="f32")
    batch = [onnx_encoder.truncate(ids) for ids in onnx_encoder.tokenize(SENTENCES)]
    assert cosines(onnx_encoder.embed(batch), openvino_encoder.embed(batch)).min() >= 0.9999


def test_export_cli_routes_encoders(tmp_path, capsys):
    """`python -m export SRC OUT` sends an encoder folder to the encoder exporter, by its model_type."""
    from export.__main__ import main

    src = tiny_encoders.build("embed-cls", tmp_path / "src")
    assert main([str(src), str(tmp_path / "out"), "--backend", "onnx", "--weight-format", "fp32"]) == 0
    assert "embed, onnx fp32" in capsys.readouterr().err
    manifest = Manifest.load(tmp_path / "out")
    assert (manifest.task, manifest.pooling, manifest.backend) == ("embed", "cls", "onnx")
    assert main([str(src), str(tmp_path / "out2"), "--task", "rerank"]) == 2  # not a cross-encoder
