"""Safe exposure (appliance/auth.py, the EdgeWorker's TLS path): API keys, the refusal of an open bind,
the Host allow-list, TLS. Two real servers on the tiny llama export: one guarded (several keys, allowed hosts,
TLS with a self-signed certificate made here, threads and request timeout small so a held thread would show) and
one open on 0.0.0.0 with --allow-unauthenticated; the refusal is a plain `appliance serve` that must exit."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import requests

from appliance import auth
from appliance.settings import ConfigError, ServeSettings
from appliance.testing.loopback import ROOT
from tests.helpers import Server, self_signed_cert

KEYS = ["first-" + "a" * 24, "second-" + "b" * 24]
NAME = "appliance.test"
REQUEST_TIMEOUT = 2  # the guarded server's: stalled TLS handshakes are closed after this


def make_cert(folder: Path) -> tuple[Path, Path]:
    return self_signed_cert(folder / "cert.pem", folder / "key.pem", NAME, f"DNS:{NAME},IP:127.0.0.1")


class TlsServer(Server):
    """The conftest Server over https: readiness and the tests verify against the self-signed certificate."""

    def __init__(self, model_dir: Path, log_path: Path, cert: Path, *args: str):
        super().__init__(model_dir, log_path, *args)
        self.base = f"https://127.0.0.1:{self.port}"
        self.cert = cert

    def wait_ready(self) -> None:
        os.environ["REQUESTS_CA_BUNDLE"] = str(self.cert)  # LoopbackServer's readiness poll uses requests
        try:
            super().wait_ready()
        finally:
            del os.environ["REQUESTS_CA_BUNDLE"]


@pytest.fixture(scope="module")
def tiny_export(exported) -> Path:
    return exported("llama", "openvino", "fp32")[0]


@pytest.fixture(scope="module")
def guarded(tiny_export, tmp_path_factory):
    folder = tmp_path_factory.mktemp("exposure")
    cert, key = make_cert(folder)
    keys = folder / "keys"
    keys.write_text(f"# clients of the lab\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    args = ["--api-key-file", str(keys), "--tls-certfile", str(cert), "--tls-keyfile", str(key)]
    args += ["--allowed-hosts", f"{NAME},.example.org", "--threads", "2", "--request-timeout", str(REQUEST_TIMEOUT)]
    with TlsServer(tiny_export, folder / "serve.log", cert, *args) as srv:
        yield srv


def get(srv: TlsServer, path: str, key: str | None = KEYS[0], **headers: str) -> requests.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return requests.get(srv.base + path, headers=headers, verify=srv.cert, timeout=30)


def keyed_client(srv: TlsServer, key: str) -> openai.OpenAI:
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=str(srv.cert)), timeout=60)
    return openai.OpenAI(base_url=srv.base + "/v3", api_key=key, max_retries=0, http_client=http_client)


def test_every_key_works_and_nothing_else(guarded):
    for key in KEYS:
        assert get(guarded, "/v3/models", key).status_code == 200
    for wrong in (None, "wrong", KEYS[0][:-1], KEYS[0] + "x", KEYS[1][:8]):  # prefixes and extensions of a key too
        r = get(guarded, "/v3/models", wrong)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (wrong, r.text)
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="appliance"'  # RFC 9110: a 401 names its scheme
    r = requests.get(guarded.base + "/v3/models", headers={"Authorization": f"Basic {KEYS[0]}"}, verify=guarded.cert)
    assert r.status_code == 401


def test_host_allow_list(guarded):
    r = get(guarded, "/v3/models", Host="evil.example")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert get(guarded, "/v3/models", Host="evil.example", key="wrong").status_code == 400  # before the key
    for host in (NAME, f"{NAME.upper()}:{guarded.port}", "example.org", "api.example.org", "127.0.0.1"):
        assert get(guarded, "/v3/models", Host=host).status_code == 200, host
    assert get(guarded, "/v2/health/ready", key=None, Host="10.1.2.3:8000").status_code == 200  # kubelet's probe


def test_openai_client_over_tls(guarded):
    models = keyed_client(guarded, KEYS[1]).models.list()
    reply = keyed_client(guarded, KEYS[1]).completions.create(model=models.data[0].id, prompt="Hello", max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    stream = keyed_client(guarded, KEYS[0]).chat.completions.create(
        model=models.data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["length"]


def test_plain_http_on_the_tls_port_is_told_and_the_server_goes_on(guarded):
    r = requests.get(f"http://127.0.0.1:{guarded.port}/v2/health/ready", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "https_required"
    assert get(guarded, "/v2/health/ready", key=None).status_code == 200


def test_stalled_tls_handshakes_hold_no_thread_and_are_closed(guarded):
    """More half-handshakes than the worker has threads (2): a completion still runs at once, and the server closes
    them after --request-timeout. gunicorn's own TLS path would block both threads in do_handshake forever."""
    stalled = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", guarded.port))
        s.sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, then nothing
        stalled.append(s)
    try:
        started = time.monotonic()
        client = keyed_client(guarded, KEYS[0])
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text is not None
        for s in stalled:
            s.settimeout(REQUEST_TIMEOUT + 10)
            try:
                assert s.recv(1024) == b""  # closed by the server (FIN)
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < REQUEST_TIMEOUT + 8
    finally:
        for s in stalled:
            s.close()


