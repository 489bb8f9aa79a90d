"""How the edge reads a request in the worker's event loop (appliance/http/edge.py), with byte strings and a fake
clock: when a request is complete, what is answered in the loop, the byte budgets and whom they shed, deadlines,
lingering closes. The same rules on a real server: test_edge.py, test_edge_limits.py, test_hostile.py."""

from __future__ import annotations

import pytest

from appliance.http import edge
from appliance.http.edge_policy import PeerCounts

MAX_BODY = 100
BUDGET = 1000  # a client's share: max(1000 // 4, 2 * MAX_BODY) = 250
MODELS = "/v3/models"  # no engine work: not counted against the cap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def intake(clock):
    return edge.Intake(10.0, MAX_BODY, PeerCounts(1), budget=BUDGET, clock=clock)


def post(body: bytes, path: str = "/v3/completions", extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)


def test_a_request_is_ready_once_its_body_is_complete_and_its_bytes_then_leave_the_counts(intake):
    intake.start("c", "10.0.0.1")
    request = post(b'{"prompt": "hi"}')
    for i in range(0, len(request) - 1, 7):
        assert intake.received("c", request[i : min(i + 7, len(request) - 1)]) == []
        assert intake.advance("c") is edge.Step.MORE
    assert intake.buffered == len(request) - 1 and intake.held["10.0.0.1"] == len(request) - 1
    intake.received("c", request[-1:])
    assert intake.advance("c") is edge.Step.READY
    done = intake.stop("c")
    assert done is not None and bytes(done.buf) == request and done.head is not None
    assert done.head.path == "/v3/completions" and done.generation == (("address", "10.0.0.1"), None)
    assert intake.buffered == 0 and not intake.held and intake.stop("c") is None


def test_pipelined_bytes_count_and_may_be_complete_already(intake):
    request = intake.start("c", "p", pipelined=b"GET /v2/health/ready HTTP/1.1\r\n\r\nGET /next")
    assert intake.buffered == len(request.buf)
    assert intake.advance("c") is edge.Step.READY
    assert request.head is not None and edge.is_probe(request.head.path) and request.generation is None


def test_chunked_bodies_are_read_to_their_end_or_handed_over_past_the_limit(intake):
    head = b"POST /v3/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    intake.start("c", "p")
    intake.received("c", head + b"4\r\nabcd\r\n")
    assert intake.advance("c") is edge.Step.MORE
    intake.received("c", b"0\r\n\r\n")
    assert intake.advance("c") is edge.Step.READY
    intake.start("big", "q")  # more than MAX_BODY framed: the parser answers it (413), no need to hold more
    intake.received("big", head + b"40\r\n" + b"x" * 64 + b"\r\n40\r\n" + b"x" * 40)
    assert intake.advance("big") is edge.Step.READY


def test_a_head_past_the_limit_is_refused_and_an_oversized_body_is_handed_over_at_its_head():
    intake = edge.Intake(10.0, MAX_BODY, PeerCounts(0), budget=10 * edge.HEAD_LIMIT)
    intake.start("c", "p")
    intake.received("c", b"GET / HTTP/1.1\r\nX: " + b"y" * edge.HEAD_LIMIT)
    assert intake.advance("c") is edge.Step.HEAD_TOO_LARGE
    intake.start("d", "p")
    intake.received("d", b"POST /v3/completions HTTP/1.1\r\nContent-Length: 101\r\n\r\n")
    assert intake.advance("d") is edge.Step.READY


def test_expect_100_continue_is_answered_here_and_its_line_removed(intake):
    intake.start("c", "p")
    intake.received("c", post(b"", MODELS, b"Expect: 100-continue\r\n").replace(b"Length: 0", b"Length: 5"))
    held = intake.buffered
    assert intake.advance("c") is edge.Step.CONTINUE
    assert intake.buffered == held - len(b"Expect: 100-continue\r\n")  # gunicorn must not send a second 100
    assert intake.advance("c") is edge.Step.MORE
    intake.received("c", b"hello")
    assert intake.advance("c") is edge.Step.READY
    request = intake.stop("c")
    assert request is not None and b"Expect" not in request.buf and request.buf.endswith(b"\r\n\r\nhello")
    intake.start("sent", "p")  # the body came with the head: no 100 to send
    intake.received("sent", post(b"hello", MODELS, b"Expect: 100-continue\r\n"))
    assert intake.advance("sent") is edge.Step.READY


