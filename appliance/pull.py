"""`appliance pull REPO[:REVISION]`: a model from a Hugging Face-compatible hub, made ready to serve; `appliance rm`.

What is pulled: a repository that holds an OpenVINO IR (openvino_model.xml/.bin, config.json, tokenizer.json, as
OpenVINO's own `OpenVINO/*-int4-ov` repositories do) is used as published: its files are downloaded, checked and
described by a manifest (export/ir.py), with neither torch nor transformers. A repository of safetensors weights is
exported with the project's exporter (export/exporter.py, the served weight format of this CPU unless
--weight-format says otherwise) where the export tools are installed; without them the pull stops before
downloading anything, saying what to install.

How, so that a partial download is never served:
- one pull of a repository and revision at a time: a lock file (flock) under the staging folder, held by the
  process that pulls; a second pull waits for it (and then finds the model there). The kernel drops the lock of a
  process that dies.
- free disk space is checked against the sizes the hub reports before anything downloads;
- files download with huggingface_hub into a staging folder (`.staging/` beside the models), which resumes a file
  from its `.incomplete` part: a dropped connection is retried here (RETRIES, each resuming where it stopped), and a
  pull interrupted by anything (a killed process, a vanished client) resumes at the next pull;
- every file is checked against the hub's checksum (the SHA-256 of an LFS file, the git blob id of the others; a
  mismatch deletes the file and fails the pull, so the next one downloads it again);
- the model folder is built beside the download (the weights hard-linked), validated (the IR read and rewritten for
  paged attention, as the runtime will), the manifest written last, and renamed into place in one step
  (appliance/paths.py `pulled_model_dir`); only then is the download deleted.

Where it runs: in its own process, always. `appliance pull` runs it in the CLI's; `/api/pull` in a child process of
the HTTP worker (`python -m appliance.pull --json NAME`, Ollama's status lines on stdout) which the worker relays,
then asks the engine process to serve the model (appliance/server/pulled_models.py). Not in the engine process (a
download or an export would share its GIL and memory with generation, and an export's torch must never enter the
serving processes) and not in the worker itself (which never imports OpenVINO: the IR is validated with it). A
vanished client kills the child: the lock goes with it, the staged files stay for the next pull, nothing half-made
is in the models folder.

Cost, measured on a loaded 2-core box over loopback (tests/test_pull.py's stand-in hub): the default model's int4 IR
(100 MB) pulls in 7.5-9.5 s, of which the SHA-256 of the weights is 0.5 s and reading and checking the IR 1.4 s.

Nothing here downloads unless asked: huggingface_hub is imported only by a pull, with its telemetry off; the hub
is `HF_ENDPOINT` (default https://huggingface.co), the token `HF_TOKEN` (or huggingface_hub's stored login).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from appliance import hub_names, paths
from appliance.hub_names import HubRef
from appliance.manifest import MANIFEST_NAME

DEFAULT_ENDPOINT = "https://huggingface.co"
PR_SET_PDEATHSIG = 1
RECORD = "appliance_pull.json"  # in a pulled model's folder: where it came from, and each file's checksum
RETRIES = 5  # a dropped connection resumes the file this many times before the pull fails
RETRY_SECONDS = 1.0
PROGRESS_SECONDS = 0.25  # how often a download reports its bytes
DISK_MARGIN = 256 << 20  # free space kept beyond the download (side files, the manifest, the filesystem's own)
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


def _hub():
    """huggingface_hub, imported on a pull only: no telemetry, no progress bars of its own (ours report)."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import huggingface_hub
    import huggingface_hub.constants
    import huggingface_hub.errors

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise PullError("HF_HUB_OFFLINE is set: a pull needs the hub", 400)
    return huggingface_hub


# ---------------------------------------------------------------- the pull


def pull(ref: HubRef, emit: Emit, weight_format: str | None = None) -> Path:
    """Pulls `ref` into its folder (paths.pulled_model_dir) and returns it; PullError on anything that stops it."""
    staging = paths.pulled_models_dir() / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    final = paths.pulled_model_dir(ref)
    key = _key(final)
    with _locked(staging / f"{key}.lock", ref.name, emit):
        for stale in staging.glob(f"{glob_escape(key)}.build-*"):  # a killed pull's half-built folder
            shutil.rmtree(stale, ignore_errors=True)
        emit({"status": "pulling manifest"})
        hub = _hub()
        commit, files = _manifest(hub, ref)
        if _current(final, commit):
            for f in _plan(ref, files)[1]:
                emit({**_status(f), "completed": f.size}, f.name)
            for status in ("verifying sha256 digest", "writing manifest", "success"):
                emit({"status": status})
            return final
        kind, wanted = _plan(ref, files)
        download = staging / key
        _check_space(wanted, download, staging)
        _drop_others(download, wanted)
        for f in wanted:
            _download(hub, ref, commit, f, download, emit)
        emit({"status": "verifying sha256 digest"})
        for f in wanted:
            _verify(download, f)
        emit({"status": "writing manifest"})
        build = Path(tempfile.mkdtemp(prefix=f"{key}.build-", dir=staging))
        try:
            build.chmod(0o755)
            source = f"{endpoint()}/{ref.repo}@{commit}"
            if kind == "ir":
                from export.ir import serve_ir
                from export.source import ExportError

                try:
                    serve_ir(download, build, ref.name, source)
                except ExportError as exc:
                    raise PullError(f"{ref.name}: {exc}", 400) from None
            else:
                _export(download, build, ref, source, weight_format)
            record: dict[str, object] = {"repo": ref.repo, "revision": ref.revision, "commit": commit}
            record |= {"endpoint": endpoint(), "pulled_at": datetime.now(timezone.utc).isoformat()}
            record["files"] = {f.name: f.digest for f in wanted}
            (build / RECORD).write_text(json.dumps(record, indent=1) + "\n")
            _install(build, final, staging)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(download, ignore_errors=True)
        emit({"status": "success"})
        return final


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


