"""The statements the store's operations are made of, each run inside a transaction it is given.

:class:`~agentbolt.store.sql.SqlStore` decides the transactions (one per operation) and what
they return; the functions here are the steps inside them that several operations share:
inserting a rollout, reading rollouts and attempts, ending an attempt and moving its rollout on,
ending lapsed attempts, cancelling, appending events.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from agentbolt.errors import AttemptEnded, Conflict, InvalidInput, LeaseLost, NotFound, WorkerRevoked
from agentbolt.schemas import (
    Attempt,
    AttemptFinish,
    AttemptStatus,
    EventCreate,
    EventType,
    Mode,
    ResourcesCreate,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
    check_transition,
)
from agentbolt.store.database import Tx
from agentbolt.store.keys import check_same
from agentbolt.store.rewards import attach_rewards, insert_awaited
from agentbolt.store.rows import (
    ATTEMPT_COLS,
    RETURNED_ROLLOUT,
    ROLLOUT_COLS,
    ROLLOUT_FROM,
    attempt_from_row,
    from_json,
    rollout_from_row,
    to_json,
)

__all__ = [
    "EVENTS_PER_INSERT",
    "CLAIMED_WITH",
    "LAPSED",
    "LATEST_VERSION",
    "NEXT_QUEUED",
    "QUEUED",
    "RUNNING",
    "attempt_row",
    "cancel_running",
    "check_call_refs",
    "claim_made",
    "end_attempt",
    "events_insert",
    "expire_lapsed",
    "held",
    "insert_events",
    "insert_keyed_events",
    "insert_rollout",
    "insert_version",
    "rollouts_by_id",
    "sql_literal",
    "touch_worker",
]

# events per INSERT statement (4 parameters each; SQLite allows 32,766 per statement)
EVENTS_PER_INSERT = 500


def sql_literal(member: RolloutStatus | AttemptStatus | Mode) -> str:
    """A status (or mode) written into the SQL text rather than bound as a parameter, where it
    decides the plan: a prepared statement's generic plan knows nothing of ``status = $1`` and,
    once the table holds a long history of finished rows, walks the whole table in key order to
    find the few queued or running ones (11 ms per claim with 20,000 finished rollouts on
    PostgreSQL, growing with the history). Enum members only: a fixed set of lower-case words."""
    value = type(member)(member).value
    if not value.isidentifier() or not value.islower():
        raise ValueError(f"not a status or mode: {value!r}")
    return f"'{value}'"


QUEUED, RUNNING = sql_literal(RolloutStatus.QUEUED), sql_literal(AttemptStatus.RUNNING)

# The version an unpinned rollout runs with: the newest that is not a trial (index
# resources_latest). A trial version runs only the rollouts pinned to it.
LATEST_VERSION = "(SELECT MAX(version) FROM resources WHERE trial = 0)"

# The rollout dequeue claims: the oldest queued one (a rollout pinned to a version not published
# yet waits in the queue until it is; versions are numbered 1, 2, ... and never deleted, so
# published <=> <= MAX).
NEXT_QUEUED = (
    f"SELECT q.qseq FROM rollouts q WHERE q.status = {QUEUED} AND (q.resources_version IS NULL OR "
    "q.resources_version <= (SELECT MAX(version) FROM resources)) ORDER BY q.qseq LIMIT 1"
)
# The attempt a worker claimed with an idempotency key, its agent key and the hash of the claim's
# request (parameters: worker, key).
CLAIMED_WITH = (
    f"SELECT {ATTEMPT_COLS}, agent_key, claim_sha256 FROM attempts WHERE worker_id = ? AND claim_key = ?"
)
# Running attempts whose lease lapsed or whose deadline passed (parameters: now, now).
LAPSED = (
    f"SELECT id, lease_expires_at, deadline FROM attempts WHERE status = {RUNNING} "
    "AND (lease_expires_at < ? OR deadline < ?) ORDER BY id"
)


def insert_rollout(
    tx: Tx, rid: str, item: RolloutCreate, ts: float, fixed: bool, tasks: dict[str, Task]
) -> None:
    """Insert a queued rollout, its task and the pending slots of its awaited rewards.
    ``fixed``: the id was chosen by the caller (or derived from its idempotency key), so it may
    be stored already; then nothing changes (the first enqueue wins). ``tasks``: the tasks this
    enqueue has written or checked."""
    if fixed and tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rid,)):
        return
    keep_task(tx, item.task, tasks)
    added = tx.run(
        "INSERT INTO rollouts (id, task_id, mode, status, resources_version, timeout_seconds, "
        "max_attempts, attempts, group_id, metadata, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        (
            rid,
            item.task.id,
            item.mode.value,
            RolloutStatus.QUEUED.value,
            item.resources_version,
            item.timeout_seconds,
            item.max_attempts,
            item.group_id,
            to_json(item.metadata),
            ts,
            ts,
        ),
    )
    if added and item.await_rewards:
        insert_awaited(tx, rid, item.await_rewards, ts)


def keep_task(tx: Tx, task: Task, seen: dict[str, Task]) -> None:
    """Store a new task, or check that the stored one says the same: a task id names one task
    forever, so older rollouts never see their task rewritten (409 :class:`Conflict`)."""
    known = seen.get(task.id)
    if known is None:
        added = tx.run(
            "INSERT INTO tasks (id, data, metadata) VALUES (?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (task.id, to_json(task.data), to_json(task.metadata)),
        )
        if added:
            seen[task.id] = task
            return
        row = tx.one("SELECT data, metadata FROM tasks WHERE id = ?", (task.id,))
        assert row is not None  # tasks are never deleted
        known = seen[task.id] = Task(id=task.id, data=from_json(row[0]), metadata=from_json(row[1]))
    # compared as stored (JSON): key order and what JSON cannot hold (NaN is stored as null) differ
    # between a request and its stored copy without the task being another one
    if from_json(to_json([task.data, task.metadata])) != [known.data, known.metadata]:
        raise Conflict(
            f"task {task.id!r} is stored with other data or metadata; a task id names one task "
            "for good (older rollouts ran it): enqueue the changed task under a new id"
        )


def rollouts_by_id(tx: Tx, ids: Sequence[str]) -> list[Rollout]:
    """The rollouts among ``ids`` that exist, in that order, with their named rewards (read
    500 ids per statement)."""
    found: dict[str, Rollout] = {}
    for start in range(0, len(ids), 500):
        chunk = list(ids[start : start + 500])
        marks = ", ".join("?" * len(chunk))
        for row in tx.all(f"SELECT {ROLLOUT_COLS} FROM {ROLLOUT_FROM} WHERE r.id IN ({marks})", chunk):
            found[row[0]] = rollout_from_row(row)
    attach_rewards(tx, list(found.values()))
    return [found[i] for i in ids if i in found]


def claim_made(tx: Tx, worker_id: str, key: str, sha256: str) -> tuple[Rollout, Attempt, str | None] | None:
    """The rollout (as it stands now), attempt and agent key that ``worker_id`` claimed with
    ``key``; :class:`~agentbolt.errors.IdempotencyKeyReused` when that claim's request was
    another (its hash is not ``sha256``)."""
    row = tx.one(CLAIMED_WITH, (worker_id, key))
    if row is None:
        return None
    check_same(row[-1], sha256, key, "dequeue request")
    attempt = attempt_from_row(row[:-2])
    return rollouts_by_id(tx, [attempt.rollout_id])[0], attempt, row[-2]


def touch_worker(tx: Tx, worker_id: str, ts: float, claimed: int) -> None:
    """Record that ``worker_id`` was seen at ``ts`` (and claimed ``claimed`` more attempts).
    :class:`WorkerRevoked` when an admin revoked that worker: the caller's transaction (the
    claim or the lease renewal it made) is rolled back, whichever token named the worker."""
    row = tx.one(
        "INSERT INTO workers (id, last_seen, claims) VALUES (?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen, claims = workers.claims + excluded.claims "
        "RETURNING revoked_at",
        (worker_id, ts, claimed),
    )
    if row is not None and row[0] is not None:
        raise WorkerRevoked(f"worker {worker_id!r} was revoked: it may not claim or renew work")


def attempt_row(tx: Tx, attempt_id: str) -> tuple[Any, ...]:
    """The attempt's row (:data:`~.rows.ATTEMPT_COLS`); :class:`NotFound` when there is none."""
    row = tx.one(f"SELECT {ATTEMPT_COLS} FROM attempts WHERE id = ?", (attempt_id,))
    if row is None:
        raise NotFound("attempt", attempt_id)
    return row


