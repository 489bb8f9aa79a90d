"""`appliance pull` and Ollama's /api/pull and /api/delete against a stand-in hub on loopback
(appliance/testing/hub.py): a repository as OpenVINO's own `*-int4-ov` ones are, made from the default model's int4
export, served by huggingface_hub's file API. Real parts: the CLI and `appliance serve` as subprocesses,
huggingface_hub doing the downloads, the `ollama` client against the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ollama
import pytest
import requests

from appliance import hub_names, paths
from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.pull.store import RECORD
from appliance.testing.hub import Repo, StubHub, ir_repo
from appliance.testing.loopback import LoopbackServer
from tests.helpers import Server, serving_venv, wait_until

ROOT = Path(__file__).resolve().parents[2]
REPO = "test/smol-int4-ov"
EXPORT_TOOLS = ("torch", "transformers", "optimum", "nncf")
BIN = "openvino_model.bin"


@pytest.fixture(scope="module")
def int4_export() -> Path:
    """The default model's int4 OpenVINO export: the stand-in repository's files (built once, cached)."""
    from export.default_model import ensure_export

    return ensure_export("openvino", "int4")


def pull_env(hub: StubHub, data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "APPLIANCE_DATA_DIR": str(data_dir)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.pop("HF_HUB_OFFLINE", None)  # the exporter sets it in its own process (and so in this one's children)
    return env


# `python -m appliance.cli pull ...` and then the modules the process had loaded, as JSON on the last stdout line
PULL_AND_LIST_MODULES = (
    "import json, sys\nfrom appliance.cli import main\ncode = main(sys.argv[1:])\n"
    "print(json.dumps(sorted(sys.modules)))\nsys.exit(code)"
)


def cli_pull(
    python: str, env: dict[str, str], *args: str, timeout: float = 600
) -> tuple[subprocess.CompletedProcess, list[str]]:
    result = subprocess.run(
        [python, "-c", PULL_AND_LIST_MODULES, "pull", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = result.stdout.strip().splitlines()
    return result, json.loads(lines[-1]) if lines else []


def test_names():
    assert hub_names.parse("OpenVINO/Qwen3-0.6B-int4-ov") == hub_names.HubRef("OpenVINO/Qwen3-0.6B-int4-ov", "main")
    assert hub_names.parse("org/m:latest").name == "org/m" and hub_names.parse("org/m:v1.0").name == "org/m:v1.0"
    assert hub_names.parse("org/m:refs/pr/1").folder == "org--m/refs%2Fpr%2F1"
    bad_revisions = (".", "..", "./x", "a/./b", "a//b", "/a", "a/", "-rf", ".git", "a.", "x" * 256)
    for bad in (
        "",
        "a/b/c",
        "org--x/m",
        "org/m:",
        "../m",
        "org/m:a..b",
        "org/m name",
        7,
        *(f"o/m:{r}" for r in bad_revisions),
    ):
        with pytest.raises(ValueError):
            hub_names.parse(bad)
    assert hub_names.parse("o/m:v1.0/rc_2-b").folder == "o--m/v1.0%2Frc_2-b"


def test_rm_of_a_dot_revision_is_refused_and_every_revision_stays(tmp_path):
    """`appliance rm org/name:.` once resolved to the repository's folder and deleted every revision."""
    data = tmp_path / "data"
    env = {**os.environ, "APPLIANCE_DATA_DIR": str(data)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    folders = [data / "models" / "hub" / "org--name" / rev for rev in ("main", "v1")]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / MANIFEST_NAME).write_text("{}")
    for name in ("org/name:.", "org/name:./", "org/name:..", "org/name:-rf"):
        r = subprocess.run([sys.executable, "-m", "appliance.cli", "rm", name], env=env, capture_output=True, text=True)
        assert r.returncode == 1 and "is not a revision" in r.stderr, (name, r.stderr)
        assert all((f / MANIFEST_NAME).is_file() for f in folders), name


