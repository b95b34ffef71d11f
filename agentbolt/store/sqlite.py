"""SQLite backend: one file in WAL mode (the embedded default) or ``:memory:`` for tests.

SQLite has one writer at a time, so every transaction is ``BEGIN IMMEDIATE`` on a single
connection guarded by a lock; dequeue needs no row locking beyond that.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentbolt.store.database import Database, Tx

__all__ = ["SqliteDatabase"]


class _SqliteTx(Tx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount


class SqliteDatabase(Database):
    name = "sqlite"
    types = {"real": "REAL", "serial": "INTEGER PRIMARY KEY"}

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self.conn.execute("PRAGMA foreign_keys = ON")
        if self.path != ":memory:":
            self.conn.execute("PRAGMA journal_mode = WAL")
            # NORMAL in WAL mode: a commit survives a process crash; only an OS crash can lose
            # the last transactions.
            self.conn.execute("PRAGMA synchronous = NORMAL")
        self._lock = threading.RLock()

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self.conn)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    @contextmanager
    def autocommit(self) -> Iterator[Tx]:
        with self._lock:
            yield _SqliteTx(self.conn)

    def inserted(self, tables: Sequence[str], rows: int) -> None:
        pass  # without statistics SQLite's planner already reads the queue index in order

    def serialize(self, tx: Tx, what: int, on: str = "") -> None:
        pass  # BEGIN IMMEDIATE: write transactions run one after another already

    def lock_schema(self, tx: Tx) -> None:
        pass  # BEGIN IMMEDIATE holds the database's one write lock already

    def close(self) -> None:
        with self._lock:
            self.conn.close()
