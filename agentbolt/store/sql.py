"""The store: the only owner of state (queue, attempts, events, resources).

All queue logic lives in :class:`SqlStore`, written once in portable SQL with ``?`` placeholders.
A backend (:mod:`.sqlite`, :mod:`.postgres`) supplies only a :class:`Database` — connections,
transactions (and statements that commit on their own), placeholder style, the planner's
statistics — and the one clause that differs: how dequeue locks the row it claims. The store is
synchronous; the server decides how to call it (directly for SQLite, from a thread for
PostgreSQL).

The hot operations are few statements each, since on PostgreSQL every statement is a round
trip: a claim is one ``UPDATE ... RETURNING``, the attempt's ``INSERT`` and the worker's row; a
batch of events one ``INSERT ... SELECT`` that checks the attempt in the same statement; a
finish two ``UPDATE`` statements.
"""

from __future__ import annotations

import abc
import itertools
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson

from agentbolt.errors import LeaseLost, NotFound
from agentbolt.schemas import (
    Attempt,
    AttemptFinish,
    AttemptStatus,
    Claim,
    Event,
    EventCreate,
    Mode,
    Page,
    Resources,
    ResourcesCreate,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
    Worker,
    check_transition,
    new_id,
    now,
)

__all__ = ["Database", "SqlStore", "Tx"]

DEFAULT_LEASE_SECONDS = 30.0
# dequeue ends lapsed attempts itself at most this often (seconds); the server's sweep runs too
EXPIRE_EVERY = 0.05
MAX_PAGE = 1000
# events per INSERT statement (4 parameters each; SQLite allows 32,766 per statement)
_EVENTS_PER_INSERT = 500


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _loads(text: str | bytes | None) -> Any:
    return orjson.loads(text) if text else {}


class Tx(abc.ABC):
    """One transaction: run statements written with ``?`` placeholders."""

    @abc.abstractmethod
    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute; return the number of rows changed."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self.all(sql, params)
        return rows[0] if rows else None


class Database(abc.ABC):
    """What a backend provides to :class:`SqlStore`."""

    name: str
    #: how many transactions can run at once (the connection pool's size)
    connections: int = 1
    #: appended to the SELECT that picks the rollout to claim (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)
    claim_lock: str = ""

    @abc.abstractmethod
    def transaction(self) -> Any:
        """A context manager yielding a :class:`Tx`; commits on success, rolls back on error."""

    @abc.abstractmethod
    def autocommit(self) -> Any:
        """A context manager yielding a :class:`Tx` whose statements each commit on their own:
        for reads, and for writes that are one statement (on PostgreSQL it saves the BEGIN and
        COMMIT round trips; at READ COMMITTED a transaction of several reads would not read
        one snapshot anyway)."""

    @abc.abstractmethod
    def inserted(self, tables: Sequence[str], rows: int) -> None:
        """``rows`` were just added to ``tables``: the backend may refresh its planner's statistics."""

    @abc.abstractmethod
    def serialize(self, tx: Tx, what: int) -> None:
        """Make transactions that call this with the same ``what`` run one after another (until
        commit)."""

    @abc.abstractmethod
    def migrate(self, migrations: Sequence[tuple[int, list[str]]]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


# Versioned schema; a backend applies the ones it has not recorded yet. Types are portable:
# REAL/DOUBLE PRECISION differ, so {real} and {serial} (an auto-increasing integer primary key)
# are filled in per backend. ``qseq`` is the queue order.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """CREATE TABLE tasks (id TEXT PRIMARY KEY, data TEXT NOT NULL, metadata TEXT NOT NULL)""",
            """CREATE TABLE rollouts (
                qseq {serial}, id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL, mode TEXT NOT NULL,
                status TEXT NOT NULL, resources_version INTEGER, timeout_seconds {real},
                max_attempts INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
                last_attempt INTEGER NOT NULL DEFAULT 0, group_id TEXT,
                reward {real}, error TEXT, metadata TEXT NOT NULL, created_at {real} NOT NULL,
                updated_at {real} NOT NULL, started_at {real}, ended_at {real})""",
            "CREATE INDEX rollouts_status ON rollouts (status, qseq)",
            "CREATE INDEX rollouts_mode ON rollouts (mode, qseq)",
            "CREATE INDEX rollouts_version ON rollouts (resources_version, qseq)",
            "CREATE INDEX rollouts_group ON rollouts (group_id)",
            """CREATE TABLE attempts (
                id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, number INTEGER NOT NULL,
                worker_id TEXT NOT NULL, status TEXT NOT NULL, started_at {real} NOT NULL,
                heartbeat_at {real} NOT NULL, lease_expires_at {real} NOT NULL, deadline {real},
                ended_at {real}, reward {real}, error TEXT)""",
            "CREATE INDEX attempts_rollout ON attempts (rollout_id, number)",
            "CREATE INDEX attempts_live ON attempts (status, lease_expires_at)",
            """CREATE TABLE events (
                id {serial}, rollout_id TEXT NOT NULL, attempt_id TEXT NOT NULL, sequence BIGINT,
                type TEXT NOT NULL, timestamp {real} NOT NULL, data TEXT NOT NULL)""",
            "CREATE UNIQUE INDEX events_seq ON events (attempt_id, sequence)",
            "CREATE INDEX events_rollout ON events (rollout_id, timestamp, id)",
            "CREATE INDEX events_type ON events (type, id)",
            """CREATE TABLE resources (version INTEGER PRIMARY KEY, resources TEXT NOT NULL,
                metadata TEXT NOT NULL, created_at {real} NOT NULL)""",
            """CREATE TABLE workers (id TEXT PRIMARY KEY, last_seen {real} NOT NULL,
                claims INTEGER NOT NULL DEFAULT 0)""",
        ],
    ),
]