def test_generations_past_the_cap_of_an_address_or_key_are_refused_and_probes_never_count(intake):
    for key in ("a", "b"):
        intake.start(key, "10.0.0.1")
        intake.received(key, post(b"{}", extra=b"Authorization: Bearer k%s\r\n" % key.encode()))
    assert intake.advance("a") is edge.Step.READY
    assert intake.advance("b") is edge.Step.GENERATION_CAP  # same address, cap 1
    intake.start("probe", "10.0.0.1")
    intake.received("probe", b"GET /v2/models/m/ready HTTP/1.1\r\n\r\n")
    assert intake.advance("probe") is edge.Step.READY
    done = intake.stop("a")
    assert done is not None and done.generation is not None
    intake.generations.release(*done.generation)
    assert intake.advance("b") is edge.Step.READY


def test_a_full_budget_sheds_the_largest_unfinished_requests_never_a_small_newcomer(intake):
    sizes = {}
    for i, peer in enumerate(("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")):
        key = f"big{i}"
        intake.start(key, peer)
        sizes[key] = 240 if i < 2 else 200  # each under its address's share (250)
        assert intake.received(key, b"x" * sizes[key]) == []
    assert intake.buffered == 880
    intake.start("probe", "10.0.0.9")
    shed = intake.received("probe", b"GET /v2/health/live HTTP/1.1\r\n" + b"h" * 100 + b"\r\n\r\n")
    assert shed == [("big0", "budget_shed", 240, "openai")]  # the largest, the oldest among equals
    assert intake.advance("probe") is edge.Step.READY
    assert intake.buffered == 880 - 240 + len(intake.requests["probe"].buf)
    assert "big0" not in intake.requests


def test_a_request_that_is_itself_the_largest_is_the_one_shed(intake):
    intake.start("small", "10.0.0.1")
    intake.received("small", b"x" * 10)
    intake.start("grows", "10.0.0.1")
    intake.received("grows", b"x" * 200)
    shed = intake.received("grows", b"x" * 100)  # 310 of the address's 250
    assert shed == [("grows", "client_bytes", 300, "openai")]
    assert intake.buffered == 10 and intake.held["10.0.0.1"] == 10 and list(intake.requests) == ["small"]


def test_one_address_is_shed_within_its_own_share_before_others_are_touched(intake):
    intake.start("other", "10.0.0.2")
    intake.received("other", b"x" * 240)
    intake.start("mine-old", "10.0.0.1")
    intake.received("mine-old", b"x" * 150)
    intake.start("mine-new", "10.0.0.1")
    shed = intake.received("mine-new", b"x" * 120)  # 270 of the address's 250: its own largest goes
    assert shed == [("mine-old", "client_bytes", 150, "openai")]
    assert set(intake.requests) == {"other", "mine-new"}


def test_requests_past_their_deadline_expire_and_a_stopping_worker_gives_idle_ones_no_time(intake, clock):
    intake.start("idle", "p")
    intake.start("started", "p")
    intake.received("started", b"POST / HTTP/1.1\r\n")
    clock.now += 5
    intake.start("late", "p")
    intake.received("late", b"GET")
    assert intake.expired(stopping=False, linger=2.0) == []
    clock.now += 5.0
    assert [key for key, _ in intake.expired(stopping=False, linger=2.0)] == ["idle", "started"]
    assert set(intake.requests) == {"late"} and intake.buffered == 3
    intake.start("idle2", "p")
    assert [key for key, _ in intake.expired(stopping=True, linger=2.0)] == ["idle2"]  # no byte: closed now
    clock.now += 2.0
    assert [key for key, _ in intake.expired(stopping=True, linger=2.0)] == ["late"]  # under way: 2 s at most


def test_one_deadline_covers_the_tls_handshake_and_the_request_after_it(intake, clock):
    handshake = intake.start("c", "p")
    clock.now += 8
    intake.stop("c")
    intake.start("c", "p", deadline=handshake.deadline)
    clock.now += 2
    assert [key for key, _ in intake.expired(stopping=False, linger=2.0)] == ["c"]


def test_the_oldest_request_is_the_first_in(intake):
    assert intake.oldest() is None
    intake.start("a", "p")
    intake.start("b", "p")
    oldest = intake.oldest()
    assert oldest is not None and oldest[0] == "a"


def test_read_budget_is_a_few_bodies_at_least_64_mib():
    assert edge.read_budget(4 << 20) == 64 << 20
    assert edge.read_budget(100 << 20) == 200 << 20


def test_probe_and_generation_paths():
    assert edge.is_probe("/v2/health/live") and edge.is_probe("/metrics") and edge.is_probe("/v2/models/x/ready")
    assert not edge.is_probe("/v2/models/x") and not edge.is_probe("/v3/chat/completions")
    head = edge.parse_head(b"POST /v3/chat/completions?x HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n", 10)
    assert head is not None and edge.is_engine_work(head) and head.key and head.path == "/v3/chat/completions"
    head = edge.parse_head(b"GET /v3/chat/completions HTTP/1.1\r\n\r\n", 10)
    assert head is not None and not edge.is_engine_work(head) and head.key == b""


