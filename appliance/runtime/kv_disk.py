"""The prefix cache's disk tier: full KV blocks kept in a local directory, so a prompt prefix survives a restart
of the same export and a working set larger than the RAM pool.

What is stored: every full block the pool names (BlockPool.register) is written through, keyed by its chain name
(the salted BLAKE2b over the namespace root and every token up to the block's end, kv_cache.py), so a later match
that misses RAM finds it here and loads it into a free RAM block instead of recomputing it. Written through, not
only on eviction from RAM: a restart (or a kill -9) would otherwise lose every block that RAM still held.

Layout: <dir>/salt is the chain's salt (16 random bytes, created once with O_EXCL, 0600, owned by the service
user, refused otherwise): names must match across processes, and a client still cannot precompute them (the salt
stays secret on disk). <dir>/<fingerprint>/<name hex>.kv are the blocks of one export: the fingerprint hashes the
export's file names, sizes and mtimes, its JSON files' content (the manifest, the config), the KV element type, the
block size, the cache tensors' layout and the device and inference precision, so another export or setting never
matches. Tenants stay apart
as in RAM: the namespace root is part of every name.

A block file: header (magic, payload length, token count, CRC-32 over name + tokens + payload), the name,
the tokens (int64), the payload (the block's bytes of every key_cache/value_cache tensor, the backend's
read_block). A read checks the length, the checksum, the name and the tokens; a file that fails any check is
deleted and counted (`corrupt`), never handed to the model. Writes go to a temp file (O_EXCL, 0600, the
writer's pid in its name) and are renamed into place, so a reader sees a whole file or none. No fsync: a kill -9
leaves the page cache intact, and a power cut that tears a renamed file is caught by the checksum (an fsync per
block would put the disk's flush latency on the writer for every block, for a crash the checksum already covers).

Writes never stall the step loop: the step copies the block's bytes out (read_block) and a writer thread
checksums and writes them; a full queue (QUEUE_BYTES) drops the write (counted). Measured by bench.kv_disk on
the default model (fp16 export, default KV precision: 32-token blocks of 438 KB), on the 2-core dev box loaded
by other work: the step's copy ~140 us per block and the writer's CPU ~430 us per block, together 0.5% of a run
of unique prompts (every block written); a later run at load average 13-23: 267 + 395 us, 0.51% of the run's
CPU, and the process's CPU for the same prompts tier on / off -0.1% (median of 3).

What it buys (bench.kv_disk, docs/performance.md): a 2,000-token prefix after a restart reaches its first token
in 0.024x the cold prefill's time on the Qwen2.5-1.5B shape (int4; 10 s against 423 s on the loaded box) and
0.048x on the default model; eight 1,024-token prefixes cycled through a RAM pool a quarter their size hit 0% in
RAM alone and 98.5% with the tier (TTFT 0.056x).

Loads never stall the step loop for others: at submission (the requester's thread) the pool names the prompt's
blocks that RAM lacks and `prefetch` hands them to a reader thread, which reads and checks them (file read + CRC:
~0.3 ms per block on the quiet box, 3 ms at a load average of 15) while the request waits for admission; the
admission then takes the checked bytes (`load`) and only copies them into the cache tensors. A block not read
ahead in time (an idle engine admits at once: then nobody else waits) is read at admission as before. Read-ahead
blocks are held up to READY_BYTES (a cancelled request's are forgotten, oldest first).

Bounded (kv_disk_space.py, shared by every model's tier on the directory): the directory holds at most
`max_bytes` (--kv-disk-bytes) across models: before each write the least recently used blocks, of any model, are
evicted until the new file fits, so the directory (its temp file included) never holds more (an in-memory index,
ordered at start by mtime; a hit touches the file so the order survives a restart). Blocks unused for `max_age`
(--kv-disk-max-age) are deleted. A failed or short write publishes nothing, is counted (`kv_disk_write_errors`)
and pauses the directory's writes, with one throttled warning. At start: temp files of dead writers are deleted,
then blocks past the age limit and the least recently used while the directory is over budget.

Static-shape backends (NPU, ONNX Runtime) have no block pool and no prefix cache: the tier is off for them (their
read_block says "not supported"). An NPU's analogue would be saving and restoring a whole slot's KV per
conversation; not built.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path

from appliance.runtime import kv_disk_space
from appliance.runtime.kv_disk_space import SUFFIX, TMP

log = logging.getLogger(__name__)

SALT_FILE = "salt"
SALT_BYTES = 16
MAGIC = b"AKV1"
_HEADER = struct.Struct("<4sQII")  # magic, payload length, token count, CRC-32 of name + tokens + payload
NAME_BYTES = 16
QUEUE_BYTES = 64 << 20  # block bytes waiting for the writer; past it, writes are dropped
READY_BYTES = 64 << 20  # blocks read ahead and not yet taken; past it, the oldest are forgotten
PREFETCH_PENDING = 64  # prompts waiting for the reader; past it, read-ahead is skipped (loads stay synchronous)


def load_salt(directory: Path) -> bytes:
    """The tier's persistent chain salt: created once (O_EXCL, 0600), then read; refused (PermissionError) when
    the file is not ours or others may read it (the names' secrecy rests on it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / SALT_FILE
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileExistsError:
                continue  # another process created it: read theirs
            try:
                salt = os.urandom(SALT_BYTES)
                os.write(fd, salt)
                os.fsync(fd)
            finally:
                os.close(fd)
            return salt
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise PermissionError(f"{path} must be owned by this user and mode 0600")
            salt = os.read(fd, SALT_BYTES + 1)
        finally:
            os.close(fd)
        if len(salt) == SALT_BYTES:
            return salt
        path.unlink(missing_ok=True)  # torn at creation: a new salt (the old blocks never match and age out)
    raise OSError(f"cannot create {path}")


def fingerprint(model_dir: Path, *parts: object) -> str:
    """What a block's bytes depend on: the export's files (names, sizes, mtimes; the JSON files' content: the
    manifest, the model's config) and the caller's parts (KV precision, block size, layout, device, inference
    precision)."""
    h = hashlib.blake2b(digest_size=12)
    for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if f.suffix == ".json" and st.st_size <= 1 << 20:  # the manifest and configs: their content too
            h.update(f.read_bytes())
    for part in parts:
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def _checksum(name: bytes, tokens: bytes, payload: bytes | memoryview) -> int:
    """CRC-32: it catches torn and flipped bytes, which is its job here (the names are already keyed hashes, and
    whoever can write this directory can read the salt anyway); 0.25 ms per 184 KB block against BLAKE2b's 1.1."""
    return zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(name)))


