"""What HTTP workers and the engine process say to each other over the Unix socket.

Transport: `multiprocessing.connection` (length-prefixed pickle, HMAC challenge with a random authkey that only
this server's processes can read). A worker keeps a small pool of connections; on each it either makes a call
(one request, one reply) or runs one job (a generation request) whose events stream back until `End`.
Closing a connection in the middle of a job cancels the job's sequences: that is how a client disconnect
frees its KV at once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from appliance.outputs import Chunk, Timing
from appliance.params import SamplingParams

# An HttpRecord with this route is a batch of edge drops (appliance/http/worker.py): the reason in `method`, how
# many in `status`. The workers report them over the same engine op as responses, once a second.
DROPPED_ROUTE = "<edge drop>"
DROP_REASONS = frozenset(
    {
        "budget_shed",  # a worker's read budget was full: its largest unfinished request was closed (503)
        "client_bytes",  # one address's unfinished requests held its share of the budget: its largest closed (503)
        "client_connections",  # one address opened more connections than it may hold in a worker (503)
        "connections_full",  # a worker at its connection limit closed its oldest unfinished request (503)
        "generation_cap",  # one key or address ran more generations at once than allowed (429)
        "head_too_large",  # 431
        "request_timeout",  # a request not complete within --request-timeout
        "send_timeout",  # a response waited on its reader longer than allowed
        "tls_handshake",  # not TLS, or no common ground
    }
)


# ---- calls: (name, *args) -> Reply
# A model name "" means the first configured model (single-model callers); an unknown one: status state "unknown",
# a job or tokenize Failed 404 model_not_found.
STATUS = "status"  # (model="") -> EngineStatus
MODELS = "models"  # () -> list[ModelInfo], in config order
METRICS = "metrics"  # () -> str (Prometheus text)
TOKENIZE = "tokenize"  # (model, list[str]) -> list[list[int]]
RECORD_HTTP = "http"  # (HttpRecord, ...): one, or a batch -> Reply()
JOB = "job"  # (Job) -> events: Accepted | Failed, then ChoiceChunk..., then End
# (EncodeJob) -> one event: Encoded | Failed (embeddings, rerank: appliance/server/encoders/embeddings.py)
ENCODE = "encode"
RELOAD = "reload"  # () -> (changed: bool, list[ModelInfo]) once the loads end; Failed 400 for a broken config
# (model, keep_alive seconds | None) -> ModelInfo: load the model now (Ollama's empty request), then keep it for
# keep_alive; keep_alive 0 unloads it (once its requests end) instead. Answers once loaded (a job's load is the same)
LOAD = "load"
FAULT = "fault"  # (kind, model="") -> Reply(): Engine.inject_fault, only with FAULT_INJECTION_ENV=1 (tests)
# Ollama's /api/pull and /api/delete (appliance/server/pulled_models.py), answered once done (RELOAD_SECONDS):
SERVE_PULLED = "serve_pulled"  # (name) -> list[ModelInfo] once the pulled model serves; Failed 404 / 400 / 500
DELETE_PULLED = "delete_pulled"  # (name) -> Reply() once it stopped serving and its folder is gone; Failed 404 / 400

FAULT_INJECTION_ENV = "APPLIANCE_FAULT_INJECTION"

# Bounds on a peer that stops answering. The handshake is a few small messages: a peer silent for this long is
# gone (a worker killed mid-handshake) or hostile, and must not hold a thread. Calls are answered between two
# engine steps (the engine process's GIL): seconds mean the engine is wedged, and a worker must not wait forever.
HANDSHAKE_SECONDS = 5.0
CALL_SECONDS = 10.0
LOAD_SECONDS = 900.0  # LOAD answers once the model has loaded and warmed up (as a reload's models)
RELOAD_SECONDS = 900.0  # a reload answers once its models have loaded and warmed up (a large one on a GPU: minutes)


@contextlib.contextmanager
def io_timeout(conn: Connection, seconds: float) -> Iterator[None]:
    """Kernel send/receive timeouts (SO_RCVTIMEO / SO_SNDTIMEO) on a Connection's socket for the block: a read
    or write that waits longer fails with OSError. The socket stays blocking, which Connection needs."""
    sec = int(seconds)
    on, off = struct.pack("ll", sec, int((seconds - sec) * 1e6)), struct.pack("ll", 0, 0)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a dup: same socket
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sock.setsockopt(socket.SOL_SOCKET, opt, on)
        try:
            yield
        finally:
            for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                sock.setsockopt(socket.SOL_SOCKET, opt, off)


def handshake(conn: Connection, authkey: bytes, *, server: bool) -> None:
    """multiprocessing's HMAC challenge both ways, bounded by HANDSHAKE_SECONDS. Raises OSError, EOFError or
    multiprocessing.AuthenticationError on a peer that is gone, slow or without the key."""
    with io_timeout(conn, HANDSHAKE_SECONDS):
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)


def send_event(conn: Connection, event: object) -> None:
    """`conn.send(event)` in the same framing (a 4-byte big-endian length, then the pickle), built with plain
    `pickle.dumps` and written in one `os.write`: Connection.send builds a ForkingPickler and a BytesIO per message,
    which on the per-token path costs more than the write (measured: 19 vs 8 us per ChoiceChunk)."""
    _write(conn.fileno(), _frame(event))


def _frame(event: object) -> memoryview:
    data = pickle.dumps(event, pickle.HIGHEST_PROTOCOL)
    n = len(data)
    return memoryview((struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data)


def _write(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


class EventConnection:
    """A job's connection as the engine side holds it: `send` is `send_event` (every event of the job, the
    per-token ChoiceChunks included, goes out in one write); recv, poll, fileno and close are the Connection's.
    The tracing wrapper (appliance/server/tracing.py) is a subclass that notes each event before it goes, so the
    job runner sends the same way whether or not the job is traced."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, event: object) -> None:
        send_event(self.conn, event)

    def try_send(self, event: object) -> bool:
        """`send` if it cannot block (the engine thread sends a job's first token: RequestHandle.divert_first):
        False, nothing written, when the socket's buffer has no room now. A message the buffer takes only in part
        (cannot happen to a first token behind an Accepted, but) is finished with blocking writes."""
        view = _frame(event)
        sock = socket.socket(fileno=self.conn.fileno())  # the same fd, not a dup: detached below
        try:
            try:
                written = sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
        finally:
            sock.detach()
        _write(self.conn.fileno(), view[written:])
        return True

    def __getattr__(self, name: str) -> Any:  # recv, poll, fileno (multiprocessing.connection.wait), close
        return getattr(self.conn, name)


