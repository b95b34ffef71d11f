"""SQLite's transactions outside a group (a trainer or test using the store directly): commit
on success, roll back on error, hand the connection back either way; a transaction inside a
group is a savepoint (tests/server/test_group_commit.py covers the group)."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

from agentbolt.store.sqlite import WAL_BOUND_PAGES, SqliteDatabase


def _db(tmp_path) -> tuple[SqliteDatabase, str]:
    path = str(tmp_path / "t.db")
    db = SqliteDatabase(path)
    db.conn.execute("CREATE TABLE t (x INTEGER)")
    return db, path


def _committed(path: str) -> list[int]:
    with sqlite3.connect(path) as conn:
        return [row[0] for row in conn.execute("SELECT x FROM t ORDER BY x")]


def test_a_transaction_commits_or_rolls_back_and_releases_the_lock(tmp_path):
    db, path = _db(tmp_path)
    with db.transaction() as tx:
        tx.run("INSERT INTO t VALUES (1)")
        assert db.conn.in_transaction
    assert _committed(path) == [1] and not db.conn.in_transaction
    with pytest.raises(ValueError), db.transaction() as tx:
        tx.run("INSERT INTO t VALUES (2)")
        raise ValueError("undo")
    assert _committed(path) == [1] and not db.conn.in_transaction
    # the lock is free again: another thread gets a transaction at once
    other = threading.Thread(target=_one_more, args=(db,))
    other.start()
    other.join(5)
    assert not other.is_alive() and _committed(path) == [1, 3]
    db.close()


def _one_more(db: SqliteDatabase) -> None:
    with db.transaction() as tx:
        tx.run("INSERT INTO t VALUES (3)")


def test_inside_a_group_a_failed_transaction_rolls_back_alone(tmp_path):
    db, path = _db(tmp_path)
    db.open_group()
    with db.transaction() as tx:
        tx.run("INSERT INTO t VALUES (1)")
    with pytest.raises(ValueError), db.transaction() as tx:
        tx.run("INSERT INTO t VALUES (2)")
        raise ValueError("undo")
    with db.autocommit() as tx:
        tx.run("INSERT INTO t VALUES (3)")
    assert _committed(path) == []  # nothing before the group's commit
    db.commit_group()
    assert _committed(path) == [1, 3]
    db.close()


def test_a_group_moves_checkpoints_off_the_writer_onto_a_thread_that_close_stops(tmp_path, monkeypatch):
    monkeypatch.setattr("agentbolt.store.sqlite.CHECKPOINT_EVERY", 0.02)
    db, path = _db(tmp_path)
    assert db._checkpoints is None  # a store used directly checkpoints as SQLite does
    db.conn.execute("CREATE TABLE big (b BLOB)")
    for _ in range(3):
        db.open_group()
        db.conn.executemany("INSERT INTO big VALUES (?)", [(os.urandom(4000),)] * 40)
        db.commit_group()
    checkpoints = db._checkpoints
    assert checkpoints is not None and checkpoints.is_alive()
    # the writer would checkpoint only past the bound: the thread copied the WAL into the file
    assert db.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WAL_BOUND_PAGES > 1000
    deadline = time.monotonic() + 10
    while os.path.getsize(path) < 120 * 4000 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.path.getsize(path) >= 120 * 4000
    db.close()
    assert not checkpoints.is_alive()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM big").fetchone()[0] == 120
