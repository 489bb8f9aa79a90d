"""The client matrix's one server: every library in tests/clients/ talks to it (one start a session, the CI budget
of the matrix is its requests, not server starts). Helpers the test modules share are in matrix.py, not here."""

from __future__ import annotations

import pytest
import requests

from appliance.manifest import Manifest
from tests.helpers import Server


@pytest.fixture(scope="session")
def matrix_server(model_dir, embedding_export, tmp_path_factory):
    """The default chat model's fp16 export (conftest's `model_dir`) with the default embedding model beside it,
    2 workers, no API key, the default tool parser and prefix cache: what `appliance serve` runs out of the box."""
    log = tmp_path_factory.mktemp("clients") / "serve.log"
    with Server(model_dir, log, "--workers", "2", "--embedding-model", str(embedding_export("int8"))) as srv:
        yield srv


@pytest.fixture(scope="session")
def base(matrix_server) -> str:
    """The server's root URL: Anthropic's and Ollama's clients append their own paths (/v1/messages, /api/chat)."""
    return matrix_server.base


@pytest.fixture(scope="session")
def v1(base) -> str:
    """The base URL for OpenAI-style clients: /v1 follows OpenAI's rules where OVMS's (/v3) differ."""
    return base + "/v1"


@pytest.fixture(scope="session")
def embedding_model(embedding_export) -> str:
    return Manifest.load(embedding_export("int8")).name


@pytest.fixture(scope="session")
def ollama_tag(base, model_name) -> str:
    """The chat model's name as Ollama's API lists it (name:tag)."""
    tags = requests.get(base + "/api/tags", timeout=30).json()["models"]
    return next(m["model"] for m in tags if m["model"].split(":")[0] == model_name)
