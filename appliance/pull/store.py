"""Where a pull puts things (appliance/pull/__init__.py: so that a partial download is never served): the staging
folder (`.staging/` beside the models) with one lock per repository and revision, the download and the build
there, the disk-space check, the finished model renamed into place in one step with its record (RECORD), and its
deletion (`appliance rm`, /api/delete). `pull` runs the steps in order; the hub's side is hub.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from appliance import paths
from appliance.hub_names import HubRef
from appliance.manifest import MANIFEST_NAME
from appliance.pull.hub import (
    Emit,
    HubFile,
    PullError,
    connect,
    endpoint,
    fetch_file,
    file_status,
    glob_escape,
    have,
    hub_manifest,
    plan,
    verify,
)

RECORD = "appliance_pull.json"  # in a pulled model's folder: where it came from, and each file's checksum
DISK_MARGIN = 256 << 20  # free space kept beyond the download (side files, the manifest, the filesystem's own)


def pull(ref: HubRef, emit: Emit, weight_format: str | None = None) -> Path:
    """Pulls `ref` into its folder (paths.pulled_model_dir) and returns it; PullError on anything that stops it."""
    staging = paths.pulled_models_dir() / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    final = paths.pulled_model_dir(ref)
    key = staging_key(final)
    with locked(staging / f"{key}.lock", ref.name, emit):
        for stale in staging.glob(f"{glob_escape(key)}.build-*"):  # a killed pull's half-built folder
            shutil.rmtree(stale, ignore_errors=True)
        emit({"status": "pulling manifest"})
        hub = connect()
        commit, files = hub_manifest(hub, ref)
        if current(final, commit):
            for f in plan(ref, files)[1]:
                emit({**file_status(f), "completed": f.size}, f.name)
            for status in ("verifying sha256 digest", "writing manifest", "success"):
                emit({"status": status})
            return final
        kind, wanted = plan(ref, files)
        download = staging / key
        check_space(wanted, download, staging)
        drop_others(download, wanted)
        for f in wanted:
            fetch_file(hub, ref, commit, f, download, emit)
        emit({"status": "verifying sha256 digest"})
        for f in wanted:
            verify(download, f)
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
                export_weights(download, build, ref, source, weight_format)
            record: dict[str, object] = {"repo": ref.repo, "revision": ref.revision, "commit": commit}
            record |= {"endpoint": endpoint(), "pulled_at": datetime.now(timezone.utc).isoformat()}
            record["files"] = {f.name: f.digest for f in wanted}
            (build / RECORD).write_text(json.dumps(record, indent=1) + "\n")
            install(build, final, staging)
        finally:
            shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(download, ignore_errors=True)
        emit({"status": "success"})
        return final


@contextlib.contextmanager
def locked(path: Path, name: str, emit: Emit) -> Iterator[None]:
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


def drop_others(download: Path, wanted: list[HubFile]) -> None:
    """Files an earlier pull of another commit left that this one does not have (a shard since removed): the
    exporter reads every *.safetensors of the folder."""
    if download.is_dir():
        names = {f.name for f in wanted}
        for path in download.rglob("*"):
            relative = path.relative_to(download).as_posix()
            if path.is_file() and not relative.startswith(".cache/") and relative not in names:
                path.unlink()


def check_space(files: list[HubFile], download: Path, staging: Path) -> None:
    need = sum(max(f.size - have(download, f), 0) for f in files) + DISK_MARGIN
    free = shutil.disk_usage(staging).free
    if free < need:
        raise PullError(
            f"not enough free disk space in {staging}: the download needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
            "free",
            507,
        )


def export_weights(download: Path, build: Path, ref: HubRef, source: str, weight_format: str | None) -> None:
    from export.exporter import export_model
    from export.source import ExportError

    try:
        export_model(download, build, "openvino", weight_format or paths.served_weight_format(), name=ref.name)
    except ExportError as exc:
        raise PullError(f"{ref.name}: exporting the safetensors weights failed: {exc}", 400) from None
    manifest = json.loads((build / MANIFEST_NAME).read_text())
    manifest["source"] = source
    (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def install(build: Path, final: Path, staging: Path) -> None:
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


def current(final: Path, commit: str) -> bool:
    """The model is there, pulled from this commit."""
    try:
        record = json.loads((final / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return record.get("commit") == commit and (final / MANIFEST_NAME).is_file()


def remove(folder: Path) -> bool:
    """Deletes the pulled model in `folder` (paths.pulled_model_dir) and what a pull of it left in the staging
    folder (a download to resume, a half-built folder); False: there was neither. Waits for a pull of it under way
    to end first."""
    staging = paths.pulled_models_dir() / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    key = staging_key(folder)
    with locked(staging / f"{key}.lock", folder.name, lambda *a, **k: None):
        found = False
        for partial in [staging / key, *staging.glob(f"{glob_escape(key)}.build-*")]:
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
                found = True
        if folder.is_dir():
            trash = Path(tempfile.mkdtemp(prefix="deleted-", dir=staging))
            folder.rename(trash / "model")  # gone from the models folder at once; deleted below
            shutil.rmtree(trash, ignore_errors=True)
            found = True
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the repository's folder, once its last revision is gone
    return found


def staging_key(folder: Path) -> str:
    """A pulled model's one-level name under the staging folder: its lock, download and build share it."""
    return f"{folder.parent.name}@{folder.name}"