class EventReader:
    """Reads a Connection's messages (Connection.send's framing) through its own buffer: one `os.read` takes
    whatever the engine wrote (several events when they came together), where `Connection.recv` reads the header
    and the payload apart, and `Connection.poll` builds a selector per call (measured: 20 us of the 140 us a
    token's receive cost on the loaded 2-vCPU box); here one poll object serves the whole job."""

    def __init__(self, conn: Connection):
        self.fd = conn.fileno()
        self.buffer = bytearray()
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)

    def _whole(self) -> tuple[int, int] | None:
        """(header size, payload size) of the first buffered message if it is all here."""
        buf = self.buffer
        if len(buf) < 4:
            return None
        (n,) = struct.unpack_from("!i", buf)
        head = 4
        if n == -1:
            if len(buf) < 12:
                return None
            (n,) = struct.unpack_from("!Q", buf, 4)
            head = 12
        return (head, n) if len(buf) >= head + n else None

    def poll(self, timeout: float | None) -> bool:
        """A message (or the end) can be read now, or arrived within `timeout` seconds (None: wait)."""
        if self._whole() is not None:
            return True
        return bool(self._poll.poll(None if timeout is None else max(timeout, 0.0) * 1e3))

    def recv(self) -> object:
        """The next message; EOFError when the peer closed, OSError on a broken connection."""
        while (frame := self._whole()) is None:
            data = os.read(self.fd, 65536)
            if not data:
                raise EOFError("the engine closed the connection")
            self.buffer += data
        head, n = frame
        event = pickle.loads(memoryview(self.buffer)[head : head + n])
        del self.buffer[: head + n]
        return event


@dataclass
class Reply:
    value: object = None
    error: Failed | None = None


@dataclass
class EngineStatus:
    state: str  # loading | ready | failed | stopping | unknown (no such model; error says so)
    error: str | None = None
    max_context: int = 0
    vocab_size: int = 0
    generation_defaults: dict = field(default_factory=dict)
    backend: str = ""
    weight_format: str = ""
    device: str = ""
    # how this model writes tool calls and reasoning (appliance/server/tool_prompt.py picks them from the chat template,
    # `--tool-parser` / `--reasoning-parser` override): HTTP workers parse the output with these
    tool_parser: str = ""
    reasoning_parser: str = ""
    serial: int = 0  # new per load of the model: a worker drops a kept status whose serial a job no longer sees
    # what the model does: generate (an LLM: chat, completions), embed or rerank (an encoder: /v3/embeddings,
    # /v3/rerank); for an encoder max_context is its max input length (tokens) and dimensions its vector size
    task: str = "generate"
    dimensions: int = 0
    normalized: bool = False  # an embed model's vectors have unit length (so `dimensions` may truncate them)

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass
class ModelInfo:
    """One configured model as /v3/models and /v1/config show it."""

    name: str
    created: int
    state: str  # as EngineStatus.state
    error: str | None = None
    # a ready model is loaded (in memory) or unloaded by the keep_alive / memory budget policy, and then loads on its
    # next request (appliance/server/residency.py)
    loaded: bool = True
    size: int = 0  # bytes in memory, estimated (residency.estimate)
    expires_at: float | None = None  # unix time it unloads if it stays idle; None: not planned (forever, or busy)


