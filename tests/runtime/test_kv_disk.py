"""The prefix cache's disk tier (appliance/runtime/kv_disk.py): the tier alone (round trip, corrupt and torn
files ignored, the budget, the fingerprint, the salt), the pool's hooks with a fake backend (restart, tenants),
and the engine in f32 on the fp32 export: a prefix loaded back from disk yields the same greedy tokens as
recomputing it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.kv_disk import SALT_FILE, DiskTier, fingerprint, load_salt

ROOT = Path(__file__).resolve().parents[2]
BS = 4
PAYLOAD = 1000  # bytes of a fake block


def payload(i: int) -> bytes:
    return bytes([i % 251]) * PAYLOAD


def stored(tier: DiskTier) -> list[Path]:
    return sorted(tier.dir.glob("*.kv"))


def in_child(directory: Path, code: str, limit: int | None = None, prefix: tuple[str, ...] = ()) -> dict:
    """`code` in another Python process (run through `prefix`) with `d` (the directory) and DiskTier at hand,
    under a file-size limit if given (RLIMIT_FSIZE: a write past it is cut short, then fails with EFBIG); `out`
    (its last stdout line, JSON) and its stderr."""
    script = (
        "import json, logging, resource, sys\nfrom pathlib import Path\n"
        "from appliance.runtime.kv_disk import DiskTier\n"
        "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s %(failed_since_last_warning)s')\n"
        f"d = Path({str(directory)!r})\n"
        + (f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))\n" if limit else "")
        + code
        + "\nprint(json.dumps(dict(locals().get('out') or {})))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    return {"out": json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


def test_round_trip(tmp_path):
    tier = DiskTier(tmp_path, "fp", 1 << 20)
    name, tokens = b"n" * 16, (1, 2, 3, 4)
    tier.save(name, tokens, payload(7))
    tier.flush()
    assert tier.load(name, tokens) == payload(7)
    assert tier.load(name, (1, 2, 3, 5)) is None  # another block's tokens under that name: never handed out
    assert tier.load(b"m" * 16, tokens) is None
    s = tier.stats()
    assert s["kv_disk_hit_blocks"] == 1 and s["kv_disk_hit_tokens"] == 4 and s["kv_disk_written_blocks"] == 1
    assert stat.S_IMODE(stored(tier)[0].stat().st_mode) == 0o600
    tier.close()


def test_a_block_another_process_wrote_is_found(tmp_path):
    """Two processes of one export on one directory (a reload overlapping the old engine): the reader's index
    predates the file, the file is still found."""
    reader = DiskTier(tmp_path, "fp", 1 << 20)
    in_child(tmp_path, "tier = DiskTier(d, 'fp', 1 << 20)\ntier.save(b'n' * 16, (1,), bytes([3]) * 1000)\ntier.close()")
    assert not reader.has(b"n" * 16)
    assert reader.load(b"n" * 16, (1,)) == payload(3) and reader.has(b"n" * 16)
    reader.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_or_torn_block_is_ignored_and_deleted(tmp_path, damage):
    tier = DiskTier(tmp_path, "fp", 1 << 20)
    name, tokens = b"n" * 16, (1, 2, 3, 4)
    tier.save(name, tokens, payload(7))
    tier.flush()
    tier.close()
    path = stored(tier)[0]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    path.write_bytes(bytes(data[: len(data) // 2] if damage == "truncate" else b"" if damage == "empty" else data))
    again = DiskTier(tmp_path, "fp", 1 << 20)
    assert again.has(name)
    assert again.load(name, tokens) is None
    assert not path.exists() and not again.has(name)
    assert again.stats()["kv_disk_corrupt_blocks"] == 1
    again.close()


def test_dead_writers_temp_files_are_cleaned(tmp_path):
    tier = DiskTier(tmp_path, "fp", 1 << 20)
    tier.close()
    dead = tier.dir / ("ab" * 16 + ".kv.tmp.999999999.1")  # no such pid
    dead.write_bytes(b"half a block")
    DiskTier(tmp_path, "fp", 1 << 20).close()
    assert not dead.exists()


def test_budget_is_never_exceeded(tmp_path):
    budget = 5 * PAYLOAD
    tier = DiskTier(tmp_path, "fp", budget)
    for i in range(20):
        tier.save(bytes([i]) * 16, (i,), payload(i))
    tier.flush()
    on_disk = sum(p.stat().st_size for p in stored(tier))
    assert 0 < on_disk <= budget and tier.stats()["kv_disk_bytes"] == on_disk
    assert tier.stats()["kv_disk_evicted_blocks"] > 0
    assert tier.load(bytes([19]) * 16, (19,)) == payload(19)  # the newest stayed, the oldest went
    assert not tier.has(bytes([0]) * 16)
    tier.close()
    # another fingerprint's start trims the old one's blocks (oldest first) to fit the whole directory's budget
    other = DiskTier(tmp_path, "other", budget)
    for i in range(3):
        other.save(bytes([100 + i]) * 16, (i,), payload(i))
    other.flush()
    total = sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))
    assert total <= budget
    other.close()
    assert DiskTier(tmp_path, "fp", budget).stats()["kv_disk_bytes"] + other.stats()["kv_disk_bytes"] <= budget


def test_directory_never_exceeds_its_budget_even_while_writing(tmp_path, monkeypatch):
    """Measured at the moment each block file lands (the rename), with the temp file counted: eviction must make
    room before a write, not trim after it."""
    import appliance.runtime.kv_disk as kv_disk

    budget = 5 * (PAYLOAD + 100)
    peak = []
    real_replace = os.replace

    def replace(src, dst):
        peak.append(sum(p.stat().st_size for p in Path(dst).parent.iterdir()))  # the temp file, whole
        real_replace(src, dst)
        peak.append(sum(p.stat().st_size for p in Path(dst).parent.iterdir()))

    monkeypatch.setattr(kv_disk.os, "replace", replace)
    tier = DiskTier(tmp_path, "fp", budget)
    for i in range(12):
        tier.save(bytes([i]) * 16, (i,), payload(i))
    tier.flush()
    tier.close()
    assert len(peak) == 24 and max(peak) <= budget, (max(peak), budget)
    assert tier.stats()["kv_disk_evicted_blocks"] >= 7


def test_models_on_one_directory_share_its_budget_and_a_restart_leaves_each_room(tmp_path):
    """Two models' tiers (two fingerprints) on one directory: together they never hold more than the budget (one
    least-recently-used order across them), and after a restart the model that starts second still writes: the
    first one's older blocks make room."""
    budget = 10 * (PAYLOAD + 200)

    def fill(a: DiskTier, b: DiskTier, base: int) -> None:
        for i in range(20):
            for tier, offset in ((a, 0), (b, 100)):
                tier.save(bytes([base + offset + i]) * 16, (i,), payload(i))
                tier.flush()
                total = sum(f.stat().st_size for f in tmp_path.glob("*/*.kv"))
                assert total <= budget, (total, budget)

    a, b = DiskTier(tmp_path, "model-a", budget), DiskTier(tmp_path, "model-b", budget)
    fill(a, b, 0)
    assert a.stats()["kv_disk_bytes"] + b.stats()["kv_disk_bytes"] <= budget
    a.close()
    b.close()
    a, b = DiskTier(tmp_path, "model-a", budget), DiskTier(tmp_path, "model-b", budget)
    fill(a, b, 30)
    assert b.stats()["kv_disk_written_blocks"] == 20 and a.stats()["kv_disk_written_blocks"] == 20
    assert b.stats()["kv_disk_blocks"] >= 4 and a.stats()["kv_disk_blocks"] >= 4  # both keep their newest
    a.close()
    b.close()