def encode_head(name: bytes, tokens: tuple[int, ...], payload: bytes) -> bytes:
    """A block file's bytes before its payload."""
    toks = array("q", tokens).tobytes()
    return _HEADER.pack(MAGIC, len(payload), len(tokens), _checksum(name, toks, payload)) + name + toks


def encode(name: bytes, tokens: tuple[int, ...], payload: bytes) -> bytes:
    return encode_head(name, tokens, payload) + payload


def decode(data: bytes, name: bytes) -> tuple[tuple[int, ...], bytes] | None:
    """(tokens, payload) of a block file, or None if it is torn, corrupt or another name's."""
    if len(data) < _HEADER.size + NAME_BYTES:
        return None
    magic, length, count, checksum = _HEADER.unpack_from(data)
    start = _HEADER.size + NAME_BYTES + 8 * count
    if magic != MAGIC or len(data) != start + length:
        return None
    view = memoryview(data)
    toks = bytes(view[_HEADER.size + NAME_BYTES : start])
    payload = view[start:]
    if bytes(view[_HEADER.size : _HEADER.size + NAME_BYTES]) != name or _checksum(name, toks, payload) != checksum:
        return None
    return tuple(array("q", toks)), bytes(payload)


class DiskTier:
    """One export's blocks in `directory`/<fp>: `save` (any thread, never blocks), `load` (engine thread)."""

    def __init__(
        self,
        directory: str | Path,
        fp: str,
        max_bytes: int,
        max_age: float = math.inf,  # seconds unused before a block is deleted (the engine: --kv-disk-max-age)
        fsync: bool = False,
    ):
        self.root = Path(directory)
        self.salt = load_salt(self.root)
        self.fp = fp
        self.dir = self.root / fp
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._queued = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._ready: OrderedDict[bytes, tuple[tuple[int, ...], bytes]] = OrderedDict()  # read ahead, checked
        self._ready_bytes = 0
        self._prefetch_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._prefetch_pending = 0
        self.counters = {
            "kv_disk_hit_blocks": 0,
            "kv_disk_hit_tokens": 0,
            "kv_disk_read_bytes": 0,
            "kv_disk_written_bytes": 0,
            "kv_disk_written_blocks": 0,
            "kv_disk_dropped_writes": 0,  # the writer's queue full, or writes paused after a failed one
            "kv_disk_write_errors": 0,  # writes that failed (a full disk, a file-size limit): nothing published
            "kv_disk_corrupt_blocks": 0,
            "kv_disk_evicted_blocks": 0,
            "kv_disk_expired_blocks": 0,  # deleted by the age limit
            "kv_disk_load_seconds": 0.0,  # the engine thread's time in load (reading, when not read ahead)
            "kv_disk_prefetched_blocks": 0,  # blocks the reader thread read ahead of their request's admission
            "kv_disk_copy_seconds": 0.0,  # the step's share of writes: copying blocks out (BlockPool.register)
            "kv_disk_writer_cpu_seconds": 0.0,  # the writer thread's CPU time (checksum, write, rename, evict)
        }
        self.space = kv_disk_space.acquire(self.root, max_bytes, max_age)
        self._thread = threading.Thread(target=self._writer, name="kv-disk-writer", daemon=True)
        self._thread.start()
        self._reader = threading.Thread(target=self._read_ahead, name="kv-disk-reader", daemon=True)
        self._reader.start()

    # ---- engine thread
    def has(self, name: bytes) -> bool:
        """Indexed by this process (written here, or found at start)."""
        return self.space.has((self.fp, name))

    def load(self, name: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """The block's payload, or None (absent, or torn / corrupt: then deleted)."""
        t0 = time.perf_counter()
        path, key = self._path(name), (self.fp, name)
        with self._lock:
            ready = self._ready.pop(name, None)
            if ready is not None:
                self._ready_bytes -= len(ready[1])
        if ready is not None and ready[0] == tuple(tokens):  # read and checked ahead by the reader thread
            self.space.touch(key)
            with contextlib.suppress(OSError):
                os.utime(path)
            self._count_hit(tokens, len(ready[1]), t0)
            return ready[1]
        try:  # not only the indexed names: another process of the same export (a reload) may have written it
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self.space.drop(key)
            return None
        block = decode(data, name)
        if block is None:
            log.warning("kv disk: a corrupt block file was deleted")
            self.counters["kv_disk_corrupt_blocks"] += 1
            path.unlink(missing_ok=True)
            self.space.drop(key)
            return None
        stored, payload = block
        if stored != tuple(tokens):  # a whole file of other tokens under this name (a collision): a miss
            return None
        if self.space.has(key):
            self.space.touch(key)
        else:  # another process's file now counted here: keep the budget
            self.space.add(key, len(data))
            self._count_room(self.space.make_room())
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order and the ages survive a restart
        self._count_hit(tokens, len(data), t0)
        return payload

    def _count_hit(self, tokens: tuple[int, ...], size: int, t0: float) -> None:
        c = self.counters
        c["kv_disk_hit_blocks"] += 1
        c["kv_disk_hit_tokens"] += len(tokens)
        c["kv_disk_read_bytes"] += size
        c["kv_disk_load_seconds"] += time.perf_counter() - t0

    # ---- requester threads ----
    def prefetch(self, blocks: list[tuple[bytes, tuple[int, ...]]]) -> None:
        """Read a prompt's blocks (name, tokens; in chain order, the ones RAM lacks) ahead of its admission, on
        the reader thread: load() then only hands over the checked bytes. Never blocks; skipped when the reader
        is behind."""
        if not blocks or self._prefetch_pending >= PREFETCH_PENDING:
            return
        with self._lock:
            self._prefetch_pending += 1
        self._prefetch_queue.put(blocks)

    # ---- reader thread ----
    def _read_ahead(self) -> None:
        while True:
            blocks = self._prefetch_queue.get()
            if blocks is None:
                return
            try:
                for name, tokens in blocks:
                    if name in self._ready:
                        continue
                    try:
                        with open(self._path(name), "rb") as f:
                            data = f.read()
                    except OSError:
                        break  # the chain stops here: later blocks cannot match without this one
                    block = decode(data, name)
                    if block is None or block[0] != tuple(tokens):
                        break  # load() finds it again, deletes and counts it
                    with self._lock:
                        self._ready[name] = block
                        self._ready_bytes += len(block[1])
                        while self._ready_bytes > READY_BYTES:  # never taken (a RAM hit, a cancel): forget
                            _, (_, old) = self._ready.popitem(last=False)
                            self._ready_bytes -= len(old)
                    self.counters["kv_disk_prefetched_blocks"] += 1
            except Exception:  # a read-ahead is only a hint: the load still reads the file itself
                log.exception("kv disk: read-ahead failed")
            finally:
                with self._lock:
                    self._prefetch_pending -= 1

    def save(self, name: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        """Queue a block for the writer; dropped if the queue is full, writes are paused (a failed one) or the
        block is already stored."""
        if self.space.has((self.fp, name)):
            return
        if (
            self._queued + len(payload) > QUEUE_BYTES
            or len(payload) > self.space.max_bytes
            or not self.space.writable()
        ):
            self.counters["kv_disk_dropped_writes"] += 1
            return
        with self._lock:
            self._queued += len(payload)
        self._queue.put((name, tokens, payload))

    def stats(self) -> dict:
        blocks = (self.space.fp_bytes.get(self.fp, 0), self.space.fp_blocks.get(self.fp, 0))
        return {**self.counters, "kv_disk_bytes": blocks[0], "kv_disk_blocks": blocks[1]}

    def idle(self) -> bool:
        """No read-ahead pending (tests, benchmarks)."""
        return self._prefetch_pending == 0

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until the queued writes are on disk (tests, benchmarks, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._prefetch_queue.put(None)
        self._thread.join(timeout=10)
        self._reader.join(timeout=10)
        kv_disk_space.release(self.space)

    # ---- writer thread
    def _writer(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=kv_disk_space.EXPIRE_SECONDS)
            except queue.Empty:  # idle: the age limit still applies
                self._count_room(self.space.make_room())
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            name, tokens, payload = item
            t0 = time.thread_time()
            try:
                self._write(name, tokens, payload)
            except OSError as exc:  # a full or read-only disk, a file-size limit: nothing published, writes pause
                self.counters["kv_disk_write_errors"] += 1
                self.space.failed(exc)
            finally:
                with self._lock:
                    self._queued -= len(payload)
                self.counters["kv_disk_writer_cpu_seconds"] += time.thread_time() - t0

    def _write(self, name: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        key = (self.fp, name)
        if self.space.has(key):
            return
        if not self.space.writable():
            self.counters["kv_disk_dropped_writes"] += 1
            return
        head = encode_head(name, tokens, payload)
        size = len(head) + len(payload)
        if size > self.space.max_bytes:
            return
        self._count_room(self.space.make_room(size))  # first: the directory stays within budget while writing
        self._seq += 1
        path = self._path(name)
        tmp = path.with_name(f"{path.name}{TMP}{os.getpid()}.{self._seq}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                kv_disk_space.write_all(fd, head)
                kv_disk_space.write_all(fd, payload)
                if self.fsync:
                    os.fsync(fd)
                if os.fstat(fd).st_size != size:
                    raise OSError(errno.EIO, f"{tmp.name} holds {os.fstat(fd).st_size} of {size} bytes")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.space.add(key, size)
        self.counters["kv_disk_written_bytes"] += size
        self.counters["kv_disk_written_blocks"] += 1

    def _count_room(self, counts: tuple[int, int]) -> None:
        self.counters["kv_disk_expired_blocks"] += counts[0]
        self.counters["kv_disk_evicted_blocks"] += counts[1]

    def _path(self, name: bytes) -> Path:
        return self.dir / (name.hex() + SUFFIX)