def _sql_literal(member: RolloutStatus | AttemptStatus | Mode) -> str:
    """A status (or mode) written into the SQL text rather than bound as a parameter, where it
    decides the plan: a prepared statement's generic plan knows nothing of ``status = $1`` and,
    once the table holds a long history of finished rows, walks the whole table in key order to
    find the few queued or running ones (11 ms per claim with 20,000 finished rollouts on
    PostgreSQL, growing with the history). Enum members only: a fixed set of lower-case words."""
    value = type(member)(member).value
    if not value.isidentifier() or not value.islower():
        raise ValueError(f"not a status or mode: {value!r}")
    return f"'{value}'"


_QUEUED, _RUNNING = _sql_literal(RolloutStatus.QUEUED), _sql_literal(AttemptStatus.RUNNING)

# The rollout dequeue claims: the oldest queued one (a rollout pinned to a version not published
# yet waits in the queue until it is; versions are numbered 1, 2, ... and never deleted, so
# published <=> <= MAX).
NEXT_QUEUED = (
    f"SELECT q.qseq FROM rollouts q WHERE q.status = {_QUEUED} AND (q.resources_version IS NULL OR "
    "q.resources_version <= (SELECT MAX(version) FROM resources)) ORDER BY q.qseq LIMIT 1"
)
# Running attempts whose lease lapsed or whose deadline passed (parameters: now, now).
LAPSED = (
    f"SELECT id, lease_expires_at, deadline FROM attempts WHERE status = {_RUNNING} "
    "AND (lease_expires_at < ? OR deadline < ?) ORDER BY id"
)

# serialize() key of publish_resources (any constant distinct from other serialized sections)
_PUBLISH_LOCK = 1

_ROLLOUT_COLS = (
    "r.id, r.task_id, t.data, t.metadata, r.mode, r.status, r.resources_version, r.timeout_seconds, "
    "r.max_attempts, r.attempts, r.group_id, r.reward, r.error, r.metadata, r.created_at, "
    "r.updated_at, r.started_at, r.ended_at"
)
_ROLLOUT_FROM = "rollouts r JOIN tasks t ON t.id = r.task_id"
# the same columns in the RETURNING clause of an UPDATE of rollouts (no join there: the task's
# columns come from subqueries). The CAST is for SQLite, which otherwise scans all tasks for
# each subquery in a RETURNING clause instead of using the key.
_TASK_OF_ROW = "FROM tasks t WHERE t.id = CAST(rollouts.task_id AS TEXT)"
_RETURNED_ROLLOUT = (
    f"id, task_id, (SELECT t.data {_TASK_OF_ROW}), (SELECT t.metadata {_TASK_OF_ROW}), "
    "mode, status, resources_version, "
    "timeout_seconds, max_attempts, attempts, group_id, reward, error, metadata, created_at, "
    "updated_at, started_at, ended_at"
)
_ATTEMPT_COLS = (
    "id, rollout_id, number, worker_id, status, started_at, heartbeat_at, lease_expires_at, "
    "ended_at, reward, error"
)