@dataclass
class PromptSpec:
    """One prompt as the client gave it; the engine process tokenizes (one tokenizer, next to the model)."""

    text: str | None = None
    token_ids: list[int] | None = None
    # chat: rendered with the model's chat template. A message with images has list content in Hugging Face's
    # chat-template convention: [{"type": "image"}, {"type": "text", "text": "..."}], in the client's order
    messages: list[dict] | None = None
    tools: list[dict] | None = (
        None  # chat: the request's tools, passed to the template (appliance/server/tool_prompt.py)
    )
    thinking: bool | None = None  # chat: the template's `enable_thinking` (Qwen3's switch); None: its default
    # chat: the image files (JPEG, PNG or WebP, base64-decoded or fetched by the worker, each at most
    # Limits.image_bytes, at most Limits.images), in the order of the {"type": "image"} parts in `messages`; the
    # engine process decodes them (pixels bounded by Limits.image_pixels). None: no images
    images: list[bytes] | None = None
    # each image's field in the client's request, in its API's spelling (messages[0].content[1].image_url.url,
    # input[0].content[1].image_url, messages.0.content.0.source.data, messages[0].images[0]): what the engine's
    # refusal of that image names (server/admit.py). None: no images
    image_fields: list[str] | None = None
    # chat: the request field that holds the conversation in the client's API (chat's and Anthropic's `messages`,
    # Responses' `input`, Ollama generate's `prompt`), declared by its adapter (ChatRequest.conversation): what a
    # refusal of the conversation names (server/prompts.py, server/admit.py), as OpenAI's `param`
    conversation_field: str = "messages"

    @property
    def prompt_field(self) -> str:
        """The request field this prompt came from: the conversation's for a chat prompt, else `prompt`."""
        return self.conversation_field if self.messages is not None else "prompt"


@dataclass
class Job:
    request_id: str
    prompts: list[PromptSpec]
    params: SamplingParams
    n: int = 1  # sequences per prompt; choice index = prompt * n + j
    echo: bool = False
    seeds: list[int] | None = None  # Friendli's seed list: choice j's seed (len n); None: params.seed + j
    model: str = ""  # the served model that runs it ("": the first one)
    # which API key sent it: a non-secret id (the key's place in the key file), never the key; "": no key file.
    # The engine keeps the prefix cache apart per tenant (server/admit.py)
    tenant: str = ""
    # OpenTelemetry, when tracing is on and the request is sampled: the W3C trace context (traceparent, tracestate)
    # of the worker's request span, whose children the engine's spans of the job are (appliance/tracing.py)
    trace: dict[str, str] | None = None
    # Ollama's keep_alive (seconds; math.inf: forever; None: the model's default): how long the model stays loaded
    # once this job and the others on it end
    keep_alive: float | None = None
    # Ollama's num_ctx: the tokens this request's prompt + output may use (None: the model's context)
    context_window: int | None = None


@dataclass
class EncodeJob:
    """An embeddings or rerank request, one for every client API (OpenAI's, Ollama's). Embed: `texts` or
    `token_ids` (one entry per input); rerank: `query` and `documents`. `truncate`: inputs longer than the model's
    maximum are cut to it (else a 400); `dimensions`: the vectors cut to their first n and renormalized."""

    request_id: str
    model: str
    task: str  # "embed" | "rerank"
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    query: str | None = None
    documents: list[str] | None = None
    truncate: bool = False
    dimensions: int | None = None


@dataclass
class Encoded:
    """An EncodeJob's answer. Embed: `vectors`, one per input, each float32 little-endian bytes (workers have no
    numpy: array('f') or base64 reads them); rerank: `scores`, one per document, in input order. `tokens`: per
    input (rerank: per query + document pair), what usage counts."""

    tokens: list[int]
    vectors: list[bytes] | None = None
    scores: list[float] | None = None
    seconds: float = 0.0  # from queueing to the last batch


@dataclass
class HttpRecord:
    route: str
    method: str
    status: int
    seconds: float
    error_type: str | None = None


# ---- job events (engine -> worker)
@dataclass
class Accepted:
    prompt_tokens: list[int]  # per prompt
    echo_texts: list[str] | None = None  # per prompt, when echo was asked
    serial: int = 0  # the model's EngineStatus.serial
    load_seconds: float = 0.0  # the job waited this long for its model to load (Ollama's load_duration)


@dataclass
class Failed:
    """An error the worker answers with as is (status + OpenAI error fields)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass
class ChoiceChunk:
    index: int
    chunk: Chunk
    timing: Timing | None = None  # with the last chunk of the choice


@dataclass
class End:
    pass
