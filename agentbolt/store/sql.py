"""The store: the only owner of state (queue, attempts, events, resources).

All queue logic lives in :class:`SqlStore`, written once in portable SQL with ``?`` placeholders.
A backend (:mod:`.sqlite`, :mod:`.postgres`) supplies only a :class:`~.database.Database` —
connections, transactions (and statements that commit on their own), placeholder style, the
planner's statistics — and the few words that differ: how dequeue locks the row it claims, the
schema's types. The schema and its migrations are in :mod:`.schema`, the mapping of rows to
models in :mod:`.rows`. The store is synchronous; the server decides how to call it (directly
for SQLite, from a thread for PostgreSQL).

The hot operations are few statements each, since on PostgreSQL every statement is a round
trip: a claim is one ``UPDATE ... RETURNING``, the attempt's ``INSERT`` and the worker's row; a
batch of events one ``INSERT ... SELECT`` that checks the attempt in the same statement; a
finish two ``UPDATE`` statements.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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
    Worker,
    check_transition,
    new_id,
    now,
)
from agentbolt.store.database import Database, Tx
from agentbolt.store.rows import (
    ATTEMPT_COLS,
    RETURNED_ROLLOUT,
    ROLLOUT_COLS,
    ROLLOUT_FROM,
    attempt_from_row,
    event_cursor,
    event_from_row,
    event_rows,
    finite,
    from_json,
    int_cursor,
    page_limit,
    parse_event_cursor,
    rollout_from_row,
    to_json,
)
from agentbolt.store.schema import migrate
from agentbolt.store.statements import (
    EVENTS_PER_INSERT,
    NEXT_QUEUED,
    RUNNING,
    attempt_row,
    end_attempt,
    expire_lapsed,
    held,
    insert_events,
    insert_rollout,
    rollouts_by_id,
    sql_literal,
    touch_worker,
)

__all__ = ["Database", "SqlStore", "Tx"]

DEFAULT_LEASE_SECONDS = 30.0
# dequeue ends lapsed attempts itself at most this often (seconds); the server's sweep runs too
EXPIRE_EVERY = 0.05
# serialize() key of publish_resources (any constant distinct from other serialized sections)
_PUBLISH_LOCK = 1


class SqlStore:
    """Queue with leases, attempts, events and versioned resources over a :class:`Database`."""

    def __init__(self, db: Database, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.db = db
        self.lease_seconds = lease_seconds
        self._resources_cache: dict[int, Resources] = {}
        self._cache_lock = threading.Lock()
        self._expired_at = -math.inf  # when dequeue last ended lapsed attempts
        migrate(db)

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
                insert_rollout(tx, rid, item, ts)
            created = rollouts_by_id(tx, ids)
        self.db.inserted(("rollouts", "tasks"), len(items))
        return created

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
                expire_lapsed(tx, ts)
                self._expired_at = ts
            row = tx.one(
                f"UPDATE rollouts SET status = ?, attempts = attempts + 1, last_attempt = last_attempt + 1, "
                f"resources_version = COALESCE(resources_version, (SELECT MAX(version) FROM resources)), "
                f"started_at = COALESCE(started_at, ?), updated_at = ? "
                f"WHERE qseq = ({NEXT_QUEUED} {self.db.claim_lock}) "
                f"RETURNING {RETURNED_ROLLOUT}, last_attempt",
                (RolloutStatus.RUNNING.value, ts, ts),
            )
            if row is None:
                touch_worker(tx, worker_id, ts, claimed=0)
                return None
            rollout, number = rollout_from_row(row[:-1]), row[-1]
            deadline = ts + rollout.timeout_seconds if rollout.timeout_seconds else None
            attempt = Attempt(
                id=new_id("at"),
                rollout_id=rollout.id,
                number=number,
                worker_id=worker_id,
                status=AttemptStatus.RUNNING,
                started_at=ts,
                heartbeat_at=ts,
                lease_expires_at=ts + lease,
            )
            tx.run(
                f"INSERT INTO attempts ({ATTEMPT_COLS}, deadline) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, ?)",
                (
                    attempt.id,
                    rollout.id,
                    number,
                    worker_id,
                    AttemptStatus.RUNNING.value,
                    ts,
                    ts,
                    ts + lease,
                    deadline,
                ),
            )
            touch_worker(tx, worker_id, ts, claimed=1)
        version = rollout.resources_version
        resources = self.get_resources(version) if version is not None else None
        return Claim(rollout=rollout, attempt=attempt, resources=resources)

    def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        """Extend the lease of a running attempt (409 :class:`LeaseLost` when it is no longer held,
        or when its lease already lapsed: the sweep may have requeued the rollout by now)."""
        ts = now()
        with self._tx() as tx:
            expire_lapsed(tx, ts)
            attempt = held(tx, attempt_id, worker_id)
            expires = ts + (lease_seconds or self.lease_seconds)
            changed = tx.run(
                "UPDATE attempts SET heartbeat_at = ?, lease_expires_at = ? WHERE id = ? AND status = ?",
                (ts, expires, attempt_id, AttemptStatus.RUNNING.value),
            )
            if changed != 1:  # ended by another replica since held() read it
                raise LeaseLost(f"attempt {attempt_id!r} ended meanwhile")
            touch_worker(tx, attempt.worker_id, ts, claimed=0)
            return attempt.model_copy(update={"heartbeat_at": ts, "lease_expires_at": expires})

    def expire(self, ts: float | None = None) -> int:
        """End attempts whose lease lapsed or whose rollout timed out; requeue or fail their rollouts."""
        ts = ts or now()
        with self._tx() as tx:
            return expire_lapsed(tx, ts)

    # ------------------------------------------------------------------ finishing

    def finish_attempt(self, attempt_id: str, finish: AttemptFinish, worker_id: str | None = None) -> Rollout:
        """End a running attempt. Success ends the rollout; failure requeues it while attempts
        remain; ``released`` (a runner stopping) requeues it without using up an attempt."""
        ts = now()
        with self._tx() as tx:
            rollout = end_attempt(tx, attempt_id, finish, AttemptStatus(finish.status), ts, worker_id)
            if rollout is None:
                held(tx, attempt_id, worker_id)  # NotFound or LeaseLost, with the reason
                raise LeaseLost(f"attempt {attempt_id!r} ended meanwhile")
            return rollout

    def cancel(self, rollout_id: str) -> Rollout:
        ts = now()
        with self._tx() as tx:
            rollout = rollouts_by_id(tx, [rollout_id])
            if not rollout:
                raise NotFound("rollout", rollout_id)
            check_transition("rollout", rollout_id, rollout[0].status, RolloutStatus.CANCELLED)
            live = [s.value for s in RolloutStatus if not s.is_final]
            changed = tx.run(
                "UPDATE rollouts SET status = ?, updated_at = ?, ended_at = ? WHERE id = ? AND status IN (?, ?)",
                (RolloutStatus.CANCELLED.value, ts, ts, rollout_id, *live),
            )
            if changed != 1:  # finished by another replica since we read it
                final = rollouts_by_id(tx, [rollout_id])[0].status
                check_transition("rollout", rollout_id, final, RolloutStatus.CANCELLED)
            return rollouts_by_id(tx, [rollout_id])[0]

    # ------------------------------------------------------------------ events

    def add_events(self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None) -> int:
        """Append events to a running attempt; a (attempt, sequence) already stored is skipped.
        Returns how many were new."""
        rows = event_rows(events)
        with self._events_tx(rows) as tx:
            new = insert_events(tx, attempt_id, rows, running=True, worker_id=worker_id)
            if new == 0:  # nothing stored: not held (say why), or every event a repeat
                held(tx, attempt_id, worker_id)
            return new

    def record_events(self, attempt_id: str, events: Sequence[EventCreate]) -> int:
        """Append events the server observed itself (gateway calls, OTLP spans). Unlike
        :meth:`add_events` the attempt may have ended: a span can arrive after the finish."""
        rows = event_rows(events)
        with self._events_tx(rows) as tx:
            new = insert_events(tx, attempt_id, rows, running=False, worker_id=None)
            if new == 0:
                attempt_row(tx, attempt_id)  # NotFound when there is no such attempt
            return new

    def _events_tx(self, rows: list[tuple[Any, ...]]) -> Any:
        """One INSERT commits on its own; several (a batch over ``EVENTS_PER_INSERT``) need a
        transaction, so that an attempt ending meanwhile gets all of them or none."""
        return self._tx() if len(rows) > EVENTS_PER_INSERT else self._read()

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
            ts, last_id = parse_event_cursor(cursor)
            where.append("(timestamp > ? OR (timestamp = ? AND id > ?))")
            params.extend([ts, ts, last_id])
        limit = page_limit(limit)
        sql = "SELECT rollout_id, attempt_id, sequence, type, timestamp, data, id FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY timestamp, id LIMIT ?"
        with self._read() as tx:
            if rollout_id is not None and not tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise NotFound("rollout", rollout_id)
            items = [event_from_row(r) for r in tx.all(sql, [*params, limit + 1])]
        more = len(items) > limit
        items = items[:limit]
        nxt = event_cursor(items[-1]) if more and items else None
        return Page[Event](items=items, next_cursor=nxt)

    # ------------------------------------------------------------------ resources

    def publish_resources(self, create: ResourcesCreate) -> Resources:
        ts = now()
        with self._tx() as tx:
            # two replicas publishing at once must not both read the same MAX(version)
            self.db.serialize(tx, _PUBLISH_LOCK)
            row = tx.one("SELECT MAX(version) FROM resources")
            version = (row[0] if row and row[0] is not None else 0) + 1
            body = to_json({k: v.model_dump(mode="json") for k, v in create.resources.items()})
            tx.run(
                "INSERT INTO resources (version, resources, metadata, created_at) VALUES (?, ?, ?, ?)",
                (version, body, to_json(create.metadata), ts),
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
        res = Resources(
            version=row[0], resources=from_json(row[1]), metadata=from_json(row[2]), created_at=row[3]
        )
        with self._cache_lock:
            self._resources_cache[version] = res
        return res

    def latest_resources(self) -> Resources | None:
        with self._read() as tx:
            row = tx.one("SELECT MAX(version) FROM resources")
        return self.get_resources(row[0]) if row and row[0] is not None else None

    def list_resources(self, limit: int = 100, cursor: str | None = None) -> Page[Resources]:
        before = int(cursor) if cursor else None
        limit = page_limit(limit)
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
            found = rollouts_by_id(tx, [rollout_id])
        if not found:
            raise NotFound("rollout", rollout_id)
        return found[0]

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """The rollouts that exist among ``rollout_ids``, in that order."""
        with self._read() as tx:
            return rollouts_by_id(tx, rollout_ids)

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
            statuses = ", ".join(sql_literal(RolloutStatus(s)) for s in status)  # see sql_literal
            where.append(f"r.status IN ({statuses})")
        if mode is not None:
            where.append(f"r.mode = {sql_literal(Mode(mode))}")  # a rare mode: its index
        for column, value in (("resources_version", resources_version), ("group_id", group_id)):
            if value is not None:
                where.append(f"r.{column} = ?")
                params.append(value)
        if cursor:
            where.append("r.qseq < ?" if newest_first else "r.qseq > ?")
            params.append(int_cursor(cursor))
        limit = page_limit(limit)
        order = "DESC" if newest_first else "ASC"
        sql = (
            f"SELECT {ROLLOUT_COLS}, r.qseq FROM {ROLLOUT_FROM} WHERE {' AND '.join(where)} "
            f"ORDER BY r.qseq {order} LIMIT ?"
        )
        with self._read() as tx:
            rows = tx.all(sql, [*params, limit + 1])
        items = [rollout_from_row(r[:-1]) for r in rows[:limit]]
        nxt = str(rows[limit - 1][-1]) if len(rows) > limit else None
        return Page[Rollout](items=items, next_cursor=nxt)

    def list_attempts(self, rollout_id: str) -> list[Attempt]:
        with self._read() as tx:
            if not tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise NotFound("rollout", rollout_id)
            rows = tx.all(
                f"SELECT {ATTEMPT_COLS} FROM attempts WHERE rollout_id = ? ORDER BY number", (rollout_id,)
            )
        return [attempt_from_row(r) for r in rows]

    def get_attempt(self, attempt_id: str) -> Attempt:
        with self._read() as tx:
            return attempt_from_row(attempt_row(tx, attempt_id))

    def list_workers(self, limit: int = 100) -> list[Worker]:
        with self._read() as tx:
            rows = tx.all(
                "SELECT w.id, w.last_seen, w.claims, "
                f"(SELECT COUNT(*) FROM attempts a WHERE a.worker_id = w.id AND a.status = {RUNNING}) "
                "FROM workers w ORDER BY w.last_seen DESC LIMIT ?",
                (page_limit(limit),),
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
                (
                    RolloutStatus.SUCCEEDED.value,
                    RolloutStatus.FAILED.value,
                    RolloutStatus.SUCCEEDED.value,
                    RolloutStatus.FAILED.value,
                ),
            )
            events = tx.one("SELECT COUNT(*) FROM events")
        return {
            "rollouts": {s.value: int(by_status.get(s.value, 0)) for s in RolloutStatus},
            "events": int(events[0]) if events else 0,
            "by_version": [
                {
                    "resources_version": v,
                    "mode": m,
                    "count": int(n),
                    "mean_reward": finite(avg),
                    "succeeded": int(ok or 0),
                    "failed": int(bad or 0),
                }
                for v, m, n, avg, ok, bad in rewards
            ],
        }

    def finished_since(self, since: float) -> list[tuple[float, str]]:
        """``(ended_at, status)`` of the rollouts that ended at or after ``since`` (the
        dashboard buckets them into its throughput chart)."""
        with self._read() as tx:
            rows = tx.all("SELECT ended_at, status FROM rollouts WHERE ended_at >= ?", (since,))
        return [(float(ended), str(status)) for ended, status in rows]