def test_a_pulled_model_is_found_by_its_name(tmp_path, monkeypatch):
    """`serve --model NAME` (paths.resolve_model) and a config file's base_path find a pulled model by its name; an
    existing folder of the same relative name still wins, and a name never pulled stays a (missing) path."""
    from appliance.server import config_file

    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "data"))
    folder = paths.pulled_model_dir(hub_names.parse("org/model:v2"))
    folder.mkdir(parents=True)
    (folder / "appliance_manifest.json").write_text("{}")
    assert paths.resolve_model("org/model:v2") == folder and paths.is_pulled(folder)
    assert paths.resolve_model("org/model") == Path("org/model")  # main was never pulled
    config = tmp_path / "config.json"
    entries = [{"config": {"name": "a", "base_path": "org/model:v2"}}, {"config": {"name": "b", "base_path": "m"}}]
    config.write_text(json.dumps({"model_config_list": entries}))
    models = config_file.read(config).models
    assert models is not None and [m["base_path"] for m in models] == ["org/model:v2", str(tmp_path / "m")]


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_cli_pull_resumes_a_dropped_download_imports_no_export_tool_and_serves(int4_export, tmp_path, monkeypatch):
    """The hub drops the connection 30 MB into the weights once: the pull resumes the file (a ranged GET from where
    it stopped), checks every checksum and writes a model folder that `appliance serve --model NAME` serves; the
    process never imported torch or transformers."""
    repo = ir_repo(int4_export, tmp_path, drop_once={BIN: 30_000_000})
    data = tmp_path / "data"
    with StubHub({REPO: repo}) as hub:
        result, modules = cli_pull(sys.executable, pull_env(hub, data), REPO)
        assert result.returncode == 0, result.stderr
        gets = hub.gets(BIN)
        assert [g.range for g in gets][0] is None and len(gets) == 2, gets
        assert gets[1].range is not None and int(gets[1].range[len("bytes=") : -1]) >= 10 << 20, gets  # resumed
        skipped = [r.path for r in hub.requests if r.path.endswith(("README.md", "openvino_tokenizer.xml"))]
        assert skipped == []  # only the files the runtime reads
        seen = len(hub.requests)
        again, _ = cli_pull(sys.executable, pull_env(hub, data), f"{REPO}:latest")  # the same model, up to date
        assert again.returncode == 0 and [r.path for r in hub.requests[seen:]] == [f"/api/models/{REPO}/revision/main"]
    assert not [m for m in modules if m.split(".")[0] in EXPORT_TOOLS]
    assert "huggingface_hub" in modules and "openvino" in modules  # it did download and validate
    for status in ("pulling manifest", "verifying sha256 digest", "writing manifest", "success"):
        assert status in result.stderr.splitlines(), result.stderr
    folder = data / "models" / "hub" / "test--smol-int4-ov" / "main"
    manifest = Manifest.load(folder)
    assert (manifest.name, manifest.weight_format, manifest.backend) == (REPO, "int4", "openvino")
    assert manifest.source.endswith(f"/{REPO}@{repo.commit}")
    assert json.loads((folder / "appliance_pull.json").read_text())["commit"] == repo.commit
    staging = data / "models" / "hub" / ".staging"
    assert sorted(p.suffix for p in staging.iterdir()) == [".lock"]  # the download went into the model

    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(data))
    with Server(REPO, tmp_path / "serve.log", "--workers", "1") as srv:  # found by its name
        body = {"model": REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        r = requests.post(srv.base + "/v3/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        tags = requests.get(srv.base + "/api/tags", timeout=30).json()["models"]
        assert [(t["name"], t["details"]["quantization_level"]) for t in tags] == [(f"{REPO}:latest", "Q4_0")]
        r = requests.delete(srv.base + "/api/delete", json={"model": REPO}, timeout=60)  # the command line names it
        assert r.status_code == 400 and "the config file or the command line names it" in r.json()["error"], r.text
    assert Manifest.load(folder).name == REPO


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_checksum_mismatch_is_refused_and_nothing_is_served(int4_export, tmp_path):
    """The weights arrive with one byte flipped (the right size): the pull fails naming the digests, the bad file
    is deleted (the next pull downloads it again), and no model folder exists."""
    repo = ir_repo(int4_export, tmp_path, corrupt={BIN})
    data = tmp_path / "data"
    with StubHub({REPO: repo}) as hub:
        result, _ = cli_pull(sys.executable, pull_env(hub, data), REPO)
    assert result.returncode == 1
    assert "digest mismatch, file must be downloaded again: openvino_model.bin want sha256:" in result.stderr
    hub_dir = data / "models" / "hub"
    assert sorted(p.name for p in hub_dir.iterdir()) == [".staging"]  # no model folder
    staged = hub_dir / ".staging" / "test--smol-int4-ov@main"
    assert not (staged / BIN).exists() and (staged / "openvino_model.xml").is_file()


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_not_enough_disk_space_is_refused_before_any_download(int4_export, tmp_path):
    repo = ir_repo(int4_export, tmp_path, claimed_sizes={BIN: 1 << 60})
    with StubHub({REPO: repo}) as hub:
        result, _ = cli_pull(sys.executable, pull_env(hub, tmp_path / "data"), REPO)
        assert result.returncode == 1 and "not enough free disk space" in result.stderr, result.stderr
        assert [r for r in hub.requests if "/resolve/" in r.path] == []


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_unknown_repository_and_revision(int4_export, tmp_path):
    with StubHub({REPO: ir_repo(int4_export, tmp_path)}) as hub:
        env = pull_env(hub, tmp_path / "data")
        result, _ = cli_pull(sys.executable, env, "test/nothing-here")
        assert result.returncode == 1 and "pull model manifest: test/nothing-here not found" in result.stderr
        result, _ = cli_pull(sys.executable, env, f"{REPO}:v9")
        assert result.returncode == 1 and "has no revision 'v9'" in result.stderr


ENDLESS = {"endless": {"config.json"}, "claimed_sizes": {"config.json": 24}}  # announces 24 bytes, never ends


def staged_bytes(data: Path) -> dict[str, int]:
    """Every file under the pulls' staging folder but the locks, with its size."""
    staging = data / "models" / "hub" / ".staging"
    return {
        str(f.relative_to(staging)): f.stat().st_size for f in staging.rglob("*") if f.is_file() and f.suffix != ".lock"
    }


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_hub_that_sends_more_than_it_announced_is_stopped_and_rm_clears_the_partial(int4_export, tmp_path):
    """A hostile hub announces a 24-byte config.json and sends an endless body: the pull stops with a clear error
    and deletes the part, well before the disk fills; `appliance rm` clears what the pull left."""
    data = tmp_path / "data"
    with StubHub({REPO: ir_repo(int4_export, tmp_path, **ENDLESS)}) as hub:
        env = pull_env(hub, data)
        result, _ = cli_pull(sys.executable, env, REPO, timeout=120)
        sent = hub.sent.get("config.json", 0)
    assert result.returncode == 1, result.stderr
    assert "config.json: the hub sent more than the 24 bytes it announced; stopped" in result.stderr, result.stderr
    assert sent > 24 and not any(name.endswith(".incomplete") for name in staged_bytes(data)), staged_bytes(data)
    assert sum(staged_bytes(data).values()) < 1 << 20, staged_bytes(data)
    assert not paths.pulled_model_dir(hub_names.parse(REPO)).exists()
    rm = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "rm", REPO], env=env, capture_output=True, text=True, timeout=60
    )
    assert rm.returncode == 0 and f"deleted {REPO}" in rm.stderr, rm.stderr
    staging = data / "models" / "hub" / ".staging"
    assert sorted(p.suffix for p in staging.iterdir()) == [".lock"]


