"""Tenants kept apart on real servers: each API key's prefix-cache namespace is the key's own (a key-file edit and a
restart with the disk tier move nobody's cached prompts to another key); a client key cannot unload or pin a model
(Ollama's keep_alive is the operator's); no spelling of a route or of the Authorization scheme gets around
--client-max-generations, which counts every route that makes the engine work; a keep_alive no date can show never
breaks /api/ps; a keyless loopback server answers loopback Host names only (DNS rebinding).

The keyed server is started twice on one --kv-disk-dir: first with the key file [A, B], then [B, A] (the line
numbers swapped, as the documented rotation renumbers keys)."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from tests.helpers import Server, wait_until

CAP = 2  # --client-max-generations of the keyed server
KEY_A, KEY_B, ADMIN = "tenant-a-" + "a" * 24, "tenant-b-" + "b" * 24, "operator-" + "c" * 24
# ~200 tokens: several full 32-token blocks, so a hit shows as cached_tokens >= 128
MEMO = "CONFIDENTIAL MEMO for the board. " + " ".join(
    f"Item {i}: the quarterly figure for region {i % 7} is {i * 113} units, down {i % 5} percent." for i in range(14)
)
RECORD = "Patient record, ward 4. " + " ".join(
    f"Visit {i}: blood pressure {110 + i} over {70 + i % 9}, dose {i * 5} mg, next check in {i % 4 + 1} weeks."
    for i in range(14)
)


def headers(key: str | None, **extra: str) -> dict:
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **extra}


def cached_tokens(srv: Server, key: str, model: str, prompt: str) -> int:
    r = requests.post(
        srv.base + "/v3/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers=headers(key),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def keyed(model_dir, model_name, tmp_path_factory):
    """The key file [B, A] on the disk dir a first run with [A, B] left A's MEMO and B's RECORD in (their
    cached_tokens as `first_run`: A's MEMO cold, A's MEMO again, B's RECORD)."""
    folder = tmp_path_factory.mktemp("tenants")
    keys, admin = folder / "keys", folder / "admin-keys"
    admin.write_text(ADMIN + "\n")
    flags = ["--workers", "1", "--api-key-file", str(keys), "--admin-key-file", str(admin)]
    flags += ["--kv-disk-dir", str(folder / "kv"), "--client-max-generations", str(CAP)]
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with Server(model_dir, folder / "first.log", *flags) as first:
        first_run = [cached_tokens(first, k, model_name, t) for k, t in ((KEY_A, MEMO), (KEY_A, MEMO), (KEY_B, RECORD))]
    keys.write_text(f"# rotated\n{KEY_B}\n{KEY_A}\n")
    with Server(model_dir, folder / "second.log", *flags) as srv:
        srv.first_run = first_run  # type: ignore[attr-defined]
        yield srv


def test_a_key_file_reorder_and_restart_moves_no_cached_prompt_to_another_key(keyed, model_name):
    cold, warm, other = keyed.first_run
    assert cold == 0 and warm >= 128 and other == 0, keyed.first_run
    assert cached_tokens(keyed, KEY_B, model_name, MEMO) == 0  # B now holds A's old line: nothing of A's
    assert cached_tokens(keyed, KEY_A, model_name, RECORD) == 0  # nor A of B's
    assert cached_tokens(keyed, KEY_A, model_name, MEMO) >= 128  # each keeps its own across the restart (disk)
    assert cached_tokens(keyed, KEY_B, model_name, RECORD) >= 128


def ollama(srv: Server, key: str, body: dict) -> requests.Response:
    return requests.post(srv.base + "/api/generate", json={"stream": False, **body}, headers=headers(key), timeout=300)


def ps(srv: Server, key: str) -> requests.Response:
    return requests.get(srv.base + "/api/ps", headers=headers(key), timeout=30)


def test_a_client_key_cannot_unload_or_pin_a_model_and_the_admin_key_can(keyed, model_name):
    """B's explicit unload is refused (403) and the model stays loaded; B's keep_alive on a generation (0, a
    duration, 1e300, -1) leaves the operator's forever in place; the admin key's keep_alive applies."""
    generate = {"model": model_name, "prompt": "Hi", "options": {"num_predict": 2}}
    assert ollama(keyed, KEY_A, generate).status_code == 200  # loaded
    r = ollama(keyed, KEY_B, {"model": model_name, "keep_alive": 0})
    assert r.status_code == 403 and "admin key" in r.json()["error"], r.text
    for keep_alive in (0, "3m", 1e300, -1):
        r = ollama(keyed, KEY_B, {**generate, "keep_alive": keep_alive})
        assert r.status_code == 200, r.text
        models = ps(keyed, KEY_A).json()["models"]
        assert [m["expires_at"] for m in models] == ["9999-12-31T23:59:59Z"], (keep_alive, models)

    assert ollama(keyed, ADMIN, {**generate, "keep_alive": "5m"}).status_code == 200
    assert ps(keyed, KEY_A).json()["models"][0]["expires_at"] != "9999-12-31T23:59:59Z"  # the operator's word
    assert ollama(keyed, ADMIN, {**generate, "keep_alive": -1}).status_code == 200  # the next tests: kept loaded


def test_no_keep_alive_breaks_api_ps_and_the_admin_key_unloads(keyed, model_name):
    """The admin key's keep_alive applies, 1e300 and its kin included: /api/ps still answers (forever), for every
    key; NaN is a 400; its keep_alive 0 on an empty request unloads the model."""
    generate = {"model": model_name, "prompt": "Hi", "options": {"num_predict": 2}}
    for huge in (1e300, "1e300", 10**400, "9999999999999h"):
        assert ollama(keyed, ADMIN, {**generate, "keep_alive": huge}).status_code == 200
        r = ps(keyed, KEY_B)
        assert r.status_code == 200 and r.json()["models"][0]["expires_at"].startswith("9999"), (huge, r.text)
    r = ollama(keyed, ADMIN, {**generate, "keep_alive": "nan"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text
    r = ollama(keyed, ADMIN, {"model": model_name, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    wait_until(lambda: not ps(keyed, KEY_A).json()["models"], "the admin's unload")
    ollama(keyed, ADMIN, {**generate, "keep_alive": -1})  # the next tests' model loaded again, kept


def raw_post(srv: Server, source: str, path: str, authorization: str, body: bytes) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", srv.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: {authorization}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    s.settimeout(120)
    return s


def status_line(s: socket.socket) -> bytes:
    with s.makefile("rb") as reader:
        return reader.readline().rstrip(b"\r\n")


def test_no_spelling_of_a_route_or_the_scheme_gets_past_the_generation_cap(keyed, model_name):
    """--client-max-generations 2 with two streams of A's open: every other spelling of a generation route, any
    case of the scheme, and the other engine routes (embeddings, rerank, tokenize, count_tokens, Ollama's embed)
    are 429 for A from other addresses; B is served."""
    stream = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    held = [
        raw_post(keyed, f"127.0.9.{i + 1}", "/v3/completions", f"Bearer {KEY_A}", json.dumps(stream).encode())
        for i in range(CAP)
    ]
    try:
        assert [status_line(s) for s in held] == [b"HTTP/1.1 200 OK"] * CAP
        chat = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        attempts = [(p, f"Bearer {KEY_A}") for p in ("/v3/chat/completion%73", "/v3/chat%2Fcompletions", "/api/ch%61t")]
        attempts += [("/v3/chat/completions", f"{scheme} {KEY_A}") for scheme in ("bearer", "BEARER", "Bearer ")]
        attempts += [(p, f"Bearer {KEY_A}") for p in ("/v3/response%73", "/v3/embeddings", "/v3/rerank")]
        attempts += [(p, f"Bearer {KEY_A}") for p in ("/v3/tokenize", "/v1/messages/count_tokens", "/api/embed")]
        for i, (path, authorization) in enumerate(attempts):
            s = raw_post(keyed, f"127.0.8.{i + 2}", path, authorization, chat.encode())
            with s:
                assert status_line(s) == b"HTTP/1.1 429 Too Many Requests", (path, authorization)
        tokenize = json.dumps({"model": model_name, "prompt": "Hi"}).encode()
        with raw_post(keyed, "127.0.8.99", "/v3/tokenize", f"bearer {KEY_B}", tokenize) as s:
            assert status_line(s) == b"HTTP/1.1 200 OK"  # another key, any case of its scheme: served
    finally:
        for s in held:
            s.close()

    def a_served() -> bool:  # the server sees a closed stream when it next writes to it: the cap frees then
        r = requests.post(
            keyed.base + "/v3/tokenize", json={"model": model_name, "prompt": "Hi"}, headers=headers(KEY_A), timeout=30
        )
        return r.status_code == 200

    wait_until(a_served, "A's two closed streams no longer counted against its cap")  # the next tests use A


def test_a_keyless_loopback_server_answers_loopback_host_names_only(server, model_name):
    """DNS rebinding: a page on attacker.example resolving to 127.0.0.1 sends its own name in Host; without keys
    nothing else would stop it chatting or unloading. The probes stay open to any Host."""
    port = server.port
    for host in ("attacker.example", f"attacker.example:{port}", "localhost:1", f"127.0.0.2:{port}"):
        r = requests.get(server.base + "/v3/models", headers={"Host": host}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        r = requests.post(
            server.base + "/api/generate", json={"model": model_name, "keep_alive": 0}, headers={"Host": host}
        )
        assert r.status_code == 400, (host, r.text)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
        assert requests.get(server.base + "/v3/models", headers={"Host": host}, timeout=30).status_code == 200, host
    assert requests.get(server.base + "/v2/health/ready", headers={"Host": "attacker.example"}).status_code == 200


def test_a_keyed_server_still_answers_any_host_name(keyed):
    """Keys stop a rebinding page (it has none): a keyed loopback server behind a proxy keeps answering the names
    the proxy passes on, as before."""
    r = requests.get(keyed.base + "/v3/models", headers=headers(KEY_A, Host="box.example"), timeout=30)
    assert r.status_code == 200, r.text
