"""The server's state as installed: the data dir (models) read-only, as the systemd unit, the image and the pod keep
it, and a separate writable state dir (--state-dir / APPLIANCE_STATE_DIR, appliance/state.py) for the Responses
store and the KV disk tier.

The installed layout is emulated as an operator's trial did: the server runs in a private mount namespace
(`unshare --mount`) where the data dir and the model are read-only bind mounts (EROFS, even for root), with the
unit's variables (APPLIANCE_DATA_DIR, APPLIANCE_STATE_DIR, APPLIANCE_KV_DISK_DIR, APPLIANCE_CACHE_DIR, read from
systemd/appliance.service and moved under a temporary root). Real servers, the real `openai` and `ollama` clients,
real SQLite files:
- a stored conversation (`previous_response_id`) is served, streamed and unary, and survives a restart, which
  also loads the prompt's KV blocks from the disk tier in the state dir;
- per-key store budgets: another key's writes never evict a key's stored response;
- a store that fails after the generation (the state dir turned read-only under the running server, `nsenter`)
  ends a stream with an `error` event and a unary request with 503, never a cut stream or a 500;
- a pull (Ollama's /api/pull, an admin key) lands in the state dir, leaves the data dir as it was, and is served
  after a restart, with the unit's variables and with the image's (both read from their files);
- a state dir given explicitly that cannot be written refuses the start (exit 78, one line); the default one (the
  read-only data dir) starts with one warning and refuses `store: true` before any work (503), serving
  `store: false`; a pull is refused at once (503), not after its download.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import ollama
import openai
import pytest
import requests

from appliance.settings import EX_CONFIG
from appliance.testing.hub import StubHub, ir_repo
from appliance.testing.loopback import ROOT, LoopbackServer
from export.default_model import ensure_export
from tests.helpers import START_TIMEOUT, Server

pytestmark = pytest.mark.default_model

KEYS = ("state-key-a-0123456789", "state-key-b-0123456789")
BUDGET = 60_000  # --responses-max-bytes: per key
# long enough to fill whole KV blocks (the disk tier keeps full blocks only)
LONG_INPUT = "Please tell me, in a few words, what the capital of France is. " * 12
# mount each path before "--" read-only over itself, then run the rest (the unit's ProtectSystem=strict)
READ_ONLY = 'while [ "$1" != -- ]; do mount --bind -o ro "$1" "$1" || exit 1; shift; done; shift; exec "$@"'


def namespace_prefix(read_only: list[Path]) -> list[str]:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None or subprocess.run([unshare, "--mount", "true"]).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the installed layout needs root and a private mount namespace (unshare --mount)")
        pytest.skip("needs root and a private mount namespace (unshare --mount) for read-only bind mounts")
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", READ_ONLY, "sh", *map(str, read_only), "--"]


def serve_command(model_dir: Path, port: int, *args: str) -> list[str]:
    serve = [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1"]
    return [*serve, "--port", str(port), *args]


class InstalledServer(Server):
    """helpers.Server, started in a mount namespace where `read_only` are read-only, with `env` on top."""

    def __init__(self, model_dir: Path, log_path: Path, read_only: list[Path], env: dict[str, str], *args: str):
        prefix = namespace_prefix(read_only)
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        LoopbackServer.__init__(
            self,
            lambda port: [*prefix, *serve_command(model_dir, port, *args)],
            log_path,
            env=full_env | env,
            start_timeout=START_TIMEOUT,
        )


def installed_variables(source: str) -> dict[str, str]:
    """The APPLIANCE_* variables naming directories, as the systemd unit (`unit`) or the image (`image`) sets them:
    read from systemd/appliance.service's Environment= lines or the Dockerfile's last ENV, so the test follows them."""
    if source == "unit":
        text = (ROOT / "systemd/appliance.service").read_text()
        pairs = re.findall(r"^Environment=(APPLIANCE_\w+)=(\S*)$", text, re.M)
    else:
        last_env = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").split("\nENV ")[-1].split("\n")[0]
        pairs = re.findall(r"(APPLIANCE_\w+)=(\S+)", last_env)
    return {name: value for name, value in pairs if value.startswith("/")}


def layout(root: Path, source: str = "unit") -> tuple[Path, Path, dict[str, str]]:
    """A data dir (read-only once mounted), a state dir, and the unit's (or the image's) directory variables moved
    under `root`: /var/lib/appliance -> root/data, its state/ -> root/state, /var/cache -> root."""
    data, state = root / "data", root / "state"
    (data / "models").mkdir(parents=True)
    state.mkdir(mode=0o700)
    variables = installed_variables(source)
    installed_state = Path(variables["APPLIANCE_STATE_DIR"])
    installed_data = Path(variables["APPLIANCE_DATA_DIR"])
    assert installed_state.parent == installed_data, variables  # the layout the docs describe

    def moved(value: str) -> str:
        path = Path(value)
        for installed, here in ((installed_state, state), (installed_data, data), (Path("/var/cache"), root)):
            if path == installed or installed in path.parents:
                return str(here / path.relative_to(installed))
        raise AssertionError(f"{value}: outside the data, state and cache dirs")

    env = {name: moved(value) for name, value in variables.items()}
    assert {"APPLIANCE_DATA_DIR", "APPLIANCE_STATE_DIR", "APPLIANCE_KV_DISK_DIR", "APPLIANCE_CACHE_DIR"} <= set(env)
    return data, state, env


@pytest.fixture(scope="module")
def installed(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("installed")
    data, state, env = layout(root)
    keyfile = root / "api-keys"
    keyfile.write_text("\n".join(KEYS) + "\n")
    keyfile.chmod(0o600)
    args = ("--api-key-file", str(keyfile), "--workers", "2", "--responses-max-bytes", str(BUDGET))
    runs = iter(range(1, 10))

    def start() -> InstalledServer:
        return InstalledServer(model_dir, root / f"serve{next(runs)}.log", [data, model_dir], env, *args)

    box = {"server": start(), "start": start, "data": data, "state": state}
    try:
        box["server"].wait_ready()
        yield box
    finally:
        box["server"].close()


def client(srv: Server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v3", api_key=key, max_retries=0, timeout=120)


def finished(srv: Server) -> float:
    """Sequences the engine finished, any reason: what ran."""
    return sum(v for k, v in srv.metrics().items() if k.startswith("appliance_sequences_finished_total"))


def stream_events(srv: Server, body: dict, key: str = KEYS[0]) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"}
    with requests.post(srv.base + "/v3/responses", json={**body, "stream": True}, headers=headers, stream=True) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_a_stored_conversation_with_a_read_only_data_dir_and_across_a_restart(installed):
    srv = installed["server"]
    model = client(srv).models.list().data[0].id
    first = client(srv).responses.create(model=model, input=LONG_INPUT, max_output_tokens=8, temperature=0)
    assert first.status in ("completed", "incomplete")
    events = stream_events(srv, {"model": model, "input": "And of Italy?", "previous_response_id": first.id})
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    second_id = events[-1]["response"]["id"]
    # the continuation saw turn 1: its prompt holds turn 1's input
    assert events[-1]["response"]["usage"]["input_tokens"] > first.usage.input_tokens
    store = installed["state"] / "responses.sqlite3"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    assert sorted(p.name for p in installed["data"].iterdir()) == ["models"]  # nothing written there
    assert list((installed["state"] / "kv").rglob("*")), "the disk tier wrote no blocks in the state dir"

    installed["server"].close()
    srv = installed["server"] = installed["start"]()
    srv.wait_ready()
    assert client(srv).responses.retrieve(second_id).id == second_id
    again = client(srv).responses.create(model=model, input=LONG_INPUT, max_output_tokens=1, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0, again.usage  # from the disk tier: the pool is new
    third = client(srv).responses.create(model=model, input="And Spain?", previous_response_id=second_id)
    assert third.usage.input_tokens > first.usage.input_tokens


def test_one_keys_writes_never_evict_anothers_stored_responses(installed):
    """A shared budget let key B erase key A's conversations (10 big responses from B made A's a 404); now each key
    has --responses-max-bytes of its own and evicts only its own oldest."""
    srv = installed["server"]
    model = client(srv).models.list().data[0].id
    a = client(srv, KEYS[0]).responses.create(model=model, input="hi", max_output_tokens=2)
    metadata = {f"k{i}": "x" * 512 for i in range(16)}  # ~8 KB stored per response
    b_ids = [
        client(srv, KEYS[1]).responses.create(model=model, input="hi", max_output_tokens=2, metadata=metadata).id
        for _ in range(10)
    ]
    assert client(srv, KEYS[0]).responses.retrieve(a.id).id == a.id
    with pytest.raises(openai.NotFoundError):  # B's budget still bounds B: its own oldest went
        client(srv, KEYS[1]).responses.retrieve(b_ids[0])
    assert client(srv, KEYS[1]).responses.retrieve(b_ids[-1]).id == b_ids[-1]


def test_a_store_that_fails_after_the_generation_ends_the_stream_with_an_error(installed):
    """The state dir turned read-only under the running server (a bind mount in its namespace): the generation
    runs, the commit fails; the stream's last event is `error` (code store_failed), never a bare stop, and a
    unary request is a 503 with the same code, not a 500. The server is restarted after it (a fresh namespace): the
    read-only mount cannot be taken away again under it while the store holds files open on it ("target is busy")."""
    srv = installed["server"]
    model = client(srv).models.list().data[0].id
    state = str(installed["state"])
    nsenter = ["nsenter", "--target", str(srv.proc.pid), "--mount"]
    subprocess.run([*nsenter, "mount", "--bind", "-o", "ro", state, state], check=True, timeout=30)
    try:
        events = stream_events(srv, {"model": model, "input": "hi", "max_output_tokens": 2})
        types = [e["type"] for e in events]
        assert types[-1] == "error" and "response.completed" not in types, types
        assert events[-1]["code"] == "store_failed", events[-1]
        assert "response.output_item.done" in types  # the work was done; only the store failed
        with pytest.raises(openai.APIStatusError) as failed:
            client(srv).responses.create(model=model, input="hi", max_output_tokens=2)
        assert failed.value.status_code == 503 and failed.value.code == "store_failed", failed.value
        unstored = client(srv).responses.create(model=model, input="hi", max_output_tokens=2, store=False)
        assert unstored.status in ("completed", "incomplete")
    finally:
        installed["server"].close()
        installed["server"] = installed["start"]()  # a fresh namespace: the state dir writable again
        installed["server"].wait_ready()
    kept = client(installed["server"]).responses.create(model=model, input="hi", max_output_tokens=2)
    assert client(installed["server"]).responses.retrieve(kept.id).id == kept.id  # the store commits again


def test_an_explicit_state_dir_that_cannot_be_written_refuses_the_start(model_dir, tmp_path):
    data, state, env = layout(tmp_path)
    prefix = namespace_prefix([data, state])
    run = subprocess.run(
        [*prefix, *serve_command(model_dir, 1)],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == EX_CONFIG, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"appliance: --state-dir {state} cannot be written (Read-only file system)"), line


def test_the_default_state_dir_read_only_refuses_store_before_any_work(model_dir, tmp_path):
    """No state dir given: the data dir is it, read-only here. One warning at start-up; `store: true` (OpenAI's
    default) is refused with 503 store_unavailable before generating (the engine counts no request), and
    `store: false` is served."""
    data, _, env = layout(tmp_path)
    del env["APPLIANCE_STATE_DIR"], env["APPLIANCE_KV_DISK_DIR"]
    with InstalledServer(model_dir, tmp_path / "serve.log", [data], env | {"APPLIANCE_STATE_DIR": ""}) as srv:
        warnings = [line for line in srv.output().splitlines() if "cannot be written" in line]
        assert len(warnings) == 1 and '"level": "warning"' in warnings[0], warnings
        model = client(srv).models.list().data[0].id
        before = finished(srv)
        with pytest.raises(openai.APIStatusError) as refused:
            client(srv).responses.create(model=model, input="hi", max_output_tokens=2)
        assert refused.value.status_code == 503 and refused.value.code == "store_unavailable", refused.value
        with requests.post(
            srv.base + "/v3/responses", json={"model": model, "input": "hi", "stream": True}, stream=True, timeout=60
        ) as r:
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert finished(srv) == before
        served = client(srv).responses.create(model=model, input="hi", max_output_tokens=2, store=False)
        assert served.status in ("completed", "incomplete")
        pull = requests.post(srv.base + "/api/pull", json={"model": "org/name", "stream": False}, timeout=60)
        assert pull.status_code == 503 and "state dir" in pull.json()["error"], pull.text
        assert sorted(p.name for p in data.iterdir()) == ["models"]  # nothing written in the data dir


def pull_and_serve_installed(source: str, model_dir: Path, root: Path) -> None:
    """/api/pull on the installed layout of `source` (the unit or the image): the data dir and the model read-only,
    the state dir writable. The pulled model goes to the state dir (nothing under the data dir changes), the pull's
    stream ends in success, and the next start serves it by name (`--serve-pulled`, the default)."""
    repo = "test/state-int4-ov"
    root.mkdir(parents=True)
    data, state, env = layout(root, source)
    admin = root / "admin-keys"
    admin.write_text("state-admin-0123456789\n")
    admin.chmod(0o600)
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    with StubHub({repo: ir_repo(ensure_export("openvino", "int4"), root / "hub")}) as hub:
        env = {**env, "HF_ENDPOINT": hub.url}
        runs = iter(range(1, 3))

        def start() -> InstalledServer:
            return InstalledServer(
                model_dir, root / f"serve{next(runs)}.log", [data, model_dir], env, "--admin-key-file", str(admin)
            )

        headers = {"Authorization": "Bearer state-admin-0123456789"}
        with start() as srv:
            progress = [p.status for p in ollama.Client(host=srv.base, headers=headers).pull(repo, stream=True)]
            assert progress[-1] == "success", progress
        assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
        pulled = [p for p in state.rglob("openvino_model.xml")]
        assert pulled, sorted(str(p.relative_to(state)) for p in state.rglob("*"))[:20]
        with start() as srv:
            chat = ollama.Client(host=srv.base, headers=headers).chat(
                repo, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4, "temperature": 0}
            )
            assert chat.done and chat.message.content is not None


@pytest.mark.slow
def test_a_pull_lands_in_the_state_dir_and_is_served_after_a_restart(model_dir, tmp_path, monkeypatch):
    """The pull on the installed layout of the unit and of the image, once per distinct layout: a source whose
    directory variables are the same as an earlier one's would run the very same servers with the very same
    environment again (today the image names the unit's directories: one run, two installed starts, saved)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the exporter sets it in this process
    runs: dict[tuple, str] = {}
    for source in ("unit", "image"):
        variables = installed_variables(source)
        assert {"APPLIANCE_DATA_DIR", "APPLIANCE_STATE_DIR", "APPLIANCE_KV_DISK_DIR"} <= set(variables), source
        runs.setdefault(tuple(sorted(variables.items())), source)
    for source in runs.values():
        pull_and_serve_installed(source, model_dir, tmp_path / source)