@contextlib.contextmanager
def _locked(path: Path, name: str, emit: Emit) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            emit({"status": f"waiting for another pull of {name}"})
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _manifest(hub, ref: HubRef) -> tuple[str, list[HubFile]]:
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


def _plan(ref: HubRef, files: list[HubFile]) -> tuple[str, list[HubFile]]:
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


def _have(download: Path, f: HubFile) -> int:
    """Bytes of `f` already downloaded: the whole file, or its resumable part (huggingface_hub names it
    `<hash of the name>.<etag>.incomplete`, beside the file's `.metadata`; the etag is the checksum)."""
    done = download / f.name
    if done.is_file():
        return done.stat().st_size
    parts = (download / ".cache" / "huggingface" / "download" / f.name).parent
    etag = f.sha256 or f.blob_id
    if not etag or not parts.is_dir():
        return 0
    return max((p.stat().st_size for p in parts.glob(f"*.{glob_escape(etag)}.incomplete")), default=0)


def _drop_others(download: Path, wanted: list[HubFile]) -> None:
    """Files an earlier pull of another commit left that this one does not have (a shard since removed): the
    exporter reads every *.safetensors of the folder."""
    if download.is_dir():
        names = {f.name for f in wanted}
        for path in download.rglob("*"):
            relative = path.relative_to(download).as_posix()
            if path.is_file() and not relative.startswith(".cache/") and relative not in names:
                path.unlink()


def _check_space(files: list[HubFile], download: Path, staging: Path) -> None:
    need = sum(max(f.size - _have(download, f), 0) for f in files) + DISK_MARGIN
    free = shutil.disk_usage(staging).free
    if free < need:
        raise PullError(
            f"not enough free disk space in {staging}: the download needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
            "free",
            507,
        )


def _download(hub, ref: HubRef, commit: str, f: HubFile, download: Path, emit: Emit) -> None:
    """One file into `download` (huggingface_hub's local_dir, which resumes its `.incomplete` part), reporting its
    bytes every PROGRESS_SECONDS; a dropped connection is retried RETRIES times, each resuming."""
    status = _status(f)
    with ThreadPoolExecutor(1, thread_name_prefix="pull") as pool:
        for attempt in range(RETRIES + 1):
            job = pool.submit(
                hub.hf_hub_download, ref.repo, f.name, revision=commit, local_dir=download, endpoint=endpoint()
            )
            while not wait([job], timeout=PROGRESS_SECONDS).done:
                emit({**status, "completed": min(_have(download, f), f.size)}, f.name)
            exc = job.exception()
            if exc is None:
                break
            if not _transient(hub, exc):
                raise PullError(f"downloading {f.name}: {str(exc).splitlines()[0]}", 502) from None
            if attempt == RETRIES:
                raise PullError(f"downloading {f.name} failed {RETRIES + 1} times: {exc}", 502) from None
            time.sleep(RETRY_SECONDS)
    emit({**status, "completed": f.size}, f.name)


def _status(f: HubFile) -> dict:
    """Ollama's line for one file: `pulling <12 hex digits>` with the digest and the total bytes."""
    return {"status": f"pulling {f.digest.split(':')[1][:12]}", "digest": f.digest, "total": f.size}


def _transient(hub, exc: BaseException) -> bool:
    """A dropped connection, a timeout, the hub's 5xx or 429: worth resuming. A 4xx (gone, forbidden) is not."""
    if isinstance(exc, hub.errors.HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (OSError, hub.errors.LocalEntryNotFoundError))


def _verify(download: Path, f: HubFile) -> None:
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
        path.unlink()
        (download / ".cache" / "huggingface" / "download" / f"{f.name}.metadata").unlink(missing_ok=True)
        kind = "sha256" if f.sha256 else "sha1"
        raise PullError(
            f"digest mismatch, file must be downloaded again: {f.name} want {kind}:{want} ({f.size} bytes), "
            f"got {kind}:{got} ({size} bytes)",
            502,
        )


