"""An exported encoder (embeddings or rerank) in the engine process: tokenize, one forward per batch, pool.

The manifest (appliance/manifest.py) is the one declaration of what the model does: `task` (embed | rerank),
`pooling` (mean | cls | last), `normalize`, `max_length` (tokens per input, special tokens included) and
`dimensions`. This class only applies it; it never decides a batch. The serving side composes batches (length
buckets, a token budget) from `tokenize`/`tokenize_pairs` lengths and calls `embed`/`score` once per batch.

- Tokenizing uses the `tokenizers` library on the exported tokenizer.json, with the file's own truncation and
  padding switched off (sentence-transformers folders ship `Fixed: 128` padding and truncation at 128): the caller
  sees every input's true length and decides between a 400 and `truncate`.
- `embed`/`score` run the batch as forwards over length groups: its inputs sorted by length and cut where one
  more forward costs less than the padding it saves (`groups`: the cheapest split, by dynamic programming, of a
  forward's cost = FORWARD_TOKENS + longest x inputs), each group padded to its longest member, with the attention
  mask; padded positions never reach a pooled vector (masked mean, CLS, or the last real token); results in the
  caller's order. Dynamic shapes on CPU/GPU. Why: padding costs what the padded tokens cost, and batching buys
  nothing on a CPU this size: all-MiniLM-L6-v2 int8, 2 threads (the 2-core AVX2 dev box, load average 4-9):
  1 x 16 tokens 23 ms, 1 x 128 111 ms, 8 x 16 105 ms (the same tokens/s), 1 x 4 8.8 ms (a forward's own cost:
  ~6 tokens' worth, hence FORWARD_TOKENS = 8). 96 held-out sentences (4-157 tokens) in batches of 32 took
  3.8-5.1 s padded to each batch's longest against 2.0-3.3 s sorted into groups.
- Pooling and normalize run in numpy on last_hidden_state: on all-MiniLM-L6-v2 int8 (384 dims) the masked mean +
  normalize of a 32 x 128 batch took 8 ms against a 7.8 s forward, and 0.02 ms against 84 ms at 1 x 12 tokens
  (medians of 5, a 2-core box at load average 12): under 0.2% either way, so moving it into the graph would buy
  nothing measurable, and the IR stays the plain one openvino_genai's TextEmbeddingPipeline reads.
- Static shapes (`static=True`, the default on NPU, which compiles fixed shapes only): each batch is padded up to
  a bucket of (batch, length) from STATIC_BATCHES x STATIC_LENGTHS and the model is reshaped and compiled once per
  bucket used (lazily, cached); extra rows are dummies whose outputs are dropped.
- A forward on 2+ inference threads is started asynchronously and waited for, not run by the synchronous
  `infer()`: one-sentence forwards of all-MiniLM-L6-v2 int8 on the 2-core dev box (2 threads, 64 sentences x 6
  interleaved runs) took 18.4 ms CPU / 24 ms wall per sentence against 20.3 / 32 ms. On 1 thread the two measured
  the same (14.3 ms CPU, 28 ms wall), and `infer()` runs the forward on the calling thread, whose scheduling
  priority the serving side sets (appliance/server/encoders/priority.py), so 1 thread keeps `infer()`.
- int8 weights on a CPU without VNNI (AVX2 only: the plugin computes in f32 there) are decompressed to f32 once at
  load (`fold_int8_weights`), not on the fly in every forward: the vectors are the int8 export's, and the
  FullyConnected layers run the plain f32 kernels (MLAS/brgemm) instead of brgemm with per-call decompression.
  all-MiniLM-L6-v2 int8 on the 2-core AVX2 dev box, 96 held-out sentences, 4 interleaved reps at load average
  6.5-8.6, unpinned: folded vs on-the-fly 35.9 vs 35.1 sentences/s at batch 1, 30.8 vs 24.7 at 8, 26.0 vs 26.0 at
  32 (CPU 14.1 vs 14.5, 18.2 vs 20.0, 24.8 vs 26.2 ms/sentence); per-layer profile at 8 x 48 tokens: the 36
  FullyConnected layers took 187 ms compressed vs 119 ms with the fp32 export's weights (what folding gives). It
  costs the projections' f32 memory (42 MB instead of 11 MB for this model; the token embeddings stay int8).
  With VNNI the weights stay compressed: the plugin's dynamic quantization computes them in int8 there.
  Quantizing the activations too (NNCF `quantize`, ModelType.TRANSFORMER, SmoothQuant) was measured and
  rejected: without VNNI the plugin's u8 x s8 kernel (jit_gemm_I8) was slower than f32 (36 ms vs 27 ms of
  FullyConnected at 1 x 24 tokens, 201 vs 119 ms at 8 x 48), and a first calibration (32 templated sentences)
  gave a min cosine of 0.80 on the 240 held-out sentences.
- CPU threads are not pinned to cores (CPU_PROPERTIES: ENABLE_CPU_PINNING off; the LATENCY hint pins them on
  Linux): the encoder shares the box with the chat model's engine, and a pinned thread waits for its core while
  another is idle. Same box, same runs, int8 on-the-fly, pinned vs unpinned: 23.0 vs 30.1 sentences/s at batch 1,
  19.3 vs 21.5 at 8, 14.7 vs 17.3 at 32 (CPU 20.6 vs 15.1 ms/sentence at batch 1).
- Threads: `threads` sets INFERENCE_NUM_THREADS (OpenVINO) or intra_op_num_threads (ONNX Runtime); None leaves the
  plugin's default (all cores). How many the encoder gets beside a decoding chat model is the serving side's call
  (not measured here: on this shared 2-core box the load of other work dominates any thread count).

Tokenizing is safe from any thread; `embed`/`score` hold one infer request, so calls from several threads are
serialised by a lock (the serving side runs one batch at a time anyway).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from appliance import cpu_isa
from appliance.manifest import Manifest

__all__ = [
    "CPU_PROPERTIES",
    "STATIC_BATCHES",
    "STATIC_LENGTHS",
    "Encoder",
    "EncoderError",
    "fold_int8_weights",
    "groups",
    "pool",
]

STATIC_BATCHES = (1, 4, 16)
STATIC_LENGTHS = (32, 64, 128, 256, 512)
FORWARD_TOKENS = 8  # a forward's fixed cost in padded tokens' worth (module docstring)
GROUPED = 128  # inputs split optimally at once (the split is quadratic in them); a larger batch goes in slices
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses
MEAN_EPS = 1e-9  # sentence-transformers' clamp on the token count
# CPU compile properties beside the performance hint (module docstring): threads left free to move between cores.
CPU_PROPERTIES: dict[str, Any] = {"ENABLE_CPU_PINNING": False}


class EncoderError(ValueError):
    """A batch the model cannot take (an input longer than max_length, a pair on an embedding model, ...)."""


class Encoder:
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "CPU",
        *,
        threads: int | None = None,
        precision: str | None = None,
        static: bool | None = None,
    ) -> None:
        """`precision`: OpenVINO's INFERENCE_PRECISION_HINT ("f32" for parity with transformers; None: the
        device's default as the chat model gets it). `static`: fixed-shape buckets (default: on NPU only)."""
        self.model_dir = Path(model_dir)
        self.manifest = Manifest.load(self.model_dir)
        if not self.manifest.is_encoder:
            raise EncoderError(f"{self.model_dir} is a {self.manifest.task} model, not an encoder (embed, rerank)")
        self.task: str = self.manifest.task
        self.max_length: int = int(self.manifest.max_length or self.manifest.max_context)
        self.dimensions: int = int(self.manifest.dimensions or self.manifest.hidden_size)
        self.device = device
        self.pad_id = self.manifest.pad_token_id or 0
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / self.manifest.tokenizer_file))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        mask = self._tokenizer.encode("a").special_tokens_mask
        self._lead = next(i for i, special in enumerate(mask) if not special)
        self._trail = len(mask) - 1 - max(i for i, special in enumerate(mask) if not special)
        self._lock = threading.Lock()
        self._tokenizers_lock = threading.Lock()
        self._truncating_tokenizers: dict[str, Tokenizer] = {}
        self._inputs = list(self.manifest.inputs)
        self.static = device.upper().startswith("NPU") if static is None else static
        self.forward_tokens = FORWARD_TOKENS  # `groups`' cost of a forward (a huge one: every batch one forward)
        if self.manifest.backend == "openvino":
            self._runner: _Runner = _OpenVINO(self, device, threads, precision)
        elif self.manifest.backend == "onnx":
            self._runner = _Onnx(self, threads)
        else:
            raise EncoderError(f"unknown backend {self.manifest.backend!r} in {self.model_dir}")

    # Tokenizing

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with the model's special tokens ([CLS] ... [SEP]); never truncated."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def tokenize_pairs(
        self, query: str, documents: Sequence[str], *, truncate: bool = False
    ) -> list[tuple[list[int], list[int]]]:
        """(ids, token_type_ids) per document, as the model's pair template writes them ([CLS] q [SEP] d [SEP]
        for BERT). Not truncated unless `truncate`: then each document is cut so the pair fits max_length (the
        query is kept whole unless it alone is too long)."""
        tokenizer = self._tokenizer
        if truncate:
            query_alone = len(self._tokenizer.encode(query).ids)
            tokenizer = self._truncating("only_second" if query_alone < self.max_length - 1 else "longest_first")
        encodings = tokenizer.encode_batch([(query, d) for d in documents])
        return [(e.ids, e.type_ids) for e in encodings]

    def _truncating(self, strategy: str) -> Tokenizer:
        """A copy of the tokenizer that truncates pairs with `strategy`, made once: the shared one is never
        reconfigured, so tokenizing from several threads at once is safe."""
        with self._tokenizers_lock:
            if strategy not in self._truncating_tokenizers:
                tokenizer = Tokenizer.from_str(self._tokenizer.to_str())
                tokenizer.enable_truncation(self.max_length, strategy=strategy)
                self._truncating_tokenizers[strategy] = tokenizer
            return self._truncating_tokenizers[strategy]

    def truncate(self, ids: list[int]) -> list[int]:
        """`ids` (from `tokenize`) cut to max_length, keeping the leading and trailing special tokens: the ids the
        tokenizer would give with truncation on."""
        if len(ids) <= self.max_length:
            return ids
        keep = self.max_length - self._lead - self._trail
        return ids[: self._lead + keep] + ids[len(ids) - self._trail :]

    # Running

    def embed(self, batch: Sequence[list[int]]) -> np.ndarray:
        """(n, dimensions) float32: one forward over `batch` padded to its longest, pooled (+ normalized)."""
        if self.task != "embed":
            raise EncoderError(f"{self.manifest.name} is a {self.task} model; it does not embed")
        if not batch:
            return np.zeros((0, self.dimensions), np.float32)
        out = np.empty((len(batch), self.dimensions), np.float32)
        for group in self._groups([len(b) for b in batch]):
            ids, mask, types = self._pad([list(batch[i]) for i in group], None)
            hidden = self._run(ids, mask, types)
            out[group] = pool(hidden, mask, self.manifest.pooling or "mean", self.manifest.normalize)
        return out

    def score(self, batch: Sequence[tuple[list[int], list[int]]]) -> np.ndarray:
        """(n,) float32 relevance logits of (ids, token_type_ids) pairs, one forward."""
        if self.task != "rerank":
            raise EncoderError(f"{self.manifest.name} is an {self.task} model; it does not rerank")
        if not batch:
            return np.zeros((0,), np.float32)
        out = np.empty((len(batch),), np.float32)
        for group in self._groups([len(p[0]) for p in batch]):
            ids, mask, types = self._pad([list(batch[i][0]) for i in group], [list(batch[i][1]) for i in group])
            logits = self._run(ids, mask, types)
            out[group] = logits.reshape(len(group), -1)[:, 0]
        return out

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        """The batch's indexes in forwards: one group per static run (its buckets pad anyway), else `groups`."""
        if self.static:
            return [list(range(len(lengths)))]
        return groups(lengths, self.forward_tokens)

    def _pad(
        self, rows: list[list[int]], type_rows: list[list[int]] | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lengths = [len(r) for r in rows]
        if min(lengths) == 0:
            raise EncoderError("an input has no tokens")
        longest = max(lengths)
        if longest > self.max_length:
            raise EncoderError(f"an input has {longest} tokens; the model takes at most {self.max_length}")
        ids = np.full((len(rows), longest), self.pad_id, np.int64)
        mask = np.zeros((len(rows), longest), np.int64)
        types = np.zeros((len(rows), longest), np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
            if type_rows is not None:
                types[i, : len(row)] = type_rows[i]
        return ids, mask, types

    def _run(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> np.ndarray:
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        feed = {k: v for k, v in feed.items() if k in self._inputs}
        with self._lock:
            if self.static:
                return self._run_static(feed, ids.shape)
            return self._runner.run(feed)

    def _run_static(self, feed: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Pads to a (batch, length) bucket; a batch over the largest batch bucket runs in chunks."""
        rows, length = shape
        bucket_length = next((n for n in STATIC_LENGTHS if n >= length), self.max_length)
        bucket_length = max(min(bucket_length, self.max_length), length)
        out = []
        for start in range(0, rows, STATIC_BATCHES[-1]):
            part = {k: v[start : start + STATIC_BATCHES[-1]] for k, v in feed.items()}
            n = next(iter(part.values())).shape[0]
            bucket_rows = next(b for b in STATIC_BATCHES if b >= n)
            padded = {}
            for k, v in part.items():
                full = np.full((bucket_rows, bucket_length), self.pad_id if k == "input_ids" else 0, np.int64)
                full[:n, :length] = v
                if k == "attention_mask":
                    full[n:, 0] = 1  # dummy rows attend to one token, so no row is all-masked
                padded[k] = full
            out.append(self._runner.run(padded, static=(bucket_rows, bucket_length))[:n, :length])
        return np.concatenate(out)

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"Encoder({m.name}, {m.task}, {m.backend} {m.weight_format}, {self.device}, max_length={self.max_length})"
        )


def groups(lengths: Sequence[int], forward: int = FORWARD_TOKENS) -> list[list[int]]:
    """Indexes split into forwards of similar length: sorted by length, cut where the total cost, a forward's
    `forward` tokens + its longest x its inputs each, is least (exact, by dynamic programming over the sorted
    order; slices of GROUPED inputs)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for start in range(0, len(order), GROUPED):
        part = order[start : start + GROUPED]
        n = len(part)
        best = [0.0] + [float("inf")] * n  # best[j]: the cheapest split of part[:j]
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            longest = lengths[part[j - 1]]  # sorted: the group ending at j is padded to it
            for i in range(j):
                cost = best[i] + forward + longest * (j - i)
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        bounds = []
        j = n
        while j:
            bounds.append((cut[j], j))
            j = cut[j]
        out += [part[i:j] for i, j in reversed(bounds)]
    return out


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """sentence-transformers' Pooling (+ Normalize) on (n, length, dim) token vectors and the (n, length) mask."""
    hidden = hidden.astype(np.float32, copy=False)
    if pooling == "mean":
        weights = mask.astype(np.float32)[:, :, None]
        vectors = (hidden * weights).sum(1) / np.maximum(weights.sum(1), MEAN_EPS)
    elif pooling == "cls":
        vectors = hidden[:, 0]
    elif pooling == "last":
        vectors = hidden[np.arange(hidden.shape[0]), mask.sum(1) - 1]
    else:
        raise EncoderError(f"unknown pooling {pooling!r}")
    if normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), NORMALIZE_EPS)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def fold_int8_weights(model: Any) -> int:
    """Replaces each MatMul's compressed weights (an integer constant -> Convert -> Subtract zero point -> Multiply
    scale chain, as NNCF writes int8) by the f32 weights it stands for, computed once here in f32; returns how many.
    The vectors are the int8 export's (the same quantized weights), only where the arithmetic happens changes
    (module docstring: on a CPU without VNNI the plugin's on-the-fly decompression costs more than it saves)."""
    import openvino as ov

    folded = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        source = node.input_value(1).get_node()
        if source.get_type_name() == "Constant":
            continue
        weights = _decompressed(source)
        if weights is None:
            continue
        node.input(1).replace_source_output(ov.op.Constant(ov.Tensor(np.ascontiguousarray(weights))).output(0))
        folded += 1
    if folded:
        model.validate_nodes_and_infer_types()
    return folded


def _decompressed(node: Any) -> np.ndarray | None:
    """A weight chain evaluated in f32, or None when it is not one (anything but constants and the chain's ops, or
    no integer constant at its root)."""
    kind = node.get_type_name()
    if kind == "Constant":
        data = np.array(node.get_data())
        return data.astype(np.float32)
    if kind not in _DECOMPRESSION or (kind == "Convert" and not _integer_root(node)):
        return None
    evaluated = [_decompressed(node.input_value(i).get_node()) for i in range(node.get_input_size())]
    parts = [p for p in evaluated if p is not None]
    if len(parts) != len(evaluated):
        return None
    if kind == "Convert":
        return parts[0]
    return parts[0] - parts[1] if kind == "Subtract" else parts[0] * parts[1]


def _integer_root(node: Any) -> bool:
    """A Convert in a weight chain either reads an integer constant (the quantized weights or zero points) or
    casts the chain's f16 result to f32."""
    source = node.input_value(0).get_node()
    if source.get_type_name() == "Constant":
        return bool(source.get_output_element_type(0).is_integral_number())
    return source.get_type_name() in _DECOMPRESSION


_DECOMPRESSION = ("Convert", "Subtract", "Multiply")


class _Runner:
    folded = 0  # MatMuls whose int8 weights were decompressed to f32 at load (fold_int8_weights)

    def run(self, feed: dict[str, np.ndarray], static: tuple[int, int] | None = None) -> np.ndarray:
        raise NotImplementedError


class _OpenVINO(_Runner):
    def __init__(self, encoder: Encoder, device: str, threads: int | None, precision: str | None) -> None:
        import openvino as ov

        self._core = ov.Core()
        self._model = self._core.read_model(str(encoder.model_dir / encoder.manifest.model_file))
        props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
        if precision:
            props["INFERENCE_PRECISION_HINT"] = precision
        if device.upper() == "CPU":
            isa = cpu_isa.detect()
            props.update(cpu_isa.plugin_properties(isa, precision))
            props.update(CPU_PROPERTIES)
            if threads:
                props["INFERENCE_NUM_THREADS"] = threads
            if not isa.vnni:
                self.folded = fold_int8_weights(self._model)
        self._props, self._device = props, device
        self._on_caller = threads == 1
        self._static: dict[tuple[int, int], Any] = {}
        self._request = None if encoder.static else self._compile(self._model).create_infer_request()

    def _compile(self, model: Any) -> Any:
        return self._core.compile_model(model, self._device, self._props)

    def run(self, feed: dict[str, np.ndarray], static: tuple[int, int] | None = None) -> np.ndarray:
        if static is None:
            request = self._request
        else:
            request = self._static.get(static)
            if request is None:
                model = self._model.clone()
                model.reshape({name: list(static) for name in feed})
                request = self._static[static] = self._compile(model).create_infer_request()
        assert request is not None
        if self._on_caller:
            request.infer(feed)  # on 1 thread the CPU plugin runs it on this thread: its priority applies
        else:  # measured faster on 2+ threads (module docstring)
            request.start_async(feed)
            request.wait()
        return np.array(request.get_output_tensor(0).data)


class _Onnx(_Runner):
    def __init__(self, encoder: Encoder, threads: int | None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        path = str(encoder.model_dir / encoder.manifest.model_file)
        self._session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._output = self._session.get_outputs()[0].name

    def run(self, feed: dict[str, np.ndarray], static: tuple[int, int] | None = None) -> np.ndarray:
        return np.asarray(self._session.run([self._output], feed)[0])
