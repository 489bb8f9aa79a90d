"""One disk tier directory's bounds, shared by every model's tier on it in this process (kv_disk.py): the size
budget, the age limit, and what a failed write does.

Why shared: each model's engine has its own DiskTier (its own fingerprint sub-directory), and the operator gives one
`--kv-disk-dir` and one `--kv-disk-bytes`. A budget per tier let two models on one directory hold 1.9x the budget,
and a tier that started after another had filled the directory was left with no room and wrote nothing, silently.
Here one index covers every block file of the directory, least recently used first across models, so a write
evicts whichever model's coldest block and the directory never holds more than the budget (the smallest budget any
of its tiers asked for).

The age limit (`--kv-disk-max-age`): a block not used for that long is deleted (at start, before each write, and
every EXPIRE_SECONDS while idle), so a prompt nobody sends again does not stay on disk for ever (a deleted stored
response's prompt included: the tier cannot tell whose blocks a deletion means, the chain's names being keyed
hashes, so the age limit is what bounds it). "Used" is written or loaded: a hit touches the file's mtime, so the
order and the ages survive a restart.

A failed write (a full disk, a file-size limit, an I/O error): the temp file is deleted, the failure counted, and
the directory's writes pause for PAUSE_SECONDS (each block would fail the same way); one warning per WARN_SECONDS
says how many failed since the last one. Short writes are written on until complete or failed (`write_all`), and
the file's size is checked before it is renamed into place, so a truncated block is never published or counted.

One process per directory keeps the bounds exact: another process's files are counted only as they are met (at
start, or when a tier loads one).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("appliance.runtime.kv_disk")

SUFFIX = ".kv"
TMP = ".tmp."
PAUSE_SECONDS = 60.0  # writes paused after a failed one (a full disk fails every block the same way)
WARN_SECONDS = 300.0  # at most one warning about failed writes per this, per directory
EXPIRE_SECONDS = 60.0  # how often an idle writer drops blocks past the age limit
DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}

Key = tuple[str, bytes]  # (fingerprint, block name)

_dirs: dict[Path, DiskSpace] = {}
_dirs_lock = threading.Lock()


def acquire(root: Path, max_bytes: int, max_age: float) -> DiskSpace:
    """The directory's shared bounds (created and scanned by its first tier); `release` when the tier closes."""
    key = root.resolve()
    with _dirs_lock:
        space = _dirs.get(key)
        if space is None:
            space = _dirs[key] = DiskSpace(key, max_bytes, max_age)
        else:
            space.tighten(max_bytes, max_age)
        space.users += 1
    space.trim()
    return space


def release(space: DiskSpace) -> None:
    with _dirs_lock:
        space.users -= 1
        if space.users <= 0 and _dirs.get(space.root) is space:
            del _dirs[space.root]


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Every byte of `data`, or OSError: a short write is continued, and one that writes nothing is a full disk."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")
        view = view[n:]


class DiskSpace:
    def __init__(self, root: Path, max_bytes: int, max_age: float):
        self.root, self.max_bytes, self.max_age = root, max_bytes, max_age
        self.users = 0
        self.lock = threading.Lock()
        self.index: OrderedDict[Key, tuple[int, float]] = OrderedDict()  # -> (bytes, last use), LRU first
        self.bytes = 0
        self.fp_bytes: dict[str, int] = {}
        self.fp_blocks: dict[str, int] = {}
        self.paused_until = 0.0
        self._failed = 0  # failed writes since the last warning
        self._warned = -WARN_SECONDS
        self._scan()

    def tighten(self, max_bytes: int, max_age: float) -> None:
        self.max_bytes, self.max_age = min(self.max_bytes, max_bytes), min(self.max_age, max_age)

    def path(self, key: Key) -> Path:
        return self.root / key[0] / (key[1].hex() + SUFFIX)

    # ---- the index
    def has(self, key: Key) -> bool:
        return key in self.index

    def add(self, key: Key, size: int) -> None:
        with self.lock:
            self._add(key, size, time.time())

    def touch(self, key: Key) -> None:
        with self.lock:
            if key in self.index:
                self.index[key] = (self.index[key][0], time.time())
                self.index.move_to_end(key)

    def drop(self, key: Key) -> None:
        with self.lock:
            self._pop(key)

    def _add(self, key: Key, size: int, used: float) -> None:
        if key in self.index:
            return
        self.index[key] = (size, used)
        self.bytes += size
        self.fp_bytes[key[0]] = self.fp_bytes.get(key[0], 0) + size
        self.fp_blocks[key[0]] = self.fp_blocks.get(key[0], 0) + 1

    def _pop(self, key: Key | None = None) -> Key | None:
        if key is None:
            if not self.index:
                return None
            key, (size, _) = self.index.popitem(last=False)
        else:
            entry = self.index.pop(key, None)
            if entry is None:
                return None
            size = entry[0]
        self.bytes -= size
        self.fp_bytes[key[0]] -= size
        self.fp_blocks[key[0]] -= 1
        return key

    # ---- the bounds
    def make_room(self, room: int = 0) -> tuple[int, int]:
        """Blocks past the age limit deleted, then the least recently used until `room` more bytes fit the budget:
        (expired, evicted)."""
        expired = evicted = 0
        horizon = time.time() - self.max_age
        while True:
            with self.lock:
                head = next(iter(self.index.items()), None)
                if head is None:
                    break
                old = head[1][1] < horizon
                if not old and self.bytes + room <= self.max_bytes:
                    break
                key = self._pop()
            if key is None:
                break
            self.path(key).unlink(missing_ok=True)
            if old:
                expired += 1
            else:
                evicted += 1
        return expired, evicted

    def trim(self) -> None:
        self.make_room()

    # ---- failed writes
    def writable(self) -> bool:
        return time.monotonic() >= self.paused_until

    def failed(self, exc: OSError) -> None:
        """A write failed: pause the directory's writes, warn at most once per WARN_SECONDS."""
        now = time.monotonic()
        with self.lock:
            self.paused_until = now + PAUSE_SECONDS
            self._failed += 1
            if now - self._warned < WARN_SECONDS:
                return
            self._warned, count, self._failed = now, self._failed, 0
        full = exc.errno in DISK_FULL
        log.warning(
            "kv disk: writes failed, paused",
            extra={
                "dir": str(self.root),
                "error": str(exc),
                "disk_full": full,
                "failed_since_last_warning": count,
                "pause_seconds": PAUSE_SECONDS,
            },
        )

    # ---- start-up
    def _scan(self) -> None:
        """Index every block file of the directory by mtime (oldest first); delete dead writers' temp files."""
        found: list[tuple[float, int, Key]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub.is_symlink():
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if TMP in f.name:
                    pid = f.name.rsplit(TMP, 1)[1].split(".")[0]
                    if not pid.isdigit() or int(pid) == os.getpid() or not _alive(int(pid)):
                        f.unlink(missing_ok=True)
                    continue
                if not f.name.endswith(SUFFIX):
                    continue
                try:
                    name = bytes.fromhex(f.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                found.append((st.st_mtime, st.st_size, (sub.name, name)))
        with self.lock:
            for used, size, key in sorted(found):
                self._add(key, size, used)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