def _export(download: Path, build: Path, ref: HubRef, source: str, weight_format: str | None) -> None:
    from export.exporter import export_model
    from export.source import ExportError

    try:
        export_model(download, build, "openvino", weight_format or paths.served_weight_format(), name=ref.name)
    except ExportError as exc:
        raise PullError(f"{ref.name}: exporting the safetensors weights failed: {exc}", 400) from None
    manifest = json.loads((build / MANIFEST_NAME).read_text())
    manifest["source"] = source
    (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _install(build: Path, final: Path, staging: Path) -> None:
    """`build` becomes `final` in one rename; a model pulled before (an older commit) is moved aside first and
    deleted once the new one is in place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix="replaced-", dir=staging)) / "model"
        final.rename(old)
    build.rename(final)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def _current(final: Path, commit: str) -> bool:
    """The model is there, pulled from this commit."""
    try:
        record = json.loads((final / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return record.get("commit") == commit and (final / MANIFEST_NAME).is_file()


def remove(folder: Path) -> bool:
    """Deletes the pulled model in `folder` (paths.pulled_model_dir; False: there is none). Waits for a pull of it
    under way to end first."""
    staging = paths.pulled_models_dir() / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    with _locked(staging / f"{_key(folder)}.lock", folder.name, lambda *a, **k: None):
        if not folder.is_dir():
            return False
        trash = Path(tempfile.mkdtemp(prefix="deleted-", dir=staging))
        folder.rename(trash / "model")  # gone from the models folder at once; deleted below
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the repository's folder, once its last revision is gone
    return True


def _key(folder: Path) -> str:
    """A pulled model's one-level name under the staging folder: its lock, download and build share it."""
    return f"{folder.parent.name}@{folder.name}"


# ---------------------------------------------------------------- the command line


def add_arguments(sub) -> None:
    """`appliance pull` and `appliance rm` (appliance/cli.py)."""
    pull_cmd = sub.add_parser(
        "pull",
        help="download a model from a Hugging Face-compatible hub (HF_ENDPOINT) and make it servable",
        description="Download REPO[:REVISION] (an OpenVINO IR repository as is; safetensors weights exported where "
        "the export tools are installed) into the data dir's models/hub/, checked, then serve it with "
        "`appliance serve --model REPO[:REVISION]`. The hub is $HF_ENDPOINT (default https://huggingface.co), the "
        "token $HF_TOKEN. An interrupted pull resumes.",
    )
    pull_cmd.add_argument("model", help="a hub repository, e.g. OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov[:revision]")
    pull_cmd.add_argument(
        "--weight-format",
        choices=("int4", "int8", "fp16", "fp32"),
        help="safetensors repositories: the export's weight format (default: the one served on this CPU)",
    )
    pull_cmd.add_argument("--json", action="store_true", help="Ollama's status objects on stdout, one a line")
    rm = sub.add_parser(
        "rm",
        help="delete a pulled model",
        description="Delete a model `appliance pull` downloaded (a running server: DELETE /api/delete).",
    )
    rm.add_argument("model", help="the pulled model's name, REPO[:REVISION]")


class _Terminal:
    """Progress on stderr: one line per file, redrawn in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.open = False
        self.last = 0.0

    def __call__(self, event: dict, file: str | None = None) -> None:
        if "completed" not in event:
            self._end()
            print(event["status"], file=sys.stderr, flush=True)
            return
        done, total = event["completed"], event["total"] or 1
        text = f"{event['status']} {file or ''}: {100 * done // total:3d}% {done / 1e6:.1f}/{total / 1e6:.1f} MB"
        if self.tty:
            print(f"\r{text}", end="", file=sys.stderr, flush=True)
            self.open = True
            if done >= total:
                self._end()
        elif done >= total:
            print(text, file=sys.stderr, flush=True)

    def _end(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
            self.open = False


def _json_lines(event: dict, file: str | None = None) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    """`appliance pull` / `appliance rm`: 0 done, 1 failed (one line on stderr; with --json also an error line)."""
    try:
        ref = hub_names.parse(args.model)
    except ValueError as exc:
        return _fail(args, str(exc), 400)
    if args.command == "rm":
        if not remove(paths.pulled_model_dir(ref)):
            return _fail(args, f"no pulled model {ref.name} in {paths.pulled_models_dir()}", 404)
        print(f"deleted {ref.name}", file=sys.stderr)
        return 0
    emit = _json_lines if args.json else _Terminal()
    try:
        folder = pull(ref, emit, args.weight_format)
    except PullError as exc:
        return _fail(args, str(exc), exc.status)
    if not args.json:
        print(f"pulled {ref.name} into {folder}: `appliance serve --model {ref.name}`", file=sys.stderr)
    return 0


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    if getattr(args, "json", False):
        _json_lines({"error": message, "code": status})
    print(f"appliance: {message}", file=sys.stderr)
    return 1


def _stop_with_parent() -> None:
    """The child of a server's /api/pull (appliance/ollama_api/pull.py) ends with the worker that relays it."""
    parent = os.environ.get("APPLIANCE_PULL_PARENT")
    if parent and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != int(parent):  # gone before the line above
            sys.exit(1)


if __name__ == "__main__":  # `python -m appliance.pull --json NAME`: the server's /api/pull runs this
    _stop_with_parent()
    parser = argparse.ArgumentParser(prog="python -m appliance.pull")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    sys.exit(main(parser.parse_args(["pull", *sys.argv[1:]])))
