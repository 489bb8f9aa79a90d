"""Devices, the compile cache, NPU's prompt rule and the start-up line (appliance/devices.py, --cache-dir,
--max-prompt-len, appliance/server/startup.py).

On this CPU-only machine: `appliance devices` lists the CPU; `serve --device GPU` stops before anything starts
with one line naming the devices present; the compile cache writes blobs on a first load and the second load reads
them (OpenVINO's LOADED_FROM_CACHE, not timing); an unwritable cache directory only turns the cache off. The
static-shape path (what an NPU runs, exercised on CPU) refuses a prompt over --max-prompt-len with a 400 naming
the limit; that server's log starts with the effective settings."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from appliance import cli, devices, options
from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.backends.openvino_common import compile_properties
from appliance.runtime.engine import Engine, PromptTooLong
from appliance.server import startup
from appliance.settings import ConfigError, ModelSpec, ServeSettings
from tests.helpers import Server

ROOT = Path(__file__).resolve().parents[2]
OPENVINO, ONNX = SimpleNamespace(backend="openvino"), SimpleNamespace(backend="onnx")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for flag in options.SERVE_OPTIONS:
        monkeypatch.delenv(options.env_name(flag), raising=False)


def engine_config(*flags: str, manifest=OPENVINO) -> EngineConfig:
    return options.engine_config(cli.build_parser().parse_args(["serve", *flags]), manifest)


# ---------------------------------------------------------------- appliance devices


def test_devices_lists_the_cpu_with_its_name(capsys):
    assert cli.main(["devices", "--json"]) == 0
    rows = {row["device"]: row for row in json.loads(capsys.readouterr().out)}
    cpu = rows["CPU"]
    assert cpu["name"].strip() and "FP32" in cpu["capabilities"]
    assert isinstance(cpu["isa"], list)
    assert cli.main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["DEVICE", "NAME", "CAPABILITIES"]
    assert any(line.startswith("CPU ") and cpu["name"] in line for line in lines[1:])


@pytest.mark.parametrize(
    "device, present, absent",
    [
        ("CPU", ["CPU"], []),
        ("GPU", ["CPU"], ["GPU"]),
        ("GPU", ["CPU", "GPU.0"], []),
        ("GPU.1", ["CPU", "GPU.0"], ["GPU.1"]),
        ("npu", ["CPU"], ["NPU"]),
        ("AUTO", ["CPU"], []),
        ("AUTO:GPU,CPU", ["CPU"], ["GPU"]),
        ("HETERO:NPU,CPU", ["CPU", "NPU"], []),
        ("MULTI:GPU.0,GPU.1", ["GPU.0"], ["GPU.1"]),
    ],
)
def test_missing_devices(device, present, absent):
    assert devices.missing(device, present) == absent


def test_serve_on_a_missing_device_is_one_line(model_dir):
    """Before any process starts or the model loads: rc 78 (EX_CONFIG) and one line naming what is present. The
    device asked for is one this machine lacks: GPU where there is none, else a GPU index no box has (the product's
    target boxes have an iGPU)."""
    present = devices.available()
    device = next(d for d in ("GPU", "NPU", "GPU.9") if devices.missing(d, present))
    proc = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model_dir), "--device", device, "--port", "9"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")},
    )
    assert proc.returncode == 78 and proc.stdout == ""  # EX_CONFIG: a configuration error
    assert proc.stderr.splitlines() == [
        f"appliance: device {device} is not present on this machine; present: {', '.join(present)} "
        "(see `appliance devices`)"
    ]


# ---------------------------------------------------------------- --cache-dir / --max-prompt-len flags


def test_cache_dir_words(monkeypatch, tmp_path):
    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "state"))
    assert engine_config().cache_dir == str(tmp_path / "state" / "cache" / "openvino")  # auto: on by default
    assert engine_config("--cache-dir", "none").cache_dir is None
    assert engine_config("--cache-dir", str(tmp_path / "c")).cache_dir == str(tmp_path / "c")
    assert EngineConfig().cache_dir is None  # the Python API does not write blobs unless asked (config.py)
    assert engine_config(manifest=ONNX).cache_dir is None  # ONNX has no compile cache
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "boxwide"))
    assert engine_config(manifest=ONNX).cache_dir is None  # a box-wide setting does not break ONNX models
    assert engine_config().cache_dir == str(tmp_path / "boxwide")


def test_max_prompt_len_is_a_static_shapes_flag():
    assert engine_config("--static").max_prompt_len == 1024  # OVMS's NPU default
    assert engine_config("--device", "NPU", "--max-prompt-len", "2000").max_prompt_len == 2000
    with pytest.raises(ConfigError, match="--max-prompt-len applies to static shapes"):
        engine_config("--max-prompt-len", "512")
    with pytest.raises(ConfigError, match="--max-prompt-len must be at least 1"):
        engine_config("--static", "--max-prompt-len", "0")


# ---------------------------------------------------------------- the compile cache


LOAD = """
import json, sys
from appliance.config import EngineConfig
from appliance.runtime.engine import Engine
from appliance.params import SamplingParams
engine = Engine(sys.argv[1], EngineConfig(**json.loads(sys.argv[2])))
backend = engine.backend
requests = getattr(backend, "requests", {})
compiled = [r.get_compiled_model() for r in requests.values()] if requests else [backend.compiled]
assert engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0].completion_tokens == 3
engine.shutdown()
print(json.dumps([c.get_property("LOADED_FROM_CACHE") for c in compiled]))
"""


def load(model_dir: Path, **config) -> list[bool]:
    """A server start: a fresh process (in one process a second compile of a transformed model is a new graph to
    OpenVINO's hash: its node names carry process-wide counters). Per compiled graph: was it read from the cache?"""
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(model_dir), json.dumps(config)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_first_start_writes_blobs_the_next_reads_them(exported, tmp_path):
    """The static-shape graphs (NPU's, here on CPU): one blob per shape, read by the next start."""
    out, _ = exported("llama", "openvino", "fp32")
    cache = tmp_path / "cache" / "openvino"  # created on demand
    config = dict(precision="f32", cache_dir=str(cache), static=True, static_context=128, static_batch=2)
    assert load(out, **config) == [False, False]  # the prefill and the decode shapes
    blobs = sorted(cache.glob("*.blob"))
    assert len(blobs) == 2
    assert load(out, **config) == [True, True]
    assert sorted(cache.glob("*.blob")) == blobs


def test_paged_graph_on_cpu_is_not_cached(exported, tmp_path):
    """The CPU plugin cannot import its paged-attention blob (EngineConfig.compile_cache): no blob is written."""
    out, _ = exported("llama", "openvino", "fp32")
    assert load(out, precision="f32", cache_dir=str(tmp_path / "cache")) == [False]
    assert not list(tmp_path.glob("cache/*.blob"))
    assert EngineConfig(cache_dir="/c").compile_cache() is None
    assert EngineConfig(cache_dir="/c", device="GPU.1").compile_cache() == "/c"
    assert EngineConfig(cache_dir="/c", device="NPU").compile_cache() == "/c"


def test_unwritable_cache_dir_runs_without_it(tmp_path, caplog):
    """A read-only box still serves: no CACHE_DIR (OpenVINO would fail the compilation), and a warning.
    (A path under a regular file: unwritable even for root, who ignores permission bits.)"""
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="appliance"):
        props = compile_properties(EngineConfig(cache_dir=str(tmp_path / "file" / "cache"), static=True))
    assert "CACHE_DIR" not in props
    assert any("compile cache disabled" in r.getMessage() for r in caplog.records)
    ok = compile_properties(EngineConfig(cache_dir=str(tmp_path / "ok"), static=True))
    assert ok["CACHE_DIR"] == str(tmp_path / "ok")