def held(tx: Tx, attempt_id: str, worker_id: str | None) -> Attempt:
    """The attempt, if it is running and (with ``worker_id``) held by that worker; else
    :class:`AttemptEnded` naming its state, or :class:`LeaseLost` (another worker holds it)."""
    attempt = attempt_from_row(attempt_row(tx, attempt_id))
    if attempt.status != AttemptStatus.RUNNING:
        raise AttemptEnded(f"attempt {attempt_id!r} is {attempt.status.value}, not running")
    if worker_id is not None and attempt.worker_id != worker_id:
        raise LeaseLost(f"attempt {attempt_id!r} is held by another worker")
    return attempt


def expire_lapsed(tx: Tx, ts: float) -> int:
    """End the running attempts whose lease lapsed or whose deadline passed by ``ts``;
    return how many ended."""
    rows = tx.all(LAPSED, (ts, ts))
    ended = 0
    for attempt_id, lease_end, deadline in rows:
        timed_out = deadline is not None and deadline < ts
        status = AttemptStatus.TIMED_OUT if timed_out else AttemptStatus.LEASE_EXPIRED
        why = "timed out" if timed_out else f"lease expired at {lease_end:.3f}"
        finish = AttemptFinish(status=AttemptStatus.FAILED, error=why)
        ended += end_attempt(tx, attempt_id, finish, status, ts) is not None
    return ended


