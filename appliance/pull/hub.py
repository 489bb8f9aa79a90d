"""A pull's side of the hub (appliance/pull/__init__.py says what a pull is and why it runs where it does): what
a repository at a revision holds (its commit, its files with sizes and checksums), which of them to download, each
download resumed where it stopped and retried, and each file checked against the hub's checksum.

huggingface_hub is imported here only, by a pull, with its telemetry and its own progress bars off (the pull
reports progress itself, as Ollama's status lines); the hub is `HF_ENDPOINT` (default https://huggingface.co), the
token `HF_TOKEN` (or huggingface_hub's stored login).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance.hub_names import HubRef

DEFAULT_ENDPOINT = "https://huggingface.co"
RETRIES = 5  # a dropped connection resumes the file this many times before the pull fails
RETRY_SECONDS = 1.0
PROGRESS_SECONDS = 0.25  # how often a download reports its bytes
CHECK_SECONDS = 0.05  # how often a download's size is held against the announced one
EXPORT_TOOLS = ("torch", "transformers", "optimum", "nncf")
# the files of a safetensors repository the exporter reads (the weights, their index, the tokenizer, the config)
SAFETENSORS_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "model.safetensors.index.json",
)

Emit = Callable[..., None]  # emit(event: dict, file: str | None = None): one Ollama status object


class PullError(Exception):
    """A pull that cannot finish, as one line; `status` is the HTTP status /api/pull answers with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: str | None  # an LFS file's
    blob_id: str | None  # the git blob id (SHA-1 of "blob <size>\0" + content) of a file stored in git itself

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"sha1:{self.blob_id or ''}"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def connect():
    """huggingface_hub, imported on a pull only: no telemetry, no progress bars of its own (ours report)."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import huggingface_hub
    import huggingface_hub.constants
    import huggingface_hub.errors

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise PullError("HF_HUB_OFFLINE is set: a pull needs the hub", 400)
    return huggingface_hub


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def hub_manifest(hub, ref: HubRef) -> tuple[str, list[HubFile]]:
    """The commit `ref.revision` is now, and its files with sizes and checksums (the hub's model info)."""
    errors, where = hub.errors, f"pull model manifest: {ref.repo}"
    try:
        info = hub.HfApi(endpoint=endpoint()).model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except errors.RevisionNotFoundError:
        raise PullError(f"{where} has no revision {ref.revision!r} on {endpoint()}", 404) from None
    except errors.GatedRepoError:
        raise PullError(f"{where} is gated: accept its terms on the hub and set HF_TOKEN", 403) from None
    except errors.RepositoryNotFoundError:
        raise PullError(f"{where} not found on {endpoint()} (a private one needs HF_TOKEN)", 404) from None
    except errors.HfHubHTTPError as exc:
        raise PullError(f"pull model manifest: the hub answered {str(exc).splitlines()[0]}", 502) from None
    except OSError as exc:  # requests' ConnectionError and Timeout are OSErrors
        raise PullError(f"pull model manifest: cannot reach the hub at {endpoint()}: {exc}", 502) from None
    if not info.sha or info.siblings is None:
        raise PullError(f"pull model manifest: {endpoint()} sent no commit or file list for {ref.repo}", 502)
    files = [
        HubFile(s.rfilename, int(s.lfs.size if s.lfs else s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings
    ]
    return info.sha, files


def plan(ref: HubRef, files: list[HubFile]) -> tuple[str, list[HubFile]]:
    """("ir" | "safetensors", the files to download); PullError for a repository that is neither, or safetensors
    without the export tools."""
    from export.ir import WANTED

    names = {f.name for f in files}
    if {"openvino_model.xml", "openvino_model.bin"} <= names:
        return "ir", [f for f in files if f.name in WANTED]
    if "config.json" in names and any(n.endswith(".safetensors") and "/" not in n for n in names):
        missing = [m for m in EXPORT_TOOLS if importlib.util.find_spec(m) is None]
        if missing:
            raise PullError(
                f"{ref.repo} holds safetensors weights, not an OpenVINO IR: converting them needs the export tools "
                f"({', '.join(missing)} are not installed here). Install them (`make dev-venv`, or pip install "
                "-r requirements/torch-cpu.txt, then -c requirements/lock.txt -e '.[export]'), or pull a "
                "repository that holds an OpenVINO IR (e.g. OpenVINO/*-int4-ov)",
                400,
            )
        return "safetensors", [
            f for f in files if f.name in SAFETENSORS_FILES or (f.name.endswith(".safetensors") and "/" not in f.name)
        ]
    raise PullError(
        f"{ref.repo} holds neither an OpenVINO IR (openvino_model.xml and .bin) nor safetensors weights with a "
        "config.json: nothing the appliance can serve",
        400,
    )


def have(download: Path, f: HubFile) -> int:
    """Bytes of `f` already downloaded: the whole file, or its resumable part (huggingface_hub names it
    `<hash of the name>.<etag>.incomplete`, beside the file's `.metadata`; the etag is the checksum)."""
    done = download / f.name
    if done.is_file():
        return done.stat().st_size
    parts = (download / ".cache" / "huggingface" / "download" / f.name).parent
    etag = f.sha256 or f.blob_id
    if not etag or not parts.is_dir():
        return 0
    sizes = []
    for part in parts.glob(f"*.{glob_escape(etag)}.incomplete"):
        try:
            sizes.append(part.stat().st_size)
        except FileNotFoundError:  # finished between the listing and the stat: renamed to the file
            return done.stat().st_size if done.is_file() else 0
    return max(sizes, default=0)


def fetch_file(hub, ref: HubRef, commit: str, f: HubFile, download: Path, emit: Emit) -> None:
    """One file into `download` (huggingface_hub's local_dir, which resumes its `.incomplete` part), reporting its
    bytes every PROGRESS_SECONDS; a dropped connection is retried RETRIES times, each resuming.

    Bounded by the size the hub announced: huggingface_hub writes whatever arrives and compares sizes only at the
    end, so a hub that announces 24 bytes and sends an endless body filled 750 MB in 20 s. The part's size is
    looked at every CHECK_SECONDS; past the announced size the pull stops (PullError 502) and the part is deleted.
    The download runs on a daemon thread, which cannot be stopped from outside: the process ends with the pull
    (the CLI, or /api/pull's child), and the thread with it."""
    status = file_status(f)
    for attempt in range(RETRIES + 1):
        job = Download(hub.hf_hub_download, ref.repo, f.name, revision=commit, local_dir=download, endpoint=endpoint())
        reported = 0.0
        while not job.done.wait(CHECK_SECONDS):
            got = have(download, f)
            if got > f.size:
                discard(download, f)
                raise PullError(
                    f"downloading {f.name}: the hub sent more than the {f.size} bytes it announced; stopped, and "
                    "the partial file deleted",
                    502,
                )
            if time.monotonic() - reported >= PROGRESS_SECONDS:
                reported = time.monotonic()
                emit({**status, "completed": got}, f.name)
        exc = job.error
        if exc is None:
            break
        if not transient(hub, exc):
            raise PullError(f"downloading {f.name}: {str(exc).splitlines()[0]}", 502) from None
        if attempt == RETRIES:
            raise PullError(f"downloading {f.name} failed {RETRIES + 1} times: {exc}", 502) from None
        time.sleep(RETRY_SECONDS)
    emit({**status, "completed": f.size}, f.name)


class Download:
    """`call(*args, **kwargs)` on a daemon thread (fetch_file says why a daemon): `done` once it returns, with its
    exception in `error`."""

    def __init__(self, call: Callable[..., object], *args: object, **kwargs: object):
        self.done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                call(*args, **kwargs)
            except BaseException as exc:
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=run, name="pull-download", daemon=True).start()


def discard(download: Path, f: HubFile) -> None:
    """`f`'s downloaded bytes gone: the file, its resumable parts and huggingface_hub's record of it."""
    (download / f.name).unlink(missing_ok=True)
    parts = (download / ".cache" / "huggingface" / "download" / f.name).parent
    etag = f.sha256 or f.blob_id
    if etag and parts.is_dir():
        for part in parts.glob(f"*.{glob_escape(etag)}.incomplete"):
            part.unlink(missing_ok=True)
    (download / ".cache" / "huggingface" / "download" / f"{f.name}.metadata").unlink(missing_ok=True)


def file_status(f: HubFile) -> dict:
    """Ollama's line for one file: `pulling <12 hex digits>` with the digest and the total bytes."""
    return {"status": f"pulling {f.digest.split(':')[1][:12]}", "digest": f.digest, "total": f.size}


def transient(hub, exc: BaseException) -> bool:
    """A dropped connection, a timeout, the hub's 5xx or 429: worth resuming. A 4xx (gone, forbidden) is not."""
    if isinstance(exc, hub.errors.HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (OSError, hub.errors.LocalEntryNotFoundError))


def verify(download: Path, f: HubFile) -> None:
    """The file matches the hub's checksum (and size); a mismatch deletes it, so the next pull fetches it again."""
    path = download / f.name
    size = path.stat().st_size
    if f.sha256:
        want, digest = f.sha256, hashlib.sha256()
    elif f.blob_id:
        want, digest = f.blob_id, hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
    else:
        want, digest = None, None
    if digest is not None:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    got = digest.hexdigest() if digest is not None else None
    if size != f.size or got != want:
        discard(download, f)
        kind = "sha256" if f.sha256 else "sha1"
        raise PullError(
            f"digest mismatch, file must be downloaded again: {f.name} want {kind}:{want} ({f.size} bytes), "
            f"got {kind}:{got} ({size} bytes)",
            502,
        )