# request targets a client may send, each with the path Flask routes it to
TARGETS = {
    "/v3/chat/completion%73": "/v3/chat/completions",
    "/v3/chat%2Fcompletions": "/v3/chat/completions",
    "/v3/chat%2fcompletions?stream=1#x": "/v3/chat/completions",
    "/v3/response%73": "/v3/responses",
    "/api/ch%61t": "/api/chat",
    "/%76%33/embeddings": "/v3/embeddings",
    "http://attacker.example/v3/completions?x": "/v3/completions",
    "//v3/completions": "//v3/completions",
    "/v1/messages/count%5Ftokens": "/v1/messages/count_tokens",
    "/v3/caf%C3%A9": "/v3/caf\xc3\xa9",
}


@pytest.mark.parametrize("target", TARGETS)
def test_the_edge_sees_the_path_gunicorn_hands_to_flask(target):
    """The edge classifies the path routing sees: for every spelling, edge.canonical_path is what gunicorn puts in
    PATH_INFO (its own split_request_uri and unquote_to_wsgi_str, as gunicorn/http/wsgi.py applies them)."""
    from gunicorn import util

    assert edge.canonical_path(target) == util.unquote_to_wsgi_str(util.split_request_uri(target).path)
    assert edge.canonical_path(target) == TARGETS[target]


def test_encoded_paths_and_any_spelling_of_the_scheme_count_as_the_route_and_the_key(clock):
    """A percent-encoded route is counted as the route (the cap is per address and per key), and `bearer`,
    `BEARER` or extra spaces are the same key as `Bearer KEY` (the key checks read them alike)."""
    intake = edge.Intake(10.0, MAX_BODY, PeerCounts(1), budget=BUDGET, clock=clock)
    intake.start("held", "10.0.0.1")
    intake.received("held", post(b"{}", "/v3/chat/completions", b"Authorization: Bearer KEY\r\n"))
    assert intake.advance("held") is edge.Step.READY
    for path in (t for t, routed in TARGETS.items() if routed.endswith(edge.ENGINE_WORK_SUFFIXES)):
        intake.start(path, "10.0.0.1")  # the same address, no key
        intake.received(path, post(b"{}", path))
        assert intake.advance(path) is edge.Step.GENERATION_CAP, path
        intake.stop(path)
    for i, spelling in enumerate((b"bearer KEY", b"BEARER KEY", b"Bearer   KEY ", b"bEaReR KEY")):
        intake.start(spelling, f"10.0.1.{i}")  # another address, the same key
        intake.received(spelling, post(b"{}", "/v3/completions", b"Authorization: " + spelling + b"\r\n"))
        assert intake.advance(spelling) is edge.Step.GENERATION_CAP, spelling
        intake.stop(spelling)
    intake.start("x-api-key", "10.0.2.1")
    intake.received("x-api-key", post(b"{}", "/v1/messages", b"x-api-key: KEY\r\n"))
    assert intake.advance("x-api-key") is edge.Step.GENERATION_CAP