def _rollout(row: tuple[Any, ...]) -> Rollout:
    (rid, task_id, data, tmeta, mode, status, version, timeout, max_att, att, group, reward, error,
     meta, created, updated, started, ended) = row  # fmt: skip
    return Rollout(
        id=rid,
        task=Task(id=task_id, data=_loads(data), metadata=_loads(tmeta)),
        mode=Mode(mode),
        status=RolloutStatus(status),
        resources_version=version,
        timeout_seconds=timeout,
        max_attempts=max_att,
        attempts=att,
        group_id=group,
        reward=reward,
        error=error,
        metadata=_loads(meta),
        created_at=created,
        updated_at=updated,
        started_at=started,
        ended_at=ended,
    )


def _attempt(row: tuple[Any, ...]) -> Attempt:
    keys = _ATTEMPT_COLS.split(", ")
    values = dict(zip(keys, row, strict=True))
    values["status"] = AttemptStatus(values["status"])
    return Attempt(**values)


def _event_rows(events: Sequence[EventCreate]) -> list[tuple[Any, ...]]:
    """(sequence, type, timestamp, data) of each event, a sequence repeated in the batch once."""
    rows, seen = [], set()
    for e in events:
        if e.sequence is not None:
            if e.sequence in seen:
                continue
            seen.add(e.sequence)
        rows.append((e.sequence, e.type, e.timestamp, _dumps(e.data)))
    return rows


def _event(row: tuple[Any, ...]) -> Event:
    rollout_id, attempt_id, seq, kind, ts, data, event_id = row
    return Event(
        id=event_id,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence=seq,
        type=kind,
        timestamp=ts,
        data=_loads(data),
    )