def tiny_repo(folder: Path) -> Repo:
    """A safetensors repository (config.json, model.safetensors, tokenizer) from a tiny random model's folder."""
    return Repo({p.name: p for p in folder.iterdir() if p.is_file()})


def test_a_safetensors_repository_is_exported_where_the_export_tools_are(tiny, tmp_path):
    data = tmp_path / "data"
    with StubHub({"test/tiny-llama": tiny_repo(tiny("llama"))}) as hub:
        result, _ = cli_pull(sys.executable, pull_env(hub, data), "test/tiny-llama", "--weight-format", "fp16")
    assert result.returncode == 0, result.stderr
    manifest = Manifest.load(data / "models" / "hub" / "test--tiny-llama" / "main")
    assert (manifest.name, manifest.backend, manifest.weight_format) == ("test/tiny-llama", "openvino", "fp16")
    assert manifest.source.endswith("/test/tiny-llama@" + Repo({}).commit)


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_private_repository_needs_the_token(int4_export, tmp_path):
    repo = ir_repo(int4_export, tmp_path, token="hf_secret")
    with StubHub({REPO: repo}) as hub:
        env = pull_env(hub, tmp_path / "data")
        env.pop("HF_TOKEN", None)
        refused, _ = cli_pull(sys.executable, {**env, "HF_HOME": str(tmp_path / "hf")}, REPO)  # no stored login
        assert refused.returncode == 1 and "a private one needs HF_TOKEN" in refused.stderr
        result, _ = cli_pull(sys.executable, {**env, "HF_TOKEN": "hf_secret"}, REPO)
        assert result.returncode == 0, result.stderr
        assert {r.authorization for r in hub.requests[-3:]} == {"Bearer hf_secret"}


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_the_serving_venv_pulls_an_ir_repository_and_serves_it(int4_export, tiny, tmp_path):
    """The serving venv (no torch, no transformers: tests/deploy/test_install.py) pulls an OpenVINO IR repository and
    serves it: the issue's "serves without torch installed". A safetensors repository is refused there before
    anything downloads, saying what to install."""
    venv = serving_venv(ROOT)
    python, data = str(venv / "bin" / "python"), tmp_path / "data"
    with StubHub({REPO: ir_repo(int4_export, tmp_path), "test/tiny-llama": tiny_repo(tiny("llama"))}) as hub:
        env = pull_env(hub, data)
        refused, _ = cli_pull(python, env, "test/tiny-llama")
        assert refused.returncode == 1 and "converting them needs the export tools" in refused.stderr
        assert [r for r in hub.requests if "/resolve/" in r.path] == []
        result, modules = cli_pull(python, env, REPO)
    assert result.returncode == 0, result.stderr
    assert not [m for m in modules if m.split(".")[0] in EXPORT_TOOLS]
    assert Manifest.load(data / "models" / "hub" / "test--smol-int4-ov" / "main").name == REPO

    def command(port: int) -> list[str]:
        return [python, "-m", "appliance.cli", "serve", "--model", REPO, "--port", str(port), "--workers", "1"]

    server = LoopbackServer(command, tmp_path / "serve.log", env=env)
    server.ready_path = "/v2/health/ready"
    with server:
        reply = ollama.Client(host=server.base).chat(
            REPO, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4}
        )
        assert reply.message.content and reply.eval_count >= 1