def end_attempt(
    tx: Tx,
    attempt_id: str,
    finish: AttemptFinish,
    status: AttemptStatus,
    ts: float,
    worker_id: str | None = None,
    key: str | None = None,
    sha256: str | None = None,
) -> Rollout | None:
    """End the attempt (if ``worker_id`` holds it) and move its rollout on; return the
    rollout. None (and nothing changed) when the attempt was not running: another replica
    ended it first, so it must not be requeued twice. ``key``: the finish request's
    idempotency key, kept on the attempt with its request's hash ``sha256`` so that a repeat
    of this finish is recognised (and another finish under the key refused)."""
    check_transition("attempt", attempt_id, AttemptStatus.RUNNING, status)
    by_holder = "" if worker_id is None else " AND worker_id = ?"
    row = tx.one(
        "UPDATE attempts SET status = ?, ended_at = ?, reward = ?, error = ?, finish_key = ?, finish_sha256 = ? "
        "WHERE id = ? AND status = ?"
        + by_holder
        + " RETURNING rollout_id, (SELECT r.status FROM rollouts r WHERE r.id = attempts.rollout_id), "
        "(SELECT r.attempts FROM rollouts r WHERE r.id = attempts.rollout_id), "
        "(SELECT r.max_attempts FROM rollouts r WHERE r.id = attempts.rollout_id)",
        (status.value, ts, finish.reward, finish.error, key, sha256, attempt_id, AttemptStatus.RUNNING.value)
        + ((worker_id,) if worker_id is not None else ()),
    )
    if row is None:
        return None
    rollout_id, old, attempts, max_attempts = row
    if old is None:
        raise NotFound("rollout", rollout_id)
    old = RolloutStatus(old)
    new, used = next_status(status, attempts, max_attempts)
    if old == RolloutStatus.RUNNING:
        check_transition("rollout", rollout_id, old, new)
        # "AND status": a cancel committed since the read above wins (READ COMMITTED on PostgreSQL)
        moved = tx.one(
            "UPDATE rollouts SET status = ?, attempts = ?, reward = ?, error = ?, updated_at = ?, ended_at = ? "
            f"WHERE id = ? AND status = ? RETURNING {RETURNED_ROLLOUT}",
            (
                new.value,
                used,
                finish.reward,
                finish.error if new != RolloutStatus.SUCCEEDED else None,
                ts,
                ts if new.is_final else None,
                rollout_id,
                RolloutStatus.RUNNING.value,
            ),
        )
        if moved is not None:
            return rollout_from_row(moved)
    # e.g. cancelled meanwhile: the attempt ends, the rollout stays as it is
    return rollouts_by_id(tx, [rollout_id])[0]


