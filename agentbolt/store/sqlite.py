"""SQLite backend: one file in WAL mode (the embedded default) or ``:memory:`` for tests.

SQLite has one writer at a time, so every transaction is ``BEGIN IMMEDIATE`` on a single
connection guarded by a lock; dequeue needs no row locking beyond that.

Group commit (:meth:`SqliteDatabase.open_group`, used by the server): the transactions run
until :meth:`~SqliteDatabase.commit_group` are savepoints of one ``BEGIN IMMEDIATE``
transaction, committed once. Each still rolls back alone on error; the caller answers none of
them before the group's commit (see :class:`agentbolt.server.store_caller.StoreCaller`), so an
answer never reports a write the database might not keep.

Checkpoints off the writer's path: once a group opens (the server), a thread of its own copies
the WAL into the database file every :data:`CHECKPOINT_EVERY` seconds (a passive checkpoint,
on a connection of its own). SQLite would otherwise checkpoint inside a commit every 1,000
pages, and a checkpoint syncs the database file: a stall of the event loop, for every request
waiting on it. The writer still checkpoints itself past :data:`WAL_BOUND_PAGES` pages, should
the thread fall behind. Durability is unchanged: a commit is in the WAL when it returns.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentbolt.store.database import Database, Tx

__all__ = ["CHECKPOINT_EVERY", "WAL_BOUND_PAGES", "SqliteDatabase"]

CHECKPOINT_EVERY = 0.5
"""Seconds between the checkpoint thread's passive checkpoints."""
WAL_BOUND_PAGES = 20_000
"""The writer checkpoints itself past this many WAL pages (80 MB): a bound, not the rule."""


class _SqliteTx(Tx):
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount


class _Transaction:
    """``with db.transaction() as tx``: ``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on
    error), or inside a group a savepoint, rolled back alone on error (see the module
    docstring). A class rather than a generator: the server opens several per request."""

    __slots__ = ("db", "savepoint")

    def __init__(self, db: SqliteDatabase) -> None:
        self.db, self.savepoint = db, False

    def __enter__(self) -> Tx:
        db = self.db
        db._lock.acquire()
        try:
            self.savepoint = db._grouped
            db.conn.execute("SAVEPOINT tx" if self.savepoint else "BEGIN IMMEDIATE")
        except BaseException:
            db._lock.release()
            raise
        return db._tx

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        db = self.db
        try:
            conn = db.conn
            if not self.savepoint:
                conn.execute("COMMIT" if kind is None else "ROLLBACK")
            elif kind is None:
                conn.execute("RELEASE tx")
            elif conn.in_transaction:
                conn.execute("ROLLBACK TO tx")
                conn.execute("RELEASE tx")
            else:  # SQLite rolled back the whole transaction (e.g. disk full): the group failed
                db._group_lost = db._group_lost or exc
                conn.execute("BEGIN IMMEDIATE")  # the group's other calls roll back with it
        finally:
            db._lock.release()


class _Autocommit:
    """``with db.autocommit() as tx``: statements that each commit on their own (inside a
    group: part of its transaction)."""

    __slots__ = ("db",)

    def __init__(self, db: SqliteDatabase) -> None:
        self.db = db

    def __enter__(self) -> Tx:
        self.db._lock.acquire()
        return self.db._tx

    def __exit__(self, *exc: object) -> None:
        self.db._lock.release()


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
        self._tx = _SqliteTx(self.conn)  # holds nothing of its own: one serves every transaction
        self._autocommit = _Autocommit(self)
        self._checkpoints: _Checkpointer | None = None

    def _checkpoint_off_path(self) -> None:
        """Start the checkpoint thread (once; a file database only: see the module docstring)."""
        if self._checkpoints is None and self.path != ":memory:":
            self.conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_BOUND_PAGES}")
            self._checkpoints = _Checkpointer(self.path)
            self._checkpoints.start()

    def open_group(self) -> None:
        """Begin a group's transaction; this thread holds the connection until
        :meth:`commit_group` (another thread's transactions wait for it)."""
        self._lock.acquire()
        try:
            if self._checkpoints is None:
                self._checkpoint_off_path()
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

    def transaction(self) -> _Transaction:
        return _Transaction(self)

    def autocommit(self) -> _Autocommit:
        return self._autocommit

    def inserted(self, tables: Sequence[str], rows: int) -> None:
        pass  # without statistics SQLite's planner already reads the queue index in order

    def serialize(self, tx: Tx, what: int, on: str = "") -> None:
        pass  # BEGIN IMMEDIATE: write transactions run one after another already

    def lock_schema(self, tx: Tx) -> None:
        pass  # BEGIN IMMEDIATE holds the database's one write lock already

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.stop()
        with self._lock:
            self.conn.close()  # the last connection to close checkpoints what is left


class _Checkpointer(threading.Thread):
    """Passive checkpoints every :data:`CHECKPOINT_EVERY` seconds on a connection of its own
    (the sqlite3 module lets other threads run while SQLite copies and syncs)."""

    def __init__(self, path: str) -> None:
        super().__init__(name="agentbolt-sqlite-checkpoint", daemon=True)
        self.path = path
        self._stopping = threading.Event()

    def run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        try:
            while not self._stopping.wait(CHECKPOINT_EVERY):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:  # the file went away or is locked: the next round tries again
                    continue
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=30)