def test_blocks_unused_past_the_age_limit_are_deleted(tmp_path):
    """At start (by the files' mtimes, which a hit refreshes) and while running (before each write)."""
    tier = DiskTier(tmp_path, "fp", 1 << 20)
    for i in range(3):
        tier.save(bytes([i]) * 16, (i,), payload(i))
    tier.flush()
    tier.close()
    old = time.time() - 7200
    for f in stored(tier)[:2]:
        os.utime(f, (old, old))
    again = DiskTier(tmp_path, "fp", 1 << 20, max_age=3600)
    assert len(stored(again)) == 1 and again.stats()["kv_disk_blocks"] == 1
    again.close()
    quick = DiskTier(tmp_path, "fp", 1 << 20, max_age=0.5)
    quick.save(b"a" * 16, (1,), payload(1))
    quick.flush()
    written = time.time()
    while time.time() < written + 0.6:  # the condition itself: the block's age passing the limit
        time.sleep(0.05)
    quick.save(b"b" * 16, (2,), payload(2))
    quick.flush()
    assert not quick.has(b"a" * 16) and quick.has(b"b" * 16)
    assert [f.name for f in stored(quick)] == [(b"b" * 16).hex() + ".kv"]
    assert quick.stats()["kv_disk_expired_blocks"] >= 1
    quick.close()


