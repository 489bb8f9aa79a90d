"""Stored Responses (`store: true`): an embedded SQLite database in the state dir (appliance/state.py), shared by
the HTTP workers.

The workers are separate processes, so each opens the file itself: one short connection per operation (opening
one costs 0.06 ms on the 2-core dev box; no connection crosses a thread or a fork). WAL journal, so readers
never wait for a writer and a crashed writer leaves the last committed state; `synchronous=FULL`, so a commit is on
disk before the response is answered: NORMAL in WAL mode may lose the last commits on a power cut (not on a process
crash), and an acknowledged response must survive both; measured on the dev box (/tmp, 2 KB responses): a stored
response costs 3.3 ms with its fsyncs, a read 0.6 ms, against a generation's hundreds of ms. The file is created
0600 (SQLite gives its -wal and -shm files the same mode): it holds conversations.

A response belongs to the API key that made it: rows carry the SHA-256 of the key (never the key), and every read
and delete is filtered by it, so another key's id reads as absent (404). Bounds (operator flags,
`--responses-retention` seconds and `--responses-max-bytes`): each write first drops rows older than the retention,
then the writer's own oldest rows until its total fits its budget; a response larger than the budget is not stored.
The budget is per key, so one key's writes never evict another's responses (a shared budget let one key erase
every other's conversations by storing big responses); the file holds at most the budget times the keys in use
(the key files bound those), plus the retention's expired rows until the next write.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("appliance.http")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    size INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner, created);
"""
BUSY_TIMEOUT_MS = 10_000  # another worker's write: wait for it (a write takes milliseconds)


@dataclass(frozen=True)
class Stored:
    response: dict
    input_items: list[dict]
    messages: list[dict]  # the conversation up to and including this response's output (no instructions)


class ResponseStore:
    def __init__(self, path: str | Path, retention: float, max_bytes: int):
        self.path, self.retention, self.max_bytes = str(path), retention, max_bytes
        self._ready = False

    def _connect(self) -> sqlite3.Connection:
        if not self._ready:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))  # its mode before SQLite creates it
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA synchronous=FULL")
        if not self._ready:
            db.execute("PRAGMA journal_mode=WAL")  # persistent, in the file
            db.executescript(SCHEMA)
            self._ready = True
        return db

    def put(self, owner: str, response: dict, input_items: list[dict], messages: list[dict]) -> bool:
        """Committed (on disk) when this returns True; False: larger than the whole budget, not kept."""
        texts = [json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in (response, input_items, messages)]
        size = sum(len(t.encode("utf-8")) for t in texts)
        if size > self.max_bytes:
            log.warning(
                "response not stored: larger than --responses-max-bytes (one key's budget)", extra={"bytes": size}
            )
            return False
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            now = time.time()
            db.execute("DELETE FROM responses WHERE created < ?", (now - self.retention,))
            total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses WHERE owner = ?", (owner,)).fetchone()[0]
            if total + size > self.max_bytes:  # the writer's own oldest go until the new one fits
                drop, freed = [], 0
                mine = db.execute("SELECT id, size FROM responses WHERE owner = ? ORDER BY created", (owner,))
                for rid, rsize in mine:
                    drop.append((rid,))
                    freed += rsize
                    if total - freed + size <= self.max_bytes:
                        break
                db.executemany("DELETE FROM responses WHERE id = ?", drop)
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (response["id"], owner, now, size, *texts),
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()
        return True

    def _exists(self) -> bool:
        """Reads never create the file: a server nobody stored anything on leaves its data dir as it was."""
        return self._ready or Path(self.path).exists()

    def get(self, owner: str, response_id: str) -> Stored | None:
        if not self._exists():
            return None
        db = self._connect()
        try:
            row = db.execute(
                "SELECT response, input_items, messages FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                (response_id, owner, time.time() - self.retention),
            ).fetchone()
        finally:
            db.close()
        return None if row is None else Stored(*(json.loads(t) for t in row))

    def delete(self, owner: str, response_id: str) -> bool:
        if not self._exists():
            return False
        db = self._connect()
        try:
            return db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0
        finally:
            db.close()