def next_status(ended: AttemptStatus, attempts: int, max_attempts: int) -> tuple[RolloutStatus, int]:
    """Where a running rollout goes when its attempt ends ``ended``, and how many attempts it
    has used. Only a lost runner is retried: an agent that failed (or whose report the server
    refused) and a rollout past its own deadline would fail again, and retrying them would
    score the best of several tries. ``released`` gives the attempt back unused."""
    if ended == AttemptStatus.SUCCEEDED:
        return RolloutStatus.SUCCEEDED, attempts
    if ended == AttemptStatus.RELEASED:
        return RolloutStatus.QUEUED, attempts - 1
    if ended == AttemptStatus.LEASE_EXPIRED and attempts < max_attempts:
        return RolloutStatus.QUEUED, attempts
    return RolloutStatus.FAILED, attempts


def cancel_running(tx: Tx, rollout_id: str, ts: float) -> int:
    """End the rollout's running attempt as ``cancelled``: its runner learns it at its next
    heartbeat or upload (409 :class:`AttemptEnded`), and the gateway takes no more calls for it."""
    return tx.run(
        f"UPDATE attempts SET status = ?, ended_at = ?, error = ? WHERE rollout_id = ? AND status = {RUNNING}",
        (AttemptStatus.CANCELLED.value, ts, "the rollout was cancelled", rollout_id),
    )


def insert_events(
    tx: Tx,
    attempt_id: str,
    rows: list[tuple[Any, ...]],
    running: bool,
    worker_id: str | None,
    source: str = "runner",
    unless: tuple[str, str] | None = None,
) -> int:
    """Insert ``rows`` for the attempt, in statements that each check the attempt exists
    (and, with ``running``, that it is running and held by ``worker_id`` if given): an
    attempt ended meanwhile gets none of them. ``unless`` (scope, idempotency key): none
    either when ``request_keys`` holds that key (a repeat, or the key reused). (attempt,
    sequence) is unique: a re-sent batch, even one racing on another replica, inserts nothing
    twice; the row counts tell how many were new."""
    new = 0
    for start in range(0, len(rows), EVENTS_PER_INSERT):
        chunk = rows[start : start + EVENTS_PER_INSERT]
        sql, params = events_insert(attempt_id, chunk, running, worker_id, source, unless)
        new += tx.run(sql, params)
    return new