# ---------------------------------------------------------------- NPU's prompt rule, the start-up line


def test_static_prompt_over_max_prompt_len_is_refused(exported):
    out, _ = exported("llama", "openvino", "fp32")
    engine = Engine(out, EngineConfig(precision="f32", static=True, static_context=128, max_prompt_len=16))
    try:
        assert engine.generate(list(range(5, 21)), SamplingParams(max_tokens=2))[0].completion_tokens <= 2
        limit = r"17 exceeds the maximum prompt length of this server: 16 .*--max-prompt-len"
        with pytest.raises(PromptTooLong, match=limit):
            engine.submit(list(range(5, 22)), SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()


def test_startup_record_has_the_settings_and_no_secrets(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-very-secret\n")
    engine = EngineConfig(device="NPU", cache_dir="/var/cache/appliance")
    models = [ModelSpec("m", "/models/m", 0, engine)]
    settings = ServeSettings("/models/m", "m", 0, api_key_file=str(keys), models=models)
    record = startup.record(settings)
    text = json.dumps(record)
    assert "sk-very-secret" not in text and record["api_keys"] == "on"
    (model,) = record["models"]
    assert (model["device"], model["compile_cache"], model["max_prompt_len"]) == ("NPU", "/var/cache/appliance", 1024)
    assert model["kv_cache"] == "static 4 slots x 1024 positions"
    assert record["limits_changed"] == {}
    tighter = replace(settings, limits=replace(settings.limits, n=2))
    assert startup.record(tighter)["limits_changed"] == {"n": 2}


def test_static_server_400_names_the_limit_and_logs_its_settings(exported, tmp_path):
    out, manifest = exported("llama", "openvino", "fp32")
    cache = tmp_path / "cache"
    args = ("--static", "--static-context", "128", "--max-prompt-len", "16", "--cache-dir", str(cache))
    with Server(out, tmp_path / "serve.log", *args) as srv:
        url = f"{srv.base}/v3/completions"
        ok = requests.post(url, json={"model": manifest.name, "prompt": [5] * 16, "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200, ok.text
        refused = requests.post(url, json={"model": manifest.name, "prompt": [5] * 17, "max_tokens": 1}, timeout=60)
        assert refused.status_code == 400
        assert "maximum prompt length of this server: 16" in refused.json()["error"]["message"]
    log = srv.log_path.read_text()
    first = json.loads(next(line for line in log.splitlines() if line.startswith("{")))
    assert first["msg"] == "starting"
    (model,) = first["settings"]["models"]
    assert (model["device"], model["max_prompt_len"], model["compile_cache"]) == ("CPU", 16, str(cache))
    assert len(list(cache.glob("*.blob"))) == 2