def test_short_writes_publish_nothing_pause_the_tier_and_warn_once(tmp_path):
    """A file-size limit below a block's size (RLIMIT_FSIZE, in a child process): each write is cut short. No
    truncated block is published or counted as written; the failure is counted, further writes pause, and one
    warning says so."""
    code = (
        "tier = DiskTier(d, 'fp', 1 << 30)\n"
        "for i in range(50):\n"
        "    tier.save(bytes([i]) * 16, (i,), bytes([i]) * 300_000)\n"
        "tier.close()\n"
        "out = tier.stats()"
    )
    child = in_child(tmp_path, code, limit=200_000)
    stats = child["out"]
    assert stats["kv_disk_written_blocks"] == 0 and stats["kv_disk_bytes"] == 0, stats
    assert stats["kv_disk_write_errors"] >= 1, stats
    assert stats["kv_disk_write_errors"] + stats["kv_disk_dropped_writes"] == 50, stats
    assert list(tmp_path.glob("fp/*")) == []  # neither a truncated block nor a temp file
    warnings = [line for line in child["stderr"].splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "writes failed, paused" in warnings[0], child["stderr"]


def test_a_full_disk_stops_the_writes_with_one_warning(tmp_path):
    """A real full filesystem: a 1 MiB tmpfs mounted in a private mount namespace (`unshare -m`), a budget far
    larger than the disk. The blocks that fit are whole and readable; the first ENOSPC pauses the writes, with one
    warning and the failure counted."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("unshare -m is not permitted here")
        pytest.skip("unshare -m is not permitted here (no mount namespace for a small tmpfs)")
    disk = tmp_path / "disk"
    disk.mkdir()
    code = (
        "tier = DiskTier(d, 'fp', 1 << 30)\n"
        "for i in range(20):\n"
        "    tier.save(bytes([i]) * 16, (i,), bytes([i]) * 200_000)\n"
        "    tier.flush()\n"
        "names = sorted(p.name for p in (d / 'fp').iterdir())\n"
        "loaded = [tier.load(bytes.fromhex(n[:-3]), (bytes.fromhex(n[:-3])[0],)) is not None for n in names]\n"
        "tier.close()\n"
        "out = {**tier.stats(), 'names': names, 'loaded': loaded}"
    )
    mount = f"mount -t tmpfs -o size=1m tmpfs {disk} && exec \"$0\" \"$@\""
    child = in_child(disk, code, prefix=("unshare", "-m", "sh", "-c", mount))
    stats = child["out"]
    assert 1 <= stats["kv_disk_written_blocks"] <= 5, stats
    assert (
        stats["kv_disk_write_errors"] >= 1
        and stats["kv_disk_write_errors"] + stats["kv_disk_dropped_writes"] + (stats["kv_disk_written_blocks"]) == 20
    ), stats
    assert len(stats["names"]) == stats["kv_disk_written_blocks"] and all(stats["loaded"]), stats
    warnings = [line for line in child["stderr"].splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "writes failed, paused" in warnings[0], child["stderr"]


def test_fingerprint_mismatch_never_matches(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "manifest.json").write_text('{"a": 1}')
    (model / "openvino_model.bin").write_bytes(b"w" * 10)
    fp = fingerprint(model, "layout", 32, "u8")
    assert fp == fingerprint(model, "layout", 32, "u8")
    assert fp != fingerprint(model, "layout", 16, "u8") != fingerprint(model, "layout", 32, "f16")
    (model / "openvino_model.bin").write_bytes(b"w" * 11)  # another export's weights
    assert fingerprint(model, "layout", 32, "u8") != fp
    a = DiskTier(tmp_path / "kv", fp, 1 << 20)
    a.save(b"n" * 16, (1,), payload(1))
    a.close()
    b = DiskTier(tmp_path / "kv", fingerprint(model, "layout", 32, "u8"), 1 << 20)
    assert not b.has(b"n" * 16) and b.load(b"n" * 16, (1,)) is None
    b.close()


def test_salt_is_persisted_private(tmp_path):
    salt = load_salt(tmp_path)
    path = tmp_path / SALT_FILE
    assert len(salt) == 16 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_salt(tmp_path) == salt  # the same names after a restart
    assert load_salt(tmp_path / "elsewhere") != salt
    os.chmod(path, 0o644)  # readable by others: names could be precomputed
    with pytest.raises(PermissionError):
        load_salt(tmp_path)


class FakeKV:
    """A backend's block memory: block id -> bytes."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def read(self, block: int) -> bytes:
        return self.blocks.get(block, b"\0" * PAYLOAD)

    def write(self, block: int, data: bytes) -> None:
        self.blocks[block] = data


def pool_with_disk(tmp_path: Path, num_blocks: int = 4) -> tuple[BlockPool, FakeKV, DiskTier]:
    tier = DiskTier(tmp_path, "fp", 1 << 20)
    pool = BlockPool(num_blocks, BS, prefix_caching=True, salt=tier.salt)
    kv = FakeKV()
    pool.attach_disk(tier, kv.read, kv.write)
    return pool, kv, tier


def compute(pool: BlockPool, kv: FakeKV, tokens: list[int], scope: str = "") -> list[int]:
    """What the scheduler and a forward do for a prompt: allocate, 'compute' each block (its bytes derive from
    its tokens), name the full blocks, and free them."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    parent = pool.root(scope)
    for j, b in enumerate(blocks):
        chunk = tuple(tokens[j * BS : (j + 1) * BS])
        kv.write(b, bytes([sum(chunk) % 251]) * PAYLOAD)
        if len(chunk) == BS:
            parent = pool.register(b, parent, chunk)
    pool.free(blocks)
    return blocks


def test_pool_loads_a_prefix_from_disk_after_a_restart_within_its_namespace(tmp_path):
    prompt = list(range(1, 14))  # 3 full blocks + 1
    pool, kv, tier = pool_with_disk(tmp_path)
    compute(pool, kv, prompt, scope="key-a")
    tier.close()
    # a new process: a new pool (empty RAM), the same directory
    pool, kv, tier = pool_with_disk(tmp_path)
    assert pool.match_prefix(prompt, scope="key-b") == ([], [])  # another tenant's blocks are not found
    blocks, hashes = pool.match_prefix(prompt, scope="key-a")
    assert len(blocks) == 3 and tier.stats()["kv_disk_hit_blocks"] == 3
    for j, b in enumerate(blocks):  # the stored bytes are back in the blocks the pool picked
        assert kv.blocks[b] == bytes([sum(prompt[j * BS : (j + 1) * BS]) % 251]) * PAYLOAD
    pool.free(blocks)
    again, _ = pool.match_prefix(prompt, scope="key-a")  # now RAM hits: no second load
    assert again == blocks and tier.stats()["kv_disk_hit_blocks"] == 3
    tier.close()


def test_a_prompt_s_blocks_are_read_ahead_off_the_engine_thread(tmp_path):
    """prefetch (at submission, the requester's thread) reads and checks the blocks RAM lacks on the reader
    thread; the admission's match then takes them without touching a file (here: the files are gone by then),
    and another tenant's prompt reads nothing ahead."""
    import time

    prompt = list(range(1, 14))  # 3 full blocks + 1
    pool, kv, tier = pool_with_disk(tmp_path)
    compute(pool, kv, prompt, scope="key-a")
    tier.close()
    pool, kv, tier = pool_with_disk(tmp_path)

    def read_ahead(scope: str) -> int:
        pool.prefetch(prompt, scope=scope)
        deadline = time.monotonic() + 10
        while not tier.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        return tier.stats()["kv_disk_prefetched_blocks"]

    assert read_ahead("key-b") == 0
    assert read_ahead("key-a") == 3
    for f in stored(tier):
        f.unlink()
    blocks, _ = pool.match_prefix(prompt, scope="key-a")
    assert len(blocks) == 3 and tier.stats()["kv_disk_hit_blocks"] == 3
    for j, b in enumerate(blocks):
        assert kv.blocks[b] == bytes([sum(prompt[j * BS : (j + 1) * BS]) % 251]) * PAYLOAD
    pool.free(blocks)
    tier.close()


def test_admission_reuses_the_names_prefetch_hashed(tmp_path, monkeypatch):
    """A prompt's chain is hashed once: prefetch (submission) returns its names and match_prefix (admission)
    takes them without hashing again; a chain of another namespace or pool is not taken (hashed afresh, so
    the answer is what it would be without one), and tokens past the chain's end (a preempted sequence's
    generated ones) are hashed as before."""
    import time

    from appliance.runtime import kv_cache

    prompt = list(range(1, 14))  # 3 full blocks + 1
    pool, kv, tier = pool_with_disk(tmp_path, num_blocks=8)
    compute(pool, kv, prompt + [14, 15, 16, 17], scope="key-a")  # 4 full blocks stored
    tier.close()
    pool, kv, tier = pool_with_disk(tmp_path, num_blocks=8)
    real, calls = kv_cache.chain_hash, [0]

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(kv_cache, "chain_hash", counted)
    chain = pool.prefetch(prompt, scope="key-a")
    assert chain is not None and len(chain.names) == 3 and calls[0] == 3
    deadline = time.monotonic() + 10
    while not tier.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    blocks, names = pool.match_prefix(prompt, "key-a", chain)
    assert len(blocks) == 3 and names == chain.names and calls[0] == 3  # nothing hashed at admission
    pool.free(blocks)
    assert pool.match_prefix(prompt, "key-b", chain) == ([], []) and calls[0] == 4  # its own root: a miss
    stranger = BlockPool(8, BS, prefix_caching=True).prefetch(prompt, "key-a")
    assert stranger is None  # no disk tier: prefetch computes nothing and admission hashes
    foreign = kv_cache.BlockChain(b"x" * 16, "key-a", [b"y" * 16] * 3)  # another pool's names
    again, again_names = pool.match_prefix(prompt, "key-a", foreign)
    assert again == blocks and again_names == chain.names and calls[0] == 7
    pool.free(again)
    longer, longer_names = pool.match_prefix(prompt + [14, 15, 16, 17, 18], "key-a", chain)
    assert len(longer) == 4 and longer_names[:3] == chain.names and calls[0] == 8  # only the 4th block hashed
    pool.free(longer)
    tier.close()


def test_pool_without_free_blocks_recomputes(tmp_path):
    prompt = list(range(1, 14))
    pool, kv, tier = pool_with_disk(tmp_path, num_blocks=4)
    compute(pool, kv, prompt)
    tier.flush()
    pool2 = BlockPool(4, BS, prefix_caching=True, salt=tier.salt)
    pool2.attach_disk(tier, kv.read, kv.write)
    held = pool2.allocate(4)
    assert pool2.match_prefix(prompt) == ([], [])  # nowhere to load into: a miss, nothing breaks
    pool2.free(held)
    tier.close()


# ---------------------------------------------------------------- the engine, f32 on the fp32 export


def engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[int]]:
    from appliance.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    tokens, cached = [], []
    for p in prompts:  # one after another; cached: the prompt tokens served from the cache (RAM or disk)
        hits = engine.stats()["prefix_cache_hit_tokens"]
        tokens.append(engine.submit(p, params).results()[0].token_ids)
        cached.append(engine.stats()["prefix_cache_hit_tokens"] - hits)
    return tokens, cached


@pytest.fixture(scope="module")
def fp32_export() -> Path:
    from export.default_model import ensure_export

    return ensure_export("openvino", "fp32")


def test_engine_prefix_loaded_from_disk_keeps_greedy_tokens(fp32_export, tmp_path, monkeypatch):
    """f32: a prefix evicted from a tiny RAM pool and loaded back from disk, and after a restart, yields exactly
    the tokens of recomputing it (an engine without the tier); the cached-token count shows the disk hit, and
    the prompt's blocks are named once, by the submitter's prefetch (the admission reuses the names)."""
    import threading

    from appliance.config import EngineConfig
    from appliance.runtime import kv_cache
    from appliance.runtime.engine import Engine

    cfg = dict(precision="f32", max_num_batched_tokens=64, kv_cache_tokens=32 * 8)
    shared = list(range(1000, 1130))  # 4 full 32-token blocks
    prompt, other = shared + [5, 6, 7], list(range(3000, 3200))  # `other` fills the pool: evicts the prefix
    cold = Engine(fp32_export, EngineConfig(**cfg))
    try:
        want, cached = engine_greedy(cold, [prompt], 16)
    finally:
        cold.shutdown()
    assert cached == [0]
    engine = Engine(fp32_export, EngineConfig(**cfg, kv_disk_dir=str(tmp_path)))
    try:
        first, _ = engine_greedy(engine, [prompt, other], 16)
        got, cached = engine_greedy(engine, [prompt], 16)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == want and first[0] == want[0]
    assert stats["kv_disk_hit_blocks"] >= 3 and cached == [128], stats  # most of it came back from disk
    restarted = Engine(fp32_export, EngineConfig(**cfg, kv_disk_dir=str(tmp_path)))
    hashed_on: list[str] = []  # the threads that name blocks: the submitter only (its prefetch), never again
    real = kv_cache.chain_hash
    monkeypatch.setattr(
        kv_cache, "chain_hash", lambda *a: hashed_on.append(threading.current_thread().name) or real(*a)
    )
    try:
        got, cached = engine_greedy(restarted, [prompt], 16)
        stats = restarted.stats()
    finally:
        restarted.shutdown()
    assert got == want and cached == [128] and stats["kv_disk_hit_blocks"] == 4, stats
    assert hashed_on == [threading.current_thread().name] * 4, hashed_on


@pytest.mark.default_model  # sibling exports of the default model (int8, int4), as `make model` builds them
def test_sibling_exports_and_kv_precisions_never_share_blocks_on_one_directory(tmp_path):
    """One --kv-disk-dir, real engines one after another (as restarts with another model or setting): the int8
    export writes a prompt's blocks; then its sibling int4 export (same folder parent, same KV layout), and the
    int8 export with another KV precision, each find none of them (0 disk hits, 0 cached tokens) and give the
    greedy tokens of their own cold run without the tier. A namespace without the export's identity or the KV
    precision would load another's KV: wrong output, no error."""
    from appliance.config import EngineConfig
    from appliance.runtime.engine import Engine
    from export.default_model import ensure_export

    int8, int4 = ensure_export("openvino", "int8"), ensure_export("openvino", "int4")
    assert int8.parent == int4.parent
    prompt = list(range(1000, 1100))  # 3 full 32-token blocks and a tail
    base = dict(max_num_batched_tokens=64, kv_cache_tokens=32 * 8)

    def run(export: Path, **cfg) -> tuple[list[int], int, dict]:
        engine = Engine(export, EngineConfig(**base, **cfg))
        try:
            tokens, cached = engine_greedy(engine, [prompt], 8)
            if engine.pool.disk is not None:
                engine.pool.disk.flush()
            return tokens[0], cached[0], engine.stats()
        finally:
            engine.shutdown()

    disk = str(tmp_path / "kv")
    _, _, stats = run(int8, kv_cache_precision="u8", kv_disk_dir=disk)
    assert stats["kv_disk_written_blocks"] >= 3, stats
    _, cached, stats = run(int8, kv_cache_precision="u8", kv_disk_dir=disk)
    assert cached >= 96 and stats["kv_disk_hit_blocks"] >= 3, stats  # the same export and setting: found
    for export, precision in ((int4, "u8"), (int8, "f16")):
        cold, _, _ = run(export, kv_cache_precision=precision)
        tokens, cached, stats = run(export, kv_cache_precision=precision, kv_disk_dir=disk)
        assert stats["kv_disk_hit_blocks"] == 0 and cached == 0, (export.name, precision, stats)
        assert tokens == cold, (export.name, precision)


# ---------------------------------------------------------------- a real `appliance serve`, restarted

SHARED = "You are a careful assistant for a hardware store. " + " ".join(
    f"Rule {i}: answer about aisle {i % 17} and item number {i * 37}." for i in range(40)
)  # ~600 tokens: many full blocks


def completion(srv, prompt: str) -> tuple[str, int]:
    import requests

    r = requests.post(
        srv.base + "/v3/completions",
        json={"model": srv.model_id(), "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restarted_server_finds_the_prefix_on_disk_and_never_uses_a_corrupt_block(model_dir, tmp_path):
    """Two real servers with one --kv-disk-dir: the second's first request is served from disk (cached_tokens);
    then a kill -9 (queued writes may be lost or half written), every stored block corrupted and a torn temp file
    left: the third server uses none of them (cached_tokens 0, the cold answer) and counts them corrupt."""
    from appliance.testing.procinfo import is_zombie
    from tests.helpers import Server, wait_until

    disk = tmp_path / "kv"
    flags = ("--workers", "1", "--kv-disk-dir", str(disk))
    with Server(model_dir, tmp_path / "a.log", *flags) as srv:
        cold, cached = completion(srv, SHARED + " Question: where are the hammers?")
        assert cached == 0
    with Server(model_dir, tmp_path / "b.log", *flags) as srv:
        warm, cached = completion(srv, SHARED + " Question: where are the hammers?")
        assert cached >= 512, cached  # the prefix came from disk after the restart
        assert srv.metrics()["appliance_kv_disk_hit_tokens_total"] == cached
        completion(srv, SHARED + " Question: do you sell paint?")  # more writes, then no clean stop
        tree = srv.process_tree()
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(timeout=60)
        wait_until(lambda: all(is_zombie(q) for q in tree[1:]), "gunicorn to exit after the engine process")
    assert warm == cold
    files = sorted(disk.glob("*/*.kv"))
    assert files
    for f in files:  # a flipped payload byte: the checksum must catch every one
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x5A
        f.write_bytes(bytes(data))
    (files[0].parent / (files[0].name + ".tmp.999999999.1")).write_bytes(b"torn")
    with Server(model_dir, tmp_path / "c.log", *flags) as srv:
        again, cached = completion(srv, SHARED + " Question: where are the hammers?")
        metrics = srv.metrics()
    assert cached == 0 and again == cold
    assert metrics["appliance_kv_disk_corrupt_blocks_total"] >= 1
    assert not list(disk.glob("*/*.tmp.*"))


def test_a_responses_continuation_finds_its_kv_on_disk_after_a_restart(model_dir, tmp_path):
    """The Responses API: turn 1 on one server, `previous_response_id` on a restarted one (the stored response
    and the KV blocks both outlive the process): turn 2's prompt repeats turn 1's, and those blocks come from
    disk (cached_tokens, the disk-hit metric), with the answer a server without the tier gives."""
    import requests

    from tests.helpers import Server

    disk = tmp_path / "kv"
    flags = ("--workers", "1", "--kv-disk-dir", str(disk))

    def respond(srv, **body) -> dict:
        r = requests.post(
            srv.base + "/v3/responses",
            json={"model": srv.model_id(), "max_output_tokens": 8, "temperature": 0, **body},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r.json()

    with Server(model_dir, tmp_path / "a.log", *flags) as srv:
        first = respond(srv, input=SHARED + " Question: where are the hammers?")
    assert first["usage"]["input_tokens"] >= 512
    with Server(model_dir, tmp_path / "b.log", *flags) as srv:
        second = respond(srv, previous_response_id=first["id"], input="And the paint?")
        hits = srv.metrics()["appliance_kv_disk_hit_tokens_total"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"] - 32 and hits == cached, (second["usage"], hits)