def events_insert(
    attempt_id: str,
    rows: list[tuple[Any, ...]],
    running: bool,
    worker_id: str | None,
    source: str,
    unless: tuple[str, str] | None = None,
) -> tuple[str, list[Any]]:
    """One INSERT of at most ``EVENTS_PER_INSERT`` rows (see :func:`insert_events`), and its
    parameters."""
    where = f" AND a.status = {RUNNING}" if running else ""
    where += " AND a.worker_id = ?" if worker_id is not None else ""
    extra: tuple[str, ...] = (worker_id,) if worker_id is not None else ()
    if unless is not None:
        where += " AND NOT EXISTS (SELECT 1 FROM request_keys k WHERE k.scope = ? AND k.key = ?)"
        extra += unless
    marks = ", ".join(["(?, ?, ?, ?)"] * len(rows))
    sql = (
        "INSERT INTO events (rollout_id, attempt_id, sequence, type, timestamp, data, source) "
        "SELECT a.rollout_id, a.id, CAST(v.column1 AS BIGINT), v.column2, v.column3, v.column4, "
        f"CAST(? AS TEXT) FROM attempts a, (VALUES {marks}) v WHERE a.id = ?{where} "
        "ON CONFLICT (attempt_id, sequence) DO NOTHING"
    )
    return sql, [source, *itertools.chain.from_iterable(rows), attempt_id, *extra]


def insert_keyed_events(
    tx: Tx, attempt_id: str, rows: list[tuple[Any, ...]], source: str, running: bool = False
) -> int:
    """Insert events the server records itself, ``(type, timestamp, data, call_key)`` each,
    skipping those whose ``call_key`` the attempt already holds (a span delivered twice); a
    ``None`` key is never skipped. With ``running``, only while the attempt runs (an agent's own
    events). The caller serializes the attempt's keyed records (:data:`~.calls.CALLS_LOCK`):
    two transactions must not both find a key missing."""
    where = f" AND a.status = {RUNNING}" if running else ""
    new = 0
    for start in range(0, len(rows), EVENTS_PER_INSERT):
        chunk = rows[start : start + EVENTS_PER_INSERT]
        marks = ", ".join(["(?, ?, ?, ?)"] * len(chunk))
        new += tx.run(
            "INSERT INTO events (rollout_id, attempt_id, type, timestamp, data, call_key, source) "
            "SELECT a.rollout_id, a.id, v.column1, v.column2, v.column3, v.column4, CAST(? AS TEXT) "
            f"FROM attempts a, (VALUES {marks}) v WHERE a.id = ?{where} AND NOT EXISTS "
            "(SELECT 1 FROM events e WHERE e.attempt_id = a.id AND e.call_key = v.column4)",
            [source, *itertools.chain.from_iterable(chunk), attempt_id],
        )
    return new


_CALLED = (EventType.REWARD, EventType.STATE)  # the types that may name a model call
_SYSTEM_CALL = (
    "SELECT 1 FROM events WHERE id = ? AND attempt_id = ? AND type = 'llm_call' "
    "AND source IN ('gateway', 'runner')"
)


def check_call_refs(tx: Tx, attempt_id: str, events: Sequence[EventCreate]) -> None:
    """Each per-call reward and each state must name a model call the system recorded for this
    attempt: an agent cannot attach rewards to another attempt's turns, nor to a call it made
    up. :class:`InvalidInput` naming the first id that names none."""
    named = [
        e.data["llm_call_id"] for e in events if e.type in _CALLED and e.data.get("llm_call_id") is not None
    ]
    for call_id in dict.fromkeys(named):
        valid = isinstance(call_id, int) and not isinstance(call_id, bool) and 0 <= call_id < 2**63
        if not valid or tx.one(_SYSTEM_CALL, (call_id, attempt_id)) is None:
            raise InvalidInput(f"llm_call_id {call_id!r} names no model call of attempt {attempt_id!r}")


def insert_version(tx: Tx, create: ResourcesCreate, key: str | None, ts: float, sha256: str | None) -> int:
    """Store the next resources version (the caller holds the publish lock); its number.
    ``key``: the request's idempotency key, kept with its request's hash ``sha256``."""
    row = tx.one("SELECT MAX(version) FROM resources")
    version = (row[0] if row and row[0] is not None else 0) + 1
    body = to_json({k: v.model_dump(mode="json") for k, v in create.resources.items()})
    tx.run(
        "INSERT INTO resources (version, resources, metadata, created_at, request_key, trial, request_sha256) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (version, body, to_json(create.metadata), ts, key, int(create.trial), sha256),
    )
    return int(version)