def test_every_post_route_that_makes_the_engine_work_is_counted_and_no_other():
    """The app's own routes against the edge's list: every POST route that reaches the engine's models (a
    generation, an encoder pass, a tokenization) is counted, at every prefix; the admin routes and Ollama's
    /api/show (no engine work) are not."""
    from appliance.openai_api.app import create_app
    from appliance.settings import ServeSettings

    app = create_app(ServeSettings(model_dir="unused", served_model_name="m", model_created=1), client=object())  # type: ignore[arg-type]
    no_engine_work = {"/v1/config/reload", "/api/pull", "/api/show", "/api/<path:rest>"}
    posted = {rule.rule for rule in app.url_map.iter_rules() if "POST" in (rule.methods or ())}
    assert {"/v3/embeddings", "/v1/rerank", "/v3/v1/tokenize", "/api/embeddings", "/v1/messages/count_tokens"} <= posted
    for path in posted:
        head = edge.parse_head(f"POST {path} HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode(), 10)
        assert head is not None and edge.is_engine_work(head) == (path not in no_engine_work), path


def test_a_lingering_close_ends_after_enough_bytes_or_its_time(clock):
    lingering: edge.Lingering[str] = edge.Lingering(clock)
    lingering.add("a")
    assert not lingering.drained("a", edge.LINGER_BYTES - 1)
    assert lingering.drained("a", 1)
    clock.now += 1
    lingering.add("b")
    assert lingering.expired() == []
    clock.now += edge.LINGER_SECONDS - 1
    assert lingering.expired() == ["a"]
    lingering.remove("a")
    clock.now += 1
    assert lingering.expired() == ["b"]


# ---- the edge's refusals, in each API's error shape


def test_refusals_on_openai_routes_keep_their_exact_bytes():
    too_many = (
        b'{"error": {"message": "Too many generation requests at once from this API key or address: retry when one '
        b'ends", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}}'
    )
    assert edge.answer(edge.Refusal.GENERATION_CAP) == (
        b"HTTP/1.1 429 Too Many Requests\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(too_many), too_many)
    )
    assert (
        edge.answer(edge.Refusal.BUSY)
        == edge.BUSY
        == (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    )
    assert edge.answer(edge.Refusal.HEAD_TOO_LARGE) == (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )


def test_a_refused_request_is_answered_in_its_paths_api_shape(clock):
    """The path comes from the parsed head, or from the request line alone (a head too large, a body shed half
    read): Anthropic's and Ollama's routes get their shape, the rest OpenAI's."""
    intake = edge.Intake(10.0, MAX_BODY, PeerCounts(1), budget=8 * edge.HEAD_LIMIT, clock=clock)
    for key, path, api in (
        ("a", "/v1/messages", "anthropic"),
        ("o", "/api/chat", "ollama"),
        ("v", "/v3/chat/completions", "openai"),
    ):
        intake.start(key, key)
        intake.received(key, b"\r\nPOST " + path.encode() + b"?beta=true HTTP/1.1\r\nX: " + b"y" * edge.HEAD_LIMIT)
        assert intake.advance(key) is edge.Step.HEAD_TOO_LARGE
        assert edge.api_of(intake.requests[key]) == api
    for path, api in (
        ("/v1/messages/count_tokens", "anthropic"),
        ("/api/generate", "ollama"),
        ("/v1/models", "openai"),
    ):
        intake.start(path, "p")
        intake.received(path, post(b"{}", path))
        assert intake.requests[path].head is None and edge.api_of(intake.requests[path]) == api
        intake.advance(path)
        assert intake.requests[path].head is not None and edge.api_of(intake.requests[path]) == api
    intake.start("nothing", "p")
    assert edge.api_of(intake.requests["nothing"]) == "openai"


def test_every_apis_generations_count_against_the_cap(intake):
    for i, path in enumerate(("/v1/messages", "/api/chat", "/api/generate", "/v1/chat/completions")):
        intake.start(f"{i}a", f"10.0.0.{i}")
        intake.received(f"{i}a", post(b"{}", path))
        assert intake.advance(f"{i}a") is edge.Step.READY
        intake.start(f"{i}b", f"10.0.0.{i}")
        intake.received(f"{i}b", post(b"{}", path))
        assert intake.advance(f"{i}b") is edge.Step.GENERATION_CAP, path
    for path in ("/v1/messages/count_tokens", "/v3/embeddings", "/v3/rerank", "/v3/tokenize", "/api/embed"):
        intake.start(path, "10.0.0.0")  # the address holds /v1/messages: at its cap of 1
        intake.received(path, post(b"{}", path))
        assert intake.advance(path) is edge.Step.GENERATION_CAP, path
        intake.stop(path)


@pytest.fixture
def replay():
    """A loopback server answering every connection with the bytes in `replay.answer` (as the edge writes them),
    so the real client libraries read the edge's answers."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    state = {"answer": b""}

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    conn.sendall(state["answer"])
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], state
    listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
    listener.close()
    thread.join(5)


@pytest.mark.parametrize("refusal", list(edge.Refusal))
def test_the_real_anthropic_and_ollama_clients_read_the_edges_refusals(replay, refusal):
    import anthropic
    import ollama

    port, state = replay
    _, message, _, _, _, _ = refusal.value
    status = int(refusal.value[0][:3])
    kind = {429: "rate_limit_error", 503: "overloaded_error", 431: "invalid_request_error"}[status]
    state["answer"] = edge.answer(refusal, "anthropic")
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    error = caught.value
    assert error.status_code == status and error.body == {"type": "error", "error": {"type": kind, "message": message}}
    assert message in error.message
    if status == 429:
        assert isinstance(error, anthropic.RateLimitError)
    if status == 503:
        assert isinstance(error, anthropic.InternalServerError)
    state["answer"] = edge.answer(refusal, "ollama")
    with pytest.raises(ollama.ResponseError) as reply:
        ollama.Client(host=f"http://127.0.0.1:{port}").chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.value.status_code == status and reply.value.error == message
