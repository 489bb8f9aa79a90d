"""Tokenizer, chat template and generation config: the files the runtime reads instead of transformers."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.manifest import Manifest
from export.graph import GraphInfo
from export.source import Dims, ExportError

COPIED = ("tokenizer_config.json", "special_tokens_map.json", "config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Metadata:
    chat_template_file: str | None  # None: the model has no chat template
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None


def write_metadata(src: Path, dst: Path, config: dict[str, Any]) -> Metadata:
    """Writes the runtime's side files into `dst`. Token ids come from generation_config.json, falling back on
    config.json per key, so a generation config without eos still yields the model's eos."""
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    _write_tokenizer_json(src, dst / TOKENIZER_FILE)
    template = _chat_template(src)
    if template is not None:
        (dst / CHAT_TEMPLATE_FILE).write_text(template)
    generation = _generation_config(src, config)
    (dst / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    ids = {k: config.get(k) if generation.get(k) is None else generation[k] for k in TOKEN_KEYS}
    eos = ids["eos_token_id"]
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return Metadata(
        chat_template_file=CHAT_TEMPLATE_FILE if template is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_list)),
        bos_token_id=ids["bos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )


def _write_tokenizer_json(src: Path, path: Path) -> None:
    """Copies tokenizer.json; a folder with only a slow tokenizer (e.g. tokenizer.model) is converted once
    here so the runtime never needs transformers or sentencepiece."""
    if (src / TOKENIZER_FILE).is_file():
        shutil.copyfile(src / TOKENIZER_FILE, path)
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src, use_fast=True, local_files_only=True)
        tokenizer.backend_tokenizer.save(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure here means the same thing to the user
        raise ExportError(f"no {TOKENIZER_FILE} in {src} and its tokenizer could not be converted: {exc}") from None


def _chat_template(src: Path) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers; a list of named templates
    (tool-use variants) yields the one named "default"."""
    if (src / CHAT_TEMPLATE_FILE).is_file():
        return (src / CHAT_TEMPLATE_FILE).read_text()
    tokenizer_config = src / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return None
    template = json.loads(tokenizer_config.read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", template[0].get("template") if template else None)
    return template or None


def _generation_config(src: Path, config: dict[str, Any]) -> dict[str, Any]:
    if (src / GENERATION_CONFIG_FILE).is_file():
        return json.loads((src / GENERATION_CONFIG_FILE).read_text())
    return {k: config[k] for k in TOKEN_KEYS if config.get(k) is not None}


def llm_manifest(graph: GraphInfo, dims: Dims, metadata: Metadata, **fields: Any) -> Manifest:
    """The manifest of an exported causal LM (the exporter's and a pulled IR's): what its graph, its config's
    dimensions and its side files say, plus `fields` (name, backend, weight format and file, architecture, model
    type, source, weight compression)."""
    return Manifest(
        **fields,
        **vars(dims),
        kv_dtype=graph.kv_dtype,
        stateful=graph.stateful,
        inputs=graph.inputs,
        outputs=graph.outputs,
        eos_token_ids=metadata.eos_token_ids,
        bos_token_id=metadata.bos_token_id,
        pad_token_id=metadata.pad_token_id,
        chat_template_file=metadata.chat_template_file,
    )