# ---------------------------------------------------------------- /api/pull and /api/delete on a running server


@pytest.fixture(scope="module")
def pull_server(int4_export, model_dir, tmp_path_factory):
    """A server (the default model) whose HF_ENDPOINT is a stand-in hub holding copies of the repository: one to
    pull and delete, one whose weights download slowly (to leave in the middle), and a hostile one (a file
    announced as 24 bytes, sent without end)."""
    root = tmp_path_factory.mktemp("pull-server")
    repos = {
        REPO: ir_repo(int4_export, root),
        "test/slow-int4-ov": ir_repo(int4_export, root, throttle={BIN: 0.05}),
        "test/endless-int4-ov": ir_repo(int4_export, root, **ENDLESS),
    }
    with StubHub(repos) as hub, pytest.MonkeyPatch.context() as mp:
        for key, value in pull_env(hub, root / "data").items():
            mp.setenv(key, value)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        with Server(model_dir, root / "serve.log", "--workers", "1") as srv:
            srv.hub, srv.data = hub, root / "data"
            yield srv


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_api_pull_streams_progress_then_serves_and_delete_waits_for_the_jobs(pull_server):
    srv, client = pull_server, ollama.Client(host=pull_server.base)
    progress = list(client.pull(REPO, stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == [
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ], statuses
    weights = [p for p in progress if p.digest and p.total and p.total > 90_000_000]
    assert (
        weights
        and weights[-1].completed == weights[-1].total
        and weights[0].status == f"pulling {weights[0].digest[7:19]}"
    )
    assert weights[0].digest.startswith("sha256:")

    answer = client.chat(
        REPO, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 8, "temperature": 0}
    )
    assert answer.message.content and answer.done
    assert f"{REPO}:latest" in [m.model for m in client.list().models]

    # a stream in flight on the model (64 tokens, whatever the model says): the delete returns only once it has
    # ended, and it ends whole
    body = {"model": REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "ignore_eos": True}
    events: list = []
    ended: list[float] = []

    def stream() -> None:
        with requests.post(
            srv.base + "/v3/chat/completions", json={**body, "stream": True}, stream=True, timeout=300
        ) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
        ended.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(events) >= 3, "the stream to start")
    asked = time.monotonic()
    assert client.delete(f"{REPO}:latest").status == "success"
    deleted = time.monotonic()
    reader.join(300)
    assert ended and asked < ended[0] <= deleted  # the stream was running when asked, and ended before the answer
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content") is not None) >= 48
    assert not (srv.data / "models" / "hub" / "test--smol-int4-ov").exists()
    with pytest.raises(ollama.ResponseError) as gone:
        client.chat(REPO, messages=[{"role": "user", "content": "Hi"}])
    assert gone.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as again:
        client.delete(REPO)
    assert again.value.status_code == 404


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_api_refusals(pull_server):
    srv, client = pull_server, ollama.Client(host=pull_server.base)
    served = srv.model_id()
    with pytest.raises(ollama.ResponseError) as not_pulled:
        client.delete(served)
    assert not_pulled.value.status_code == 400 and "did not make" in str(not_pulled.value)
    with pytest.raises(ollama.ResponseError) as unknown:
        client.pull("test/nothing-here")
    assert unknown.value.status_code == 404 and "not found" in str(unknown.value)
    r = requests.post(srv.base + "/api/pull", json={"model": "a/b/c"}, timeout=30)
    assert r.status_code == 400 and "not a hub repository id" in r.json()["error"]
    r = requests.post(
        srv.base + "/api/pull", json={"model": REPO}, headers={"Origin": "http://evil.example"}, timeout=30
    )
    assert r.status_code == 403 and r.json() == {
        "error": "Pulling models is refused to a web page (the request has an Origin header)"
    }


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_api_pull_stops_a_file_past_its_announced_size_and_api_delete_clears_the_partial(pull_server):
    """/api/pull of the hostile repository ends (streamed and not) with Ollama's `{"error"}`, 502 unstreamed; the
    part is deleted, and /api/delete clears what the pull left (then 404: nothing left)."""
    srv, name = pull_server, "test/endless-int4-ov"
    deadline = time.monotonic() + 90
    with requests.post(srv.base + "/api/pull", json={"model": name}, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            lines.append(json.loads(line))
            assert time.monotonic() < deadline, f"the pull never stopped: {lines[-1]}"
    assert "the hub sent more than the 24 bytes it announced" in lines[-1].get("error", ""), lines[-1]
    assert set(lines[-1]) == {"error"}  # Ollama's shape on a stream
    with pytest.raises(ollama.ResponseError) as unary:
        ollama.Client(host=srv.base, timeout=90).pull(name)
    assert unary.value.status_code == 502 and "24 bytes it announced" in str(unary.value)
    staged = staged_bytes(srv.data)
    assert not any(f.endswith(".incomplete") for f in staged) and sum(staged.values()) < 1 << 20, staged
    assert (
        any(f.startswith("test--endless-int4-ov@main") for f in staged)
        or (srv.data / "models" / "hub" / ".staging" / "test--endless-int4-ov@main").is_dir()
    )
    r = requests.delete(srv.base + "/api/delete", json={"model": name}, timeout=60)
    assert r.status_code == 200, r.text
    assert not (srv.data / "models" / "hub" / ".staging" / "test--endless-int4-ov@main").exists()
    r = requests.delete(srv.base + "/api/delete", json={"model": name}, timeout=60)
    assert r.status_code == 404, r.text


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_client_that_leaves_a_pull_leaves_no_model_and_the_next_pull_resumes(pull_server):
    """A client that leaves in the middle of the weights stops the pull's child process (no model folder appears);
    the next pull resumes the weights from where the first stopped (a ranged GET: had the child gone on, the file
    would be complete and not fetched again)."""
    srv, name = pull_server, "test/slow-int4-ov"
    workers_before = set(srv.process_tree())
    with requests.post(srv.base + "/api/pull", json={"model": name}, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event.get("total", 0) > 90_000_000 and event.get("completed", 0) > 10_000_000:
                break  # leave in the middle of the weights
    wait_until(lambda: set(srv.process_tree()) <= workers_before, "the pull's child process to end")
    assert paths.pulled_model(name) is None
    assert not (srv.data / "models" / "hub" / "test--slow-int4-ov").exists()
    started = len(srv.hub.gets(BIN))
    progress = list(ollama.Client(host=srv.base).pull(name, stream=True))
    assert progress[-1].status == "success"
    resumed = [g for g in srv.hub.gets(BIN)[started:] if "slow" in g.path]
    assert resumed and resumed[0].range is not None and int(resumed[0].range[6:-1]) > 0, resumed


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_pulled_model_is_served_on_demand_after_a_restart(int4_export, model_dir, tmp_path, monkeypatch):
    """A model pulled before the server started (as after a restart) is served without being named: /api/tags lists
    it at once, unloaded (/api/ps does not), and a chat loads it; --no-serve-pulled serves only the named model."""
    data = tmp_path / "data"
    with StubHub({REPO: ir_repo(int4_export, tmp_path)}) as hub:
        env = pull_env(hub, data)
        result, _ = cli_pull(sys.executable, env, REPO)
    assert result.returncode == 0, result.stderr
    for key in ("HF_ENDPOINT", "APPLIANCE_DATA_DIR"):
        monkeypatch.setenv(key, env[key])
    pulled = paths.pulled_model_dir(hub_names.parse(REPO))
    broken = paths.pulled_model_dir(hub_names.parse(f"{REPO}:broken"))  # a damaged pull: no tokenizer, no weights
    broken.mkdir()
    (broken / MANIFEST_NAME).write_text((pulled / MANIFEST_NAME).read_text())
    record = json.loads((pulled / RECORD).read_text())
    (broken / RECORD).write_text(json.dumps({**record, "revision": "broken"}))
    with Server(model_dir, tmp_path / "serve.log", "--workers", "1") as srv:  # ready: the damaged one is left out
        client = ollama.Client(host=srv.base)
        assert f"{REPO}:latest" in [m.model for m in client.list().models]
        assert f"{REPO}:broken" not in [m.model for m in client.list().models]
        assert f"{REPO}:latest" not in [m.model for m in client.ps().models]  # listed, not loaded
        answer = client.chat(
            REPO, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 8, "temperature": 0}
        )
        assert answer.message.content and answer.done
        assert f"{REPO}:latest" in [m.model for m in client.ps().models]
        assert REPO in [m["id"] for m in requests.get(srv.base + "/v3/models", timeout=30).json()["data"]]
    with Server(model_dir, tmp_path / "serve-named-only.log", "--workers", "1", "--no-serve-pulled") as srv:
        assert f"{REPO}:latest" not in [m.model for m in ollama.Client(host=srv.base).list().models]


@pytest.mark.default_model  # the stand-in repository is the default model's int4 export
def test_a_model_pulled_beside_a_running_server_is_served_after_a_reload(int4_export, model_dir, tmp_path):
    """`appliance pull` while a server (with --config) runs: POST /v1/config/reload serves it, as a model the
    file adds; after `appliance rm` the next reload stops serving it."""
    data = tmp_path / "data"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_config_list": [{"config": {"name": "base", "base_path": str(model_dir)}}]}))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--port", str(port)]

    with StubHub({REPO: ir_repo(int4_export, tmp_path)}) as hub:
        env = {**pull_env(hub, data), "APPLIANCE_WORKERS": "1"}
        with LoopbackServer(command, tmp_path / "serve.log", env=env) as srv:

            def served() -> list[str]:
                return [m["id"] for m in requests.get(srv.base + "/v3/models", timeout=30).json()["data"]]

            assert served() == ["base"]
            result, _ = cli_pull(sys.executable, env, REPO)
            assert result.returncode == 0, result.stderr
            r = requests.post(srv.base + "/v1/config/reload", timeout=300)
            assert r.status_code == 201 and r.json()[REPO]["loaded"], r.text  # 201: the served models changed
            assert sorted(served()) == sorted(["base", REPO])
            answer = ollama.Client(host=srv.base).chat(
                REPO, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 4, "temperature": 0}
            )
            assert answer.message.content and answer.done
            rm = subprocess.run(
                [sys.executable, "-m", "appliance.cli", "rm", REPO], env=env, capture_output=True, text=True
            )
            assert rm.returncode == 0, rm.stderr
            r = requests.post(srv.base + "/v1/config/reload", timeout=300)
            assert r.status_code == 201 and REPO not in r.json(), r.text
            assert served() == ["base"]
