"""What test modules share that is not a fixture: the checked loopback server, waits and SSE parsing, the in-process
app, greedy-divergence rules and shared request bodies. Test modules import from here (`from tests.helpers import
...`); tests/conftest.py keeps only fixtures and hooks, so no module imports `conftest` and test folders can hold
files of the same name."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import requests

from appliance.http.client import EngineClient
from appliance.settings import AUTHKEY_FILE, RUNTIME_DIR_ENV, SOCKET_FILE
from appliance.testing.loopback import ApplianceServer, ServerNotReady
from appliance.testing.procinfo import children, is_zombie, process_tree, status_field

# ================================================================ what the project installs itself


def ours_missing(message: str, module_level: bool = False) -> NoReturn:
    """Something the project's own install steps provide (a venv, a pinned package, our kernels, the browser `make
    browser` installs) is missing: a failure under CI, where a skip would leave the run green without the test, and
    a skip outside it (a hand-made venv). `module_level`: called at a module's import (skips the whole module)."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI: a failure, not a skip)", pytrace=False)
    pytest.skip(message, allow_module_level=module_level)


def serving_venv(root: Path) -> Path:
    """The venv `make venv` built (the Makefile exports its path); outside `make test` there may be none."""
    path = Path(os.environ.get("APPLIANCE_SERVING_VENV", root / ".venv"))
    if not (path / ".installed").is_file():
        ours_missing(f"no serving venv at {path}: `make test` builds it (make venv)")
    return path


# ================================================================ a real `appliance serve` on loopback
# conftest.py's `server` is one session-wide server (2 workers, no API key) on a free port; `Server` starts others.

START_TIMEOUT = 300  # hang guards only: nothing asserts how fast anything is
WAIT_TIMEOUT = 60


def rss_mb(pid: int) -> float:
    return status_field(pid, "VmRSS") / 1024


def wait_until(predicate, what: str, timeout: float = WAIT_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def sse_events(response: requests.Response) -> list:
    """The `data:` payloads of an SSE response, parsed (the final "[DONE]" kept as is)."""
    events = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class Server(ApplianceServer):
    """appliance.testing.loopback's server, with what tests check on top: a clean exit code, the gunicorn workers, and
    no process left behind after a stop."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str):
        super().__init__(model_dir, *args, log_path=log_path, start_timeout=START_TIMEOUT)

    def wait_ready(self) -> None:
        try:
            super().wait_ready()
        except ServerNotReady as exc:
            pytest.fail(str(exc))

    def __enter__(self) -> Server:
        """`with Server(...) as srv:` waits until ready, and closes it (checked) at the end."""
        try:
            self.wait_ready()
        except BaseException:
            self.kill()  # it never served: no clean-stop check to make
            self._log.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Fixture teardown: a clean SIGTERM stop if still running."""
        try:
            if self.proc.poll() is None:
                code = self.stop()
                assert code == 0, f"unclean exit {code}:\n{self.output()}"
        finally:
            self.kill()
            self._log.close()

    def process_tree(self) -> list[int]:
        return process_tree(self.proc.pid)

    def workers(self) -> set[int]:
        """PIDs of the gunicorn workers (children of the arbiter, the engine process's one child). A worker that
        crashed is replaced by gunicorn under a new PID."""
        arbiters = children(self.proc.pid)
        assert len(arbiters) == 1, arbiters
        return {pid for pid in children(arbiters[0]) if not is_zombie(pid)}

    def stop(self, signalled: bool = False) -> int:
        """SIGTERM (unless the test sent a signal itself); the exit code, after checking nothing is left behind."""
        tree = self.process_tree()
        if not signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=WAIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"appliance serve ignored SIGTERM:\n{self.output()}")
        wait_until(
            lambda: not [p for p in tree[1:] if Path(f"/proc/{p}").exists() and not is_zombie(p)],
            "the gunicorn processes to exit",
        )
        return code


def runtime_dir(server: Server) -> Path:
    """The engine's private runtime directory, read from the gunicorn arbiter's environment."""
    arbiter = server.process_tree()[1]
    env = Path(f"/proc/{arbiter}/environ").read_bytes().split(b"\0")
    return Path(next(e for e in env if e.startswith(RUNTIME_DIR_ENV.encode() + b"=")).split(b"=", 1)[1].decode())


def engine_client(server: Server) -> EngineClient:
    """A client of the server's engine socket, past the HTTP edge (what a drill uses to inject a fault)."""
    runtime = runtime_dir(server)
    return EngineClient(str(runtime / SOCKET_FILE), (runtime / AUTHKEY_FILE).read_bytes())


def one_worker_server(
    model_dir: Path,
    log_path: Path,
    *extra: str,
    threads: int | None = None,
    request_timeout: float | None = None,
    send_timeout: float | None = None,
    keepalive_timeout: float | None = None,
) -> Server:
    """A server with one gunicorn worker and the HTTP bounds a test measures spelled out (None: the default): the
    edge tests count one worker's threads and connections and wait on its timeouts. Use it as `with ... as srv:`."""
    flags = ["--workers", "1"]
    for flag, value in (
        ("--threads", threads),
        ("--request-timeout", request_timeout),
        ("--send-timeout", send_timeout),
        ("--keepalive-timeout", keepalive_timeout),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return Server(model_dir, log_path, *flags, *extra)


# ================================================================ the Flask app over an in-process engine
# Used by the beam-search, prompt-logprobs and tool-output tests: the real app and engine service, no gunicorn.


@contextlib.contextmanager
def in_process_api(engine, runtime: Path):
    """A Flask test client wired through the real engine service to `engine` (the caller's f32 engine)."""
    from appliance.http.client import EngineClient
    from appliance.server.engine_service import EngineService
    from appliance.server.metrics import ServerMetrics
    from appliance.settings import AUTHKEY_FILE, ServeSettings
    from appliance.wsgi.app import create_app

    (runtime / AUTHKEY_FILE).write_bytes(os.urandom(32))
    settings = ServeSettings(
        model_dir=str(engine.model_dir), served_model_name="m", model_created=0, runtime_dir=str(runtime)
    )
    service = EngineService(settings, ServerMetrics())
    service.start()
    service.attach(engine, "CPU")
    try:
        yield create_app(settings, EngineClient(settings.socket_path, settings.authkey())).test_client()
    finally:
        service.stop()


@contextlib.contextmanager
def one_torch_thread():
    """transformers on one thread: on a busy 2-core machine two OpenMP threads spin-wait each other ~10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ================================================================ logits compared as distributions


def logits_tvd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Total-variation distance between the softmaxes of logits `a` and `b` along the last axis (0 = identical)."""
    pa, pb = (np.exp(v - v.max(-1, keepdims=True)) for v in (a, b))
    return 0.5 * np.abs(pa / pa.sum(-1, keepdims=True) - pb / pb.sum(-1, keepdims=True)).sum(-1)


# ================================================================ greedy runs that may part at a near-tie
# Used by test_server_e2e.py, test_parity.py, test_choices.py and test_prompt_logprobs.py. Two greedy runs of the
# same prompt are not bit-identical once anything changes the arithmetic: the batch a sequence shares (kernel
# blocking, u8 KV rounding), the CPU (bf16 compute on AVX-512-bf16 CPUs, f32 on AVX2-only ones), the weights
# (an fp16 export against transformers' fp32). Where the top two candidates are closer than that noise, argmax
# may pick either, and from there on the runs continue from different contexts. So the rule, written once here:
# two greedy token streams may part only at a position where the reference run's chosen token and the other run's
# token are both among the reference's candidates and within `margin` nats of each other; nothing after that
# position is compared. Margins (per-logprob differences measured on the default model, SmolLM2-135M; a flip
# needs a gap below twice that, each margin leaves about 2x more on top):
NEAR_TIE_F32 = 1e-3  # f32 compute, different batch / CPU: logprobs differ by <= 7e-5
NEAR_TIE_FP16_WEIGHTS = 0.05  # fp16 export in f32 vs transformers on the fp32 weights: <= 0.009
NEAR_TIE_DEFAULT = 1.0  # default precision (bf16 compute, u8 KV), batched vs alone: <= 0.25


def greedy_divergence(
    reference: Sequence, candidates: Sequence[Mapping], other: Sequence, margin: float, what: str = ""
) -> int:
    """Index of the first position where greedy stream `other` differs from `reference` (len(reference) if they
    are equal), after asserting that it is a near-tie. `candidates[i]` maps the reference run's top candidates at
    position i (its chosen token among them) to their logprobs; tokens are ids or texts, the same kind throughout.
    Without a divergence the two streams must have the same length."""
    for i, (want, have) in enumerate(zip(reference, other)):
        if want == have:
            continue
        top = candidates[i]
        assert have in top, f"{what}: diverged at token {i}: {have!r} is not among the reference's {dict(top)}"
        gap = top[want] - top[have]
        assert gap <= margin, (
            f"{what}: diverged at token {i}: {want!r} -> {have!r} with a logprob gap of "
            f"{gap:.4f} nats, not a near-tie (margin {margin})"
        )
        return i
    assert len(other) == len(reference), f"{what}: {len(other)} tokens, the reference has {len(reference)}"
    return len(reference)


def wait_idle(server: Server) -> None:
    """Until the server runs and queues nothing: two greedy runs compared token for token (unary vs streaming, echo
    vs plain) are only equal when each has the engine to itself, as numerics depend on the batch (see above)."""
    wait_until(
        lambda: (m := server.metrics())["appliance_running_sequences"] == 0 and m["appliance_queue_depth"] == 0,
        "the server to be idle",
    )


LOOPBACK = ("127.0.0.1", "::1", "localhost")
# what third-party clients (langchain, litellm, ...) would send off the machine unless told not to
TELEMETRY_OFF = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # litellm fetches its cost map at import otherwise
TRACING_VARIABLES = ("LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING", "LANGSMITH_TRACING", "LANGSMITH_TRACING_V2")


# The tool the tool-call tests of every client API offer: small enough for the 135M default model to fill in.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def self_signed_cert(cert: Path, key: Path, common_name: str, alt_names: str) -> tuple[Path, Path]:
    """A new self-signed EC certificate and key for `common_name` (`alt_names`: openssl's subjectAltName value, e.g.
    "DNS:host,IP:127.0.0.1"), valid for a day: what the TLS tests serve and trust."""
    subprocess.run(
        ["/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={common_name}"]
        + ["-addext", f"subjectAltName={alt_names}"],
        check=True,
        capture_output=True,
    )
    return cert, key


def many_scans(jpeg: bytes, repeats: int) -> bytes:
    """A progressive JPEG with its first scan (SOS header and entropy-coded data) repeated before EOI: a file of
    more scans than encoders write (the vision decoder refuses those before decoding)."""
    start = jpeg.index(b"\xff\xda")
    end = start + 2 + int.from_bytes(jpeg[start + 2 : start + 4], "big")
    while jpeg[end] != 0xFF or jpeg[end + 1] == 0x00 or 0xD0 <= jpeg[end + 1] <= 0xD7:  # stuffed FF 00, RSTn
        end += 1
    return jpeg[:-2] + jpeg[start:end] * repeats + jpeg[-2:]
