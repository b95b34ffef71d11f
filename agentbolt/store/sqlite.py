"""SQLite backend: one file in WAL mode (the embedded default) or ``:memory:`` for tests.

SQLite has one writer at a time, so every transaction is ``BEGIN IMMEDIATE`` on a single
connection guarded by a lock; dequeue needs no row locking beyond that.

Group commit (:meth:`SqliteDatabase.open_group`, used by the server): the transactions run
until :meth:`~SqliteDatabase.commit_group` are savepoints of one ``BEGIN IMMEDIATE``
transaction, committed once. Each still rolls back alone on error; the caller answers none of
them before the group's commit (see :class:`agentbolt.server.store_caller.StoreCaller`), so an
answer never reports a write the database might not keep.
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
        self._grouped = False  # a group's transaction is open (its thread holds the lock)
        self._group_lost: BaseException | None = None  # why SQLite ended the group's transaction

    def open_group(self) -> None:
        """Begin a group's transaction; this thread holds the connection until
        :meth:`commit_group` (another thread's transactions wait for it)."""
        self._lock.acquire()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        self._grouped, self._group_lost = True, None

    def commit_group(self) -> None:
        """Commit the group's transaction (raises, having rolled it back, when that fails or
        SQLite ended it early) and hand the connection back."""
        try:
            lost = self._group_lost
            if lost is not None:
                raise lost
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        finally:
            self._grouped, self._group_lost = False, None
            self._lock.release()

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            if self._grouped:
                with self._savepoint() as tx:
                    yield tx
                return
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self.conn)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    @contextmanager
    def _savepoint(self) -> Iterator[Tx]:
        """One transaction of the group: rolled back alone on error."""
        self.conn.execute("SAVEPOINT tx")
        try:
            yield _SqliteTx(self.conn)
        except BaseException as exc:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK TO tx")
                self.conn.execute("RELEASE tx")
            else:  # SQLite rolled back the whole transaction (e.g. disk full): the group failed
                self._group_lost = self._group_lost or exc
                self.conn.execute("BEGIN IMMEDIATE")  # the group's other calls roll back with it
            raise
        self.conn.execute("RELEASE tx")

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