def serve_command(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model), *args]


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    return {**env, "PYTHONPATH": str(ROOT)}


def test_open_bind_without_a_key_is_refused_before_loading(tiny_export):
    started = time.monotonic()
    done = subprocess.run(
        serve_command(tiny_export, "--host", "0.0.0.0", "--port", "1"),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78  # EX_CONFIG: systemd does not restart it (RestartPreventExitStatus=78)
    assert "--api-key-file" in done.stderr and "--allow-unauthenticated" in done.stderr, done.stderr
    assert "loading model" not in done.stderr + done.stdout
    assert time.monotonic() - started < 30


@pytest.fixture
def open_folder():
    """A directory every user may enter (/tmp/xxx, 0755): pytest's own tmp_path sits in a 0700 directory, which
    keeps whatever is inside it private to its owner."""
    folder = Path(tempfile.mkdtemp(prefix="appliance-test-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def config_errors(folder: Path, model: Path, open_folder: Path) -> dict[str, tuple[list[str], str]]:
    """Settings `serve` cannot run with: the args after `serve`, and words of its one line."""
    empty, spaced, config, broken = (folder / name for name in ("empty", "spaced", "config.json", "broken.json"))
    shared = open_folder / "api-keys"
    shared.write_text("a-key-every-user-can-read\n")
    shared.chmod(0o644)
    empty.write_text("# no key yet\n")
    spaced.write_text("a key with spaces\n")
    config.write_text(json.dumps({"model_config_list": [{"config": {"name": "m", "base_path": str(model)}}]}))
    broken.write_text('{"workers": 2,')
    return {
        "unreadable key file": (["--api-key-file", str(folder / "missing")], "cannot read the API key file"),
        "empty key file": (["--api-key-file", str(empty)], "holds no key"),
        "malformed key": (["--api-key-file", str(spaced)], "is not printable ASCII without spaces"),
        "world-readable key file": (["--api-key-file", str(shared)], "readable by every user (mode 0644)"),
        "--model with a model list": (["--model", str(model), "--config", str(config)], "cannot go with"),
        "config file not JSON": (["--config", str(broken)], "not JSON"),
        "config file missing": (["--config", str(folder / "none.json")], "no such config file"),
        "bad engine setting": (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    }


def test_a_configuration_error_is_one_line_and_exit_78(tiny_export, tmp_path, open_folder):
    """The real CLI, as systemd runs it: each mistake is one `appliance: ...` line on stderr and EX_CONFIG (78), the
    status the unit's RestartPreventExitStatus= names, so a box with a bad setting ends `failed`, not in a restart
    loop; nothing starts (no gunicorn, no model load)."""
    for what, (args, words) in config_errors(tmp_path, tiny_export, open_folder).items():
        model = [] if "--model" in args or "--config" in args else ["--model", str(tiny_export)]
        done = subprocess.run(
            [sys.executable, "-m", "appliance.cli", "serve", *model, "--port", "1", *args],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 78, (what, done.returncode, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("appliance: ") and words in lines[0], (what, done.stderr)
        assert done.stdout == ""


def test_open_bind_with_the_flag_serves_and_warns(tiny_export, tmp_path):
    with Server(tiny_export, tmp_path / "serve.log", "--host", "0.0.0.0", "--allow-unauthenticated") as srv:
        assert requests.get(srv.base + "/v3/models", timeout=30).status_code == 200
        warnings = [line for line in srv.output().splitlines() if '"level": "warning"' in line]
        assert any("without an API key" in line and '"host": "0.0.0.0"' in line for line in warnings), srv.output()


# ---------------------------------------------------------------- auth.py alone


def test_host_part_and_patterns():
    assert auth.host_part("Example.COM.:8000") == "example.com"
    assert auth.host_part("[::1]:8000") == auth.host_part("[::1]") == "::1"
    assert auth.host_allowed("[2001:db8::1]:80", "[2001:db8::1]")
    assert auth.host_allowed("a.b.example.org", ".example.org") and auth.host_allowed("example.org", ".example.org")
    assert not auth.host_allowed("badexample.org", ".example.org")
    assert not auth.host_allowed(None, "x") and auth.host_allowed("anything", "*") and auth.host_allowed("x", None)
    assert auth.host_allowed("localhost:8000", "x")  # loopback names: a rebinding page cannot send them
    assert auth.host_and_port("[::1]:8000") == ("::1", "8000") and auth.host_and_port("Box.LAN.:80") == (
        "box.lan",
        "80",
    )
    assert auth.host_and_port("::1") == ("::1", "") and auth.host_and_port("[::1") == ("[::1", "")


def test_a_keyless_loopback_server_checks_host_without_allowed_hosts():
    """No --allowed-hosts: a keyless loopback server answers loopback names with no port or its own; a keyed
    server or one bound beyond loopback answers any name; --allowed-hosts, when given, decides."""
    local = settings(host="127.0.0.1", port=8000)
    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "[::1]", "LocalHost."):
        assert auth.host_checked(host, local), host
    for host in ("attacker.example", "attacker.example:8000", "localhost:8001", "127.0.0.2:8000", "", None):
        assert not auth.host_checked(host, local), host
    assert auth.host_checked("box.example", settings(host="127.0.0.1", port=8000, api_key_file="keys"))
    assert auth.host_checked("box.example", settings(host="0.0.0.0", port=8000, allow_unauthenticated=True))
    listed = settings(host="127.0.0.1", port=8000, allowed_hosts="box.example")
    assert auth.host_checked("box.example:1", listed) and auth.host_checked("localhost:9", listed)
    assert not auth.host_checked("attacker.example", listed)


def test_one_token_digest_for_key_checks_the_tenant_and_the_response_store_owner(monkeypatch):
    """`token_digest` is the one hashing of a presented key: the key checks use it (a patched digest changes what
    `accepts` and `tenant_id` say), the tenant id is its hex whatever the key's line in the file or the spelling
    of the scheme, and the Responses store's owner is its hex (an x-api-key header the same key)."""
    import hashlib

    import flask

    from appliance.openai_api.responses_routes import ResponsesApi

    keys = auth.ApiKeys(["k0", "k1"])
    assert auth.token_digest("Bearer  k1 ") == hashlib.sha256(b"k1").digest() == auth.token_digest("bearer k1")
    assert keys.accepts("Bearer k1") and not keys.accepts("Basic k1")
    assert auth.tenant_id("Bearer k1") == hashlib.sha256(b"k1").hexdigest() == auth.tenant_id("BEARER  k1 ")
    assert auth.tenant_id("Bearer k1") != auth.tenant_id("Bearer k0")  # apart, whatever order the file lists them
    real = auth.token_digest
    monkeypatch.setattr(auth, "token_digest", lambda header: real(header.replace("k9", "k0")))
    assert keys.accepts("Bearer k9") and auth.tenant_id("Bearer k9") == real("Bearer k0").hex()  # both use it
    monkeypatch.setattr(auth, "token_digest", real)

    class Api:
        settings = settings(api_key_file="keys")

    responses = ResponsesApi.__new__(ResponsesApi)
    responses.api = Api()  # type: ignore[assignment]
    with flask.Flask(__name__).test_request_context(headers={"Authorization": "Bearer k1"}):
        by_bearer = responses.owner()
    with flask.Flask(__name__).test_request_context(headers={"x-api-key": "k1"}):
        by_x_api_key = responses.owner()
    assert by_bearer == by_x_api_key == real("Bearer k1").hex()
    Api.settings = settings()
    with flask.Flask(__name__).test_request_context(headers={"Authorization": "Bearer k1"}):
        assert responses.owner() == ""  # a server without keys: one owner


def settings(**fields) -> ServeSettings:
    return ServeSettings(model_dir="m", served_model_name="m", model_created=0, **fields)


def test_start_up_checks(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost", "127.1.2.3"):
        assert auth.exposure_problem(host, False, False) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "box.lan", ""):
        assert auth.exposure_problem(host, False, False) is not None
        assert auth.exposure_problem(host, True, False) is None and auth.exposure_problem(host, False, True) is None
    empty, spaced = tmp_path / "empty", tmp_path / "spaced"
    empty.write_text("# only a comment\n\n")
    spaced.write_text("good-key\nbad key\n")
    for path, words in ((empty, "holds no key"), (spaced, "key 2"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ConfigError, match=words):
            auth.check_exposure(settings(api_key_file=str(path)))
    cert, key = make_cert(tmp_path)
    with pytest.raises(ConfigError, match="go together"):
        auth.check_exposure(settings(tls_certfile=str(cert)))
    with pytest.raises(ConfigError, match="do not load"):
        auth.check_exposure(settings(tls_certfile=str(cert), tls_keyfile=str(cert)))
    auth.check_exposure(settings(tls_certfile=str(cert), tls_keyfile=str(key)))
    assert auth.base_url(settings(host="::1", port=1, tls_certfile="c")) == "https://[::1]:1"


def test_secret_files_every_user_may_read_are_refused(open_folder, tmp_path):
    """The key files and the TLS key: refused when others may read or write them and reach them; the installer's
    root:appliance 0640 (group read) and 0600 pass, and so does any mode inside a directory others cannot enter."""
    cert, key = make_cert(open_folder)
    keys = open_folder / "api-keys"
    keys.write_text("k" * 32 + "\n")
    for mode, words in ((0o644, "readable by every user (mode 0644)"), (0o602, "writable by every user")):
        keys.chmod(mode)
        for field in ("api_key_file", "admin_key_file"):
            with pytest.raises(ConfigError, match=re.escape(words)) as info:
                auth.check_exposure(settings(**{field: str(keys)}))
            assert f"chmod o-rwx {keys}" in str(info.value) and "\n" not in str(info.value)
    for mode in (0o640, 0o600, 0o440):
        keys.chmod(mode)
        auth.check_exposure(settings(api_key_file=str(keys), admin_key_file=str(keys)))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="the TLS key file .* is readable by every user"):
        auth.check_exposure(settings(tls_certfile=str(cert), tls_keyfile=str(key)))
    key.chmod(0o640)
    auth.check_exposure(settings(tls_certfile=str(cert), tls_keyfile=str(key)))
    private = tmp_path / "api-keys"  # pytest's 0700 directory: no other user gets to the file
    private.write_text("k" * 32 + "\n")
    private.chmod(0o644)
    auth.check_exposure(settings(api_key_file=str(private)))


def test_a_tls_client_that_leaves_a_unary_request_frees_its_sequences(guarded):
    """The disconnect check peeks at the raw socket under TLS too (an SSLSocket refuses MSG_PEEK): a client gone
    from a non-streaming request cancels its generation instead of leaving it to run to max_tokens."""
    from appliance.testing.loopback import parse_metrics

    def metrics() -> dict[str, float]:
        return parse_metrics(get(guarded, "/metrics").text)

    def started(m: dict[str, float]) -> bool:  # all 128 admitted, some of them running
        running = m["appliance_running_sequences"]
        return running > 0 and running + m["appliance_queue_depth"] == 128

    model = get(guarded, "/v3/models").json()["data"][0]["id"]
    before = metrics()
    cancelled = before.get("appliance_sequences_cancelled_total", 0)
    ran_out = before.get('appliance_sequences_finished_total{reason="length"}', 0)
    # 16 prompts x n 8 = 128 sequences of 480 tokens: the tiny model on a fast box (Zen 5) finished 8 before the
    # worker's next look at the socket (every 0.5 s); 128 make every step several times longer.
    prompts = ", ".join(['"Hello"'] * 16)
    body = f'{{"model": "{model}", "prompt": [{prompts}], "max_tokens": 480, "ignore_eos": true, "n": 8}}'.encode()
    head = (
        f"POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    context = ssl.create_default_context(cafile=str(guarded.cert))
    with socket.create_connection(("127.0.0.1", guarded.port)) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(head + body)
            deadline = time.monotonic() + 30
            while not started(m := metrics()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert started(m), m
    # The worker looks every CLIENT_CHECK_SECONDS (0.5 s); the cancellations were counted 0.43 s after the close
    # with a full `make test-fast` and eight other agents loading the box. 30 s is 60x that; a client left unnoticed
    # fails at any load: its sequences end as "length", never as cancelled.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics()
        done = m["appliance_running_sequences"] == 0 and m["appliance_queue_depth"] == 0
        if done and m.get("appliance_sequences_cancelled_total", 0) >= cancelled + 128:
            break
        time.sleep(0.05)
    assert m.get("appliance_sequences_cancelled_total", 0) == cancelled + 128, m
    assert m.get('appliance_sequences_finished_total{reason="length"}', 0) == ran_out, m