class SqlStore:
    """Queue with leases, attempts, events and versioned resources over a :class:`Database`."""

    def __init__(self, db: Database, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.db = db
        self.lease_seconds = lease_seconds
        self._resources_cache: dict[int, Resources] = {}
        self._cache_lock = threading.Lock()
        self._expired_at = -math.inf  # when dequeue last ended lapsed attempts
        db.migrate(MIGRATIONS)

    @property
    def backend(self) -> str:
        return self.db.name

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[Tx]:
        with self.db.transaction() as tx:
            yield tx

    @contextmanager
    def _read(self) -> Iterator[Tx]:
        """Reads (and single-statement writes): no BEGIN/COMMIT round trips on PostgreSQL."""
        with self.db.autocommit() as tx:
            yield tx

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, items: Sequence[RolloutCreate]) -> list[Rollout]:
        """Create rollouts (and their tasks). An item whose ``id`` exists already is returned as is."""
        ts = now()
        ids = [item.id or new_id("ro") for item in items]
        with self._tx() as tx:
            for rid, item in zip(ids, items, strict=True):
                self._insert_rollout(tx, rid, item, ts)
            created = self._rollouts_by_id(tx, ids)
        self.db.inserted(("rollouts", "tasks"), len(items))
        return created

    def _insert_rollout(self, tx: Tx, rid: str, item: RolloutCreate, ts: float) -> None:
        if item.id is not None and tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rid,)):
            return  # idempotent: the first enqueue wins
        task = item.task
        tx.run(
            "INSERT INTO tasks (id, data, metadata) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET data = excluded.data, metadata = excluded.metadata",
            (task.id, _dumps(task.data), _dumps(task.metadata)),
        )
        tx.run(
            "INSERT INTO rollouts (id, task_id, mode, status, resources_version, timeout_seconds, "
            "max_attempts, attempts, group_id, metadata, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (rid, task.id, item.mode.value, RolloutStatus.QUEUED.value, item.resources_version,
             item.timeout_seconds, item.max_attempts, item.group_id, _dumps(item.metadata), ts, ts),
        )  # fmt: skip

    def _rollouts_by_id(self, tx: Tx, ids: Sequence[str]) -> list[Rollout]:
        found: dict[str, Rollout] = {}
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            marks = ", ".join("?" * len(chunk))
            for row in tx.all(f"SELECT {_ROLLOUT_COLS} FROM {_ROLLOUT_FROM} WHERE r.id IN ({marks})", chunk):
                found[row[0]] = _rollout(row)
        return [found[i] for i in ids if i in found]

    # ------------------------------------------------------------------ dequeue and leases

    def dequeue(self, worker_id: str, lease_seconds: float | None = None) -> Claim | None:
        """Claim one new attempt for the oldest queued rollout, or return None.

        One transaction: end lapsed attempts first (so their rollouts can be claimed now; at
        most every ``EXPIRE_EVERY`` seconds per store, the server's sweep does the rest), then
        claim: one UPDATE picks, marks and returns the rollout (its task read in the same
        statement), one INSERT records the attempt."""
        lease = lease_seconds or self.lease_seconds
        ts = now()
        with self._tx() as tx:
            if ts - self._expired_at >= EXPIRE_EVERY or ts < self._expired_at:
                self._expire_in(tx, ts)
                self._expired_at = ts
            row = tx.one(
                f"UPDATE rollouts SET status = ?, attempts = attempts + 1, last_attempt = last_attempt + 1, "
                f"resources_version = COALESCE(resources_version, (SELECT MAX(version) FROM resources)), "
                f"started_at = COALESCE(started_at, ?), updated_at = ? "
                f"WHERE qseq = ({NEXT_QUEUED} {self.db.claim_lock}) "
                f"RETURNING {_RETURNED_ROLLOUT}, last_attempt",
                (RolloutStatus.RUNNING.value, ts, ts),
            )
            if row is None:
                self._touch_worker(tx, worker_id, ts, claimed=0)
                return None
            rollout, number = _rollout(row[:-1]), row[-1]
            deadline = ts + rollout.timeout_seconds if rollout.timeout_seconds else None
            attempt = Attempt(id=new_id("at"), rollout_id=rollout.id, number=number, worker_id=worker_id,
                              status=AttemptStatus.RUNNING, started_at=ts, heartbeat_at=ts,
                              lease_expires_at=ts + lease)  # fmt: skip
            tx.run(
                f"INSERT INTO attempts ({_ATTEMPT_COLS}, deadline) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, ?)",
                (attempt.id, rollout.id, number, worker_id, AttemptStatus.RUNNING.value, ts, ts, ts + lease, deadline),
            )  # fmt: skip
            self._touch_worker(tx, worker_id, ts, claimed=1)
        version = rollout.resources_version
        resources = self.get_resources(version) if version is not None else None
        return Claim(rollout=rollout, attempt=attempt, resources=resources)

    def _touch_worker(self, tx: Tx, worker_id: str, ts: float, claimed: int) -> None:
        tx.run(
            "INSERT INTO workers (id, last_seen, claims) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen, claims = workers.claims + excluded.claims",
            (worker_id, ts, claimed),
        )

    def _attempt_row(self, tx: Tx, attempt_id: str) -> tuple[Any, ...]:
        row = tx.one(f"SELECT {_ATTEMPT_COLS} FROM attempts WHERE id = ?", (attempt_id,))
        if row is None:
            raise NotFound("attempt", attempt_id)
        return row

    def _held(self, tx: Tx, attempt_id: str, worker_id: str | None) -> Attempt:
        attempt = _attempt(self._attempt_row(tx, attempt_id))
        if attempt.status != AttemptStatus.RUNNING:
            raise LeaseLost(f"attempt {attempt_id!r} is {attempt.status.value}, not running")
        if worker_id is not None and attempt.worker_id != worker_id:
            raise LeaseLost(f"attempt {attempt_id!r} is held by another worker")
        return attempt

    def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        """Extend the lease of a running attempt (409 :class:`LeaseLost` when it is no longer held,
        or when its lease already lapsed: the sweep may have requeued the rollout by now)."""
        ts = now()
        with self._tx() as tx:
            self._expire_in(tx, ts)
            attempt = self._held(tx, attempt_id, worker_id)
            expires = ts + (lease_seconds or self.lease_seconds)
            changed = tx.run(
                "UPDATE attempts SET heartbeat_at = ?, lease_expires_at = ? WHERE id = ? AND status = ?",
                (ts, expires, attempt_id, AttemptStatus.RUNNING.value),
            )
            if changed != 1:  # ended by another replica since _held read it
                raise LeaseLost(f"attempt {attempt_id!r} ended meanwhile")
            self._touch_worker(tx, attempt.worker_id, ts, claimed=0)
            return attempt.model_copy(update={"heartbeat_at": ts, "lease_expires_at": expires})

    def expire(self, ts: float | None = None) -> int:
        """End attempts whose lease lapsed or whose rollout timed out; requeue or fail their rollouts."""
        ts = ts or now()
        with self._tx() as tx:
            return self._expire_in(tx, ts)

    def _expire_in(self, tx: Tx, ts: float) -> int:
        rows = tx.all(LAPSED, (ts, ts))
        ended = 0
        for attempt_id, lease_end, deadline in rows:
            timed_out = deadline is not None and deadline < ts
            status = AttemptStatus.TIMED_OUT if timed_out else AttemptStatus.LEASE_EXPIRED
            why = "timed out" if timed_out else f"lease expired at {lease_end:.3f}"
            finish = AttemptFinish(status=AttemptStatus.FAILED, error=why)
            ended += self._end_attempt(tx, attempt_id, finish, status, ts) is not None
        return ended

    # ------------------------------------------------------------------ finishing

    def finish_attempt(self, attempt_id: str, finish: AttemptFinish, worker_id: str | None = None) -> Rollout:
        """End a running attempt. Success ends the rollout; failure requeues it while attempts
        remain; ``released`` (a runner stopping) requeues it without using up an attempt."""
        ts = now()
        with self._tx() as tx:
            rollout = self._end_attempt(tx, attempt_id, finish, AttemptStatus(finish.status), ts, worker_id)
            if rollout is None:
                self._held(tx, attempt_id, worker_id)  # NotFound or LeaseLost, with the reason
                raise LeaseLost(f"attempt {attempt_id!r} ended meanwhile")
            return rollout

    def _end_attempt(
        self,
        tx: Tx,
        attempt_id: str,
        finish: AttemptFinish,
        status: AttemptStatus,
        ts: float,
        worker_id: str | None = None,
    ) -> Rollout | None:
        """End the attempt (if ``worker_id`` holds it) and move its rollout on; return the
        rollout. None (and nothing changed) when the attempt was not running: another replica
        ended it first, so it must not be requeued twice."""
        check_transition("attempt", attempt_id, AttemptStatus.RUNNING, status)
        held = "" if worker_id is None else " AND worker_id = ?"
        row = tx.one(
            "UPDATE attempts SET status = ?, ended_at = ?, reward = ?, error = ? WHERE id = ? AND status = ?"
            + held
            + " RETURNING rollout_id, (SELECT r.status FROM rollouts r WHERE r.id = attempts.rollout_id), "
            "(SELECT r.attempts FROM rollouts r WHERE r.id = attempts.rollout_id), "
            "(SELECT r.max_attempts FROM rollouts r WHERE r.id = attempts.rollout_id)",
            (status.value, ts, finish.reward, finish.error, attempt_id, AttemptStatus.RUNNING.value)
            + ((worker_id,) if worker_id is not None else ()),
        )
        if row is None:
            return None
        rollout_id, old, attempts, max_attempts = row
        if old is None:
            raise NotFound("rollout", rollout_id)
        old = RolloutStatus(old)
        if status == AttemptStatus.SUCCEEDED:
            new, used = RolloutStatus.SUCCEEDED, attempts
        elif status == AttemptStatus.RELEASED:
            new, used = RolloutStatus.QUEUED, attempts - 1
        else:
            new, used = (RolloutStatus.QUEUED if attempts < max_attempts else RolloutStatus.FAILED), attempts
        if old == RolloutStatus.RUNNING:
            check_transition("rollout", rollout_id, old, new)
            # "AND status": a cancel committed since the read above wins (READ COMMITTED on PostgreSQL)
            moved = tx.one(
                "UPDATE rollouts SET status = ?, attempts = ?, reward = ?, error = ?, updated_at = ?, ended_at = ? "
                f"WHERE id = ? AND status = ? RETURNING {_RETURNED_ROLLOUT}",
                (new.value, used, finish.reward, finish.error if new != RolloutStatus.SUCCEEDED else None, ts,
                 ts if new.is_final else None, rollout_id, RolloutStatus.RUNNING.value),
            )  # fmt: skip
            if moved is not None:
                return _rollout(moved)
        # e.g. cancelled meanwhile: the attempt ends, the rollout stays as it is
        return self._rollouts_by_id(tx, [rollout_id])[0]

    def cancel(self, rollout_id: str) -> Rollout:
        ts = now()
        with self._tx() as tx:
            rollout = self._rollouts_by_id(tx, [rollout_id])
            if not rollout:
                raise NotFound("rollout", rollout_id)
            check_transition("rollout", rollout_id, rollout[0].status, RolloutStatus.CANCELLED)
            live = [s.value for s in RolloutStatus if not s.is_final]
            changed = tx.run(
                "UPDATE rollouts SET status = ?, updated_at = ?, ended_at = ? WHERE id = ? AND status IN (?, ?)",
                (RolloutStatus.CANCELLED.value, ts, ts, rollout_id, *live),
            )
            if changed != 1:  # finished by another replica since we read it
                final = self._rollouts_by_id(tx, [rollout_id])[0].status
                check_transition("rollout", rollout_id, final, RolloutStatus.CANCELLED)
            return self._rollouts_by_id(tx, [rollout_id])[0]

    # ------------------------------------------------------------------ events

    def add_events(self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None) -> int:
        """Append events to a running attempt; a (attempt, sequence) already stored is skipped.
        Returns how many were new."""
        rows = _event_rows(events)
        with self._events_tx(rows) as tx:
            new = self._insert_events(tx, attempt_id, rows, running=True, worker_id=worker_id)
            if new == 0:  # nothing stored: not held (say why), or every event a repeat
                self._held(tx, attempt_id, worker_id)
            return new

    def record_events(self, attempt_id: str, events: Sequence[EventCreate]) -> int:
        """Append events the server observed itself (gateway calls, OTLP spans). Unlike
        :meth:`add_events` the attempt may have ended: a span can arrive after the finish."""
        rows = _event_rows(events)
        with self._events_tx(rows) as tx:
            new = self._insert_events(tx, attempt_id, rows, running=False, worker_id=None)
            if new == 0:
                self._attempt_row(tx, attempt_id)  # NotFound when there is no such attempt
            return new

    def _events_tx(self, rows: list[tuple[Any, ...]]) -> Any:
        """One INSERT commits on its own; several (a batch over ``_EVENTS_PER_INSERT``) need a
        transaction, so that an attempt ending meanwhile gets all of them or none."""
        return self._tx() if len(rows) > _EVENTS_PER_INSERT else self._read()

    def _insert_events(
        self, tx: Tx, attempt_id: str, rows: list[tuple[Any, ...]], running: bool, worker_id: str | None
    ) -> int:
        """Insert ``rows`` for the attempt, in statements that each check the attempt exists
        (and, with ``running``, that it is running and held by ``worker_id`` if given): an
        attempt ended meanwhile gets none of them. (attempt, sequence) is unique: a re-sent
        batch, even one racing on another replica, inserts nothing twice; the row counts tell
        how many were new."""
        where = f" AND a.status = {_RUNNING}" if running else ""
        where += " AND a.worker_id = ?" if worker_id is not None else ""
        extra = (worker_id,) if worker_id is not None else ()
        new = 0
        for start in range(0, len(rows), _EVENTS_PER_INSERT):
            chunk = rows[start : start + _EVENTS_PER_INSERT]
            marks = ", ".join(["(?, ?, ?, ?)"] * len(chunk))
            new += tx.run(
                "INSERT INTO events (rollout_id, attempt_id, sequence, type, timestamp, data) "
                "SELECT a.rollout_id, a.id, CAST(v.column1 AS BIGINT), v.column2, v.column3, v.column4 "
                f"FROM attempts a, (VALUES {marks}) v WHERE a.id = ?{where} "
                "ON CONFLICT (attempt_id, sequence) DO NOTHING",
                [*itertools.chain.from_iterable(chunk), attempt_id, *extra],
            )
        return new

    def list_events(
        self,
        rollout_id: str | None = None,
        *,
        rollout_ids: Sequence[str] | None = None,
        attempt_id: str | None = None,
        types: Sequence[str] | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Event]:
        """Events ordered by (timestamp, id); ``cursor`` continues after the last page.
        ``rollout_ids``: the events of any of these rollouts (ids not stored match nothing)."""
        where: list[str] = []
        params: list[Any] = []
        if rollout_id is not None:
            where.append("rollout_id = ?")
            params.append(rollout_id)
        if rollout_ids is not None:
            marks = ", ".join("?" * len(rollout_ids))
            where.append(f"rollout_id IN ({marks})" if rollout_ids else "1 = 0")
            params.extend(rollout_ids)
        if attempt_id is not None:
            where.append("attempt_id = ?")
            params.append(attempt_id)
        if types:
            where.append(f"type IN ({', '.join('?' * len(types))})")
            params.extend(types)
        if cursor:
            ts, last_id = _parse_event_cursor(cursor)
            where.append("(timestamp > ? OR (timestamp = ? AND id > ?))")
            params.extend([ts, ts, last_id])
        limit = _clamp(limit)
        sql = "SELECT rollout_id, attempt_id, sequence, type, timestamp, data, id FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY timestamp, id LIMIT ?"
        with self._read() as tx:
            if rollout_id is not None and not tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise NotFound("rollout", rollout_id)
            items = [_event(r) for r in tx.all(sql, [*params, limit + 1])]
        more = len(items) > limit
        items = items[:limit]
        nxt = f"{items[-1].timestamp!r}:{items[-1].id}" if more and items else None
        return Page[Event](items=items, next_cursor=nxt)

    # ------------------------------------------------------------------ resources

    def publish_resources(self, create: ResourcesCreate) -> Resources:
        ts = now()
        with self._tx() as tx:
            # two replicas publishing at once must not both read the same MAX(version)
            self.db.serialize(tx, _PUBLISH_LOCK)
            row = tx.one("SELECT MAX(version) FROM resources")
            version = (row[0] if row and row[0] is not None else 0) + 1
            body = _dumps({k: v.model_dump(mode="json") for k, v in create.resources.items()})
            tx.run(
                "INSERT INTO resources (version, resources, metadata, created_at) VALUES (?, ?, ?, ?)",
                (version, body, _dumps(create.metadata), ts),
            )
        return Resources(version=version, resources=create.resources, metadata=create.metadata, created_at=ts)

    def get_resources(self, version: int) -> Resources:
        with self._cache_lock:  # versions never change once written: cache them
            cached = self._resources_cache.get(version)
        if cached is not None:
            return cached
        with self._read() as tx:
            row = tx.one(
                "SELECT version, resources, metadata, created_at FROM resources WHERE version = ?", (version,)
            )
        if row is None:
            raise NotFound("resources version", version)
        res = Resources(version=row[0], resources=_loads(row[1]), metadata=_loads(row[2]), created_at=row[3])
        with self._cache_lock:
            self._resources_cache[version] = res
        return res

    def latest_resources(self) -> Resources | None:
        with self._read() as tx:
            row = tx.one("SELECT MAX(version) FROM resources")
        return self.get_resources(row[0]) if row and row[0] is not None else None

    def list_resources(self, limit: int = 100, cursor: str | None = None) -> Page[Resources]:
        before = int(cursor) if cursor else None
        limit = _clamp(limit)
        where, params = ("WHERE version < ?", [before]) if before is not None else ("", [])
        with self._read() as tx:
            rows = tx.all(
                f"SELECT version FROM resources {where} ORDER BY version DESC LIMIT ?", [*params, limit + 1]
            )
        versions = [r[0] for r in rows]
        items = [self.get_resources(v) for v in versions[:limit]]
        nxt = str(items[-1].version) if len(versions) > limit and items else None
        return Page[Resources](items=items, next_cursor=nxt)

    # ------------------------------------------------------------------ queries

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._read() as tx:
            found = self._rollouts_by_id(tx, [rollout_id])
        if not found:
            raise NotFound("rollout", rollout_id)
        return found[0]

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """The rollouts that exist among ``rollout_ids``, in that order."""
        with self._read() as tx:
            return self._rollouts_by_id(tx, rollout_ids)

    def list_rollouts(
        self,
        *,
        status: Sequence[RolloutStatus] | None = None,
        mode: Mode | None = None,
        resources_version: int | None = None,
        group_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        newest_first: bool = False,
    ) -> Page[Rollout]:
        where: list[str] = ["1 = 1"]
        params: list[Any] = []
        if status:
            statuses = ", ".join(_sql_literal(RolloutStatus(s)) for s in status)  # see _sql_literal
            where.append(f"r.status IN ({statuses})")
        if mode is not None:
            where.append(f"r.mode = {_sql_literal(Mode(mode))}")  # a rare mode: its index
        for column, value in (("resources_version", resources_version), ("group_id", group_id)):
            if value is not None:
                where.append(f"r.{column} = ?")
                params.append(value)
        if cursor:
            where.append("r.qseq < ?" if newest_first else "r.qseq > ?")
            params.append(_int_cursor(cursor))
        limit = _clamp(limit)
        order = "DESC" if newest_first else "ASC"
        sql = (
            f"SELECT {_ROLLOUT_COLS}, r.qseq FROM {_ROLLOUT_FROM} WHERE {' AND '.join(where)} "
            f"ORDER BY r.qseq {order} LIMIT ?"
        )
        with self._read() as tx:
            rows = tx.all(sql, [*params, limit + 1])
        items = [_rollout(r[:-1]) for r in rows[:limit]]
        nxt = str(rows[limit - 1][-1]) if len(rows) > limit else None
        return Page[Rollout](items=items, next_cursor=nxt)

    def list_attempts(self, rollout_id: str) -> list[Attempt]:
        with self._read() as tx:
            if not tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise NotFound("rollout", rollout_id)
            rows = tx.all(
                f"SELECT {_ATTEMPT_COLS} FROM attempts WHERE rollout_id = ? ORDER BY number", (rollout_id,)
            )
        return [_attempt(r) for r in rows]

    def get_attempt(self, attempt_id: str) -> Attempt:
        with self._read() as tx:
            return _attempt(self._attempt_row(tx, attempt_id))

    def list_workers(self, limit: int = 100) -> list[Worker]:
        with self._read() as tx:
            rows = tx.all(
                "SELECT w.id, w.last_seen, w.claims, "
                f"(SELECT COUNT(*) FROM attempts a WHERE a.worker_id = w.id AND a.status = {_RUNNING}) "
                "FROM workers w ORDER BY w.last_seen DESC LIMIT ?",
                (_clamp(limit),),
            )
        return [Worker(id=r[0], last_seen=r[1], claims=r[2], running=r[3]) for r in rows]

    def stats(self) -> dict[str, Any]:
        """Counts by status and mode, plus reward means per resources version and mode."""
        with self._read() as tx:
            by_status = dict(tx.all("SELECT status, COUNT(*) FROM rollouts GROUP BY status"))
            rewards = tx.all(
                "SELECT resources_version, mode, COUNT(*), AVG(reward), "
                "SUM(CASE WHEN status = ? THEN 1 ELSE 0 END), SUM(CASE WHEN status = ? THEN 1 ELSE 0 END) "
                "FROM rollouts WHERE status IN (?, ?) GROUP BY resources_version, mode ORDER BY resources_version",
                (RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value,
                 RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value),
            )  # fmt: skip
            events = tx.one("SELECT COUNT(*) FROM events")
        return {
            "rollouts": {s.value: int(by_status.get(s.value, 0)) for s in RolloutStatus},
            "events": int(events[0]) if events else 0,
            "by_version": [
                {
                    "resources_version": v,
                    "mode": m,
                    "count": int(n),
                    "mean_reward": _finite(avg),
                    "succeeded": int(ok or 0),
                    "failed": int(bad or 0),
                }
                for v, m, n, avg, ok, bad in rewards
            ],  # fmt: skip
        }


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _clamp(limit: int) -> int:
    return max(1, min(int(limit), MAX_PAGE))


def _int_cursor(cursor: str) -> int:
    try:
        return int(cursor)
    except ValueError:
        raise ValueError(f"invalid cursor {cursor!r}") from None


def _parse_event_cursor(cursor: str) -> tuple[float, int]:
    try:
        ts, last = cursor.rsplit(":", 1)
        return float(ts), int(last)
    except ValueError:
        raise ValueError(f"invalid cursor {cursor!r}") from None
