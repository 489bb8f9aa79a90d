"""A stand-in for a Hugging Face-compatible hub on loopback: enough of the hub's file API for huggingface_hub's
`model_info(files_metadata=True)` and `hf_hub_download` (no network exists where the tests run).

Routes, as the hub answers them:
- `GET /api/models/{repo}[/revision/{rev}]`: `id`, `sha` (the commit), `siblings` with `size`, `blobId` (the git
  blob id) and, for an LFS file, `lfs: {sha256, size, pointerSize}`;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: `ETag` (an LFS file's SHA-256, else its blob id), `X-Repo-Commit`,
  `Content-Length`, and for an LFS file `X-Linked-Etag` / `X-Linked-Size`; `Range: bytes=N-` answers 206 with
  `Content-Range`;
- an unknown repository, revision or file: 404 with the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound,
  EntryNotFound), which huggingface_hub turns into its typed errors.

Faults a test asks for on a `Repo`: `drop_once` (file -> byte offset: the first GET of it sends its headers and that
many bytes, then closes the connection), `corrupt` (files served with one byte flipped while the model info keeps
the true checksum), `claimed_sizes` (file -> the size the model info reports: a huge one for a disk-space refusal),
`throttle` (file -> seconds slept after each MiB: a download slow enough to interrupt), `token` (requests without
`Authorization: Bearer <token>` get 401 with RepoNotFound, as the hub answers for a private repository), `endless`
(a hostile hub: files whose model info and HEAD announce their size, `claimed_sizes`' if given, while a GET sends
their bytes over and over as a chunked body that never ends, until the client goes). Every request is recorded in
`requests` (method, path, Range header, Authorization header); `sent` counts the bytes of each file's bodies.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_MIN_BYTES = 10 << 20  # the hub keeps larger files in LFS (and *.bin / *.safetensors whatever their size)
LFS_SUFFIXES = (".bin", ".safetensors")
CHUNK = 1 << 20


@dataclass
class Repo:
    files: dict[str, Path]  # name in the repository -> the local file served
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    revisions: tuple[str, ...] = ("main",)  # names that resolve to `commit` (the commit itself always does)
    drop_once: dict[str, int] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    claimed_sizes: dict[str, int] = field(default_factory=dict)
    throttle: dict[str, float] = field(default_factory=dict)  # file -> seconds of sleep after each 1 MiB sent
    token: str | None = None
    endless: set[str] = field(default_factory=set)
    _digests: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # name -> (size, sha256, blob id)

    def digests(self, name: str) -> tuple[int, str, str]:
        if name not in self._digests:
            path = self.files[name]
            size = path.stat().st_size
            sha256, blob = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
            with path.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    sha256.update(chunk)
                    blob.update(chunk)
            self._digests[name] = (size, sha256.hexdigest(), blob.hexdigest())
        return self._digests[name]

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES) or self.files[name].stat().st_size >= LFS_MIN_BYTES

    def sibling(self, name: str) -> dict:
        size, sha256, blob = self.digests(name)
        size = self.claimed_sizes.get(name, size)
        entry: dict = {"rfilename": name, "size": size, "blobId": blob}
        if self.is_lfs(name):
            entry["lfs"] = {"sha256": sha256, "size": size, "pointerSize": 134}
        return entry


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


class StubHub:
    """`with StubHub({"org/name": Repo(...)}) as hub:` serves on `hub.url` (set HF_ENDPOINT to it)."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[Seen] = []
        self._dropped: set[str] = set()
        self.sent: dict[str, int] = {}  # file name -> bytes of its bodies sent
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="stub-hub", daemon=True)

    def __enter__(self) -> StubHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, name: str) -> list[Seen]:
        """The GETs of file `name` (its downloads)."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(name)]

    # ---- answers
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        with self._lock:
            self.requests.append(Seen(h.command, path, h.headers.get("Range"), h.headers.get("Authorization")))
        if path.startswith("/api/models/"):
            return self._info(h, path[len("/api/models/") :])
        if "/resolve/" in path:
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            revision, _, name = rest.partition("/")
            return self._file(h, repo_id, revision, name, body)
        return self._error(h, 404, "RepoNotFound")

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound")
            return None
        if repo.token and h.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(h, 401, "RepoNotFound")  # the hub says "not found" to a caller without access
            return None
        if revision not in (*repo.revisions, repo.commit):
            self._error(h, 404, "RevisionNotFound")
            return None
        return repo

    def _info(self, h: BaseHTTPRequestHandler, rest: str) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        repo = self._repo(h, repo_id, revision or "main")
        if repo is None:
            return
        data = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.commit,
            "private": False,
            "siblings": [repo.sibling(name) for name in sorted(repo.files)],
        }
        self._send(h, 200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _file(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(h, repo_id, revision)
        if repo is None:
            return
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound")
        size, sha256, blob = repo.digests(name)
        etag = sha256 if repo.is_lfs(name) else blob
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if repo.is_lfs(name):
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)}
        if name in repo.endless:
            return self._endless(h, repo, name, headers, body)
        start, status = 0, 200
        wanted = h.headers.get("Range")
        if wanted and wanted.startswith("bytes=") and wanted.endswith("-"):
            start, status = int(wanted[len("bytes=") : -1]), 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        headers["Content-Length"] = str(size - start)
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if not body:
            return
        cut = None
        with self._lock:
            if name in repo.drop_once and f"{repo_id}/{name}" not in self._dropped:
                self._dropped.add(f"{repo_id}/{name}")
                cut = repo.drop_once[name]
        with repo.files[name].open("rb") as handle:
            handle.seek(start)
            position = start
            while chunk := handle.read(CHUNK):
                if name in repo.corrupt and position <= size // 2 < position + len(chunk):
                    i = size // 2 - position
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                if cut is not None and position + len(chunk) >= cut:
                    h.wfile.write(chunk[: max(cut - position, 0)])
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.close()  # mid-file: the client sees a short body
                    return
                h.wfile.write(chunk)
                position += len(chunk)
                self._count(name, len(chunk))
                if name in repo.throttle:
                    time.sleep(repo.throttle[name])

    def _endless(self, h: BaseHTTPRequestHandler, repo: Repo, name: str, headers: dict, body: bool) -> None:
        """The announced size in the headers (HEAD), then (GET) the file's bytes again and again, chunked."""
        size = repo.claimed_sizes.get(name, repo.digests(name)[0])
        if not body:
            headers["Content-Length"] = str(size)
        else:
            headers["Transfer-Encoding"] = "chunked"
        h.send_response(200)
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if not body:
            return
        data = repo.files[name].read_bytes() or b"\0"
        chunk = (data * (CHUNK // len(data) + 1))[:CHUNK]
        frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
        h.close_connection = True
        try:
            while True:
                h.wfile.write(frame)
                self._count(name, len(chunk))
        except OSError:  # the client went away
            return

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.sent[name] = self.sent.get(name, 0) + n

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, status, json.dumps({"error": code or "unauthorized"}).encode(), headers)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def ir_repo(export_dir: Path, scratch: Path, **faults) -> Repo:
    """A repository as OpenVINO's `*-ov` ones are, made from an appliance OpenVINO export: its IR, config and
    tokenizer files, without the appliance's own manifest; plus a README and an openvino_tokenizer.xml (written
    into `scratch`) that a pull skips."""
    skip = {"appliance_manifest.json", ".appliance_build.json"}
    files = {p.name: p for p in sorted(export_dir.iterdir()) if p.is_file() and p.name not in skip}
    extra = scratch / "stub-hub-extra"
    extra.mkdir(parents=True, exist_ok=True)
    for name, text in (("README.md", "# a stand-in repository\n"), ("openvino_tokenizer.xml", "<net/>\n")):
        (extra / name).write_text(text)
        files[name] = extra / name
    return Repo(files, **faults)
