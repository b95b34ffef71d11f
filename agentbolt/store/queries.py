"""The store's reads: rollouts, attempts, events, resources, workers and statistics.

:class:`Queries` is the read half of :class:`~agentbolt.store.sql.SqlStore` (one store object;
the writes, which decide the queue's states, are in :mod:`.sql`). Every read runs outside an
explicit transaction (:meth:`Database.autocommit`): on PostgreSQL it saves the BEGIN and COMMIT
round trips, and at READ COMMITTED several reads would not share a snapshot anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from agentbolt.errors import NotFound
from agentbolt.schemas import (
    Attempt,
    Event,
    Mode,
    Page,
    Resources,
    RewardScore,
    RewardSource,
    Rollout,
    RolloutStatus,
    Worker,
)
from agentbolt.store.database import Database
from agentbolt.store.rewards import PENDING, SCORE_COLS, attach_rewards, score_from_row
from agentbolt.store.rows import (
    ATTEMPT_COLS,
    ROLLOUT_COLS,
    ROLLOUT_FROM,
    attempt_from_row,
    event_cursor,
    event_from_row,
    finite,
    from_json,
    int_cursor,
    page_limit,
    parse_event_cursor,
    rollout_from_row,
)
from agentbolt.store.statements import LATEST_VERSION, RUNNING, attempt_row, rollouts_by_id, sql_literal

__all__ = ["Queries", "WorkerToken"]


class Queries:
    """Reads over a :class:`Database`; resources versions, which never change once written, are
    cached."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._resources_cache: dict[int, Resources] = {}
        self._cache_lock = threading.Lock()

    def _read(self) -> Any:
        """Reads (and single-statement writes): no BEGIN/COMMIT round trips on PostgreSQL."""
        return self.db.autocommit()

    # ------------------------------------------------------------------ events

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
        sql = "SELECT rollout_id, attempt_id, sequence, type, timestamp, data, id, source FROM events"
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

    def get_resources(self, version: int) -> Resources:
        with self._cache_lock:  # versions never change once written: cache them
            cached = self._resources_cache.get(version)
        if cached is not None:
            return cached
        with self._read() as tx:
            row = tx.one(
                "SELECT version, resources, metadata, created_at, trial FROM resources WHERE version = ?",
                (version,),
            )
        if row is None:
            raise NotFound("resources version", version)
        res = Resources(
            version=row[0],
            resources=from_json(row[1]),
            metadata=from_json(row[2]),
            created_at=row[3],
            trial=bool(row[4]),
        )
        with self._cache_lock:
            self._resources_cache[version] = res
        return res

    def latest_resources(self) -> Resources | None:
        """The newest version that is not a trial (what unpinned rollouts run with)."""
        with self._read() as tx:
            row = tx.one(f"SELECT {LATEST_VERSION}")
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
        return self._rollout_page(where, params, limit, newest_first)

    def _rollout_page(
        self, where: list[str], params: list[Any], limit: int, newest_first: bool
    ) -> Page[Rollout]:
        """A page of the rollouts matching ``where`` in queue order, their rewards attached."""
        order = "DESC" if newest_first else "ASC"
        sql = (
            f"SELECT {ROLLOUT_COLS}, r.qseq FROM {ROLLOUT_FROM} WHERE {' AND '.join(where)} "
            f"ORDER BY r.qseq {order} LIMIT ?"
        )
        with self._read() as tx:
            rows = tx.all(sql, [*params, limit + 1])
            items = [rollout_from_row(r[:-1]) for r in rows[:limit]]
            attach_rewards(tx, items)
        nxt = str(rows[limit - 1][-1]) if len(rows) > limit else None
        return Page[Rollout](items=items, next_cursor=nxt)

    # ------------------------------------------------------------------ named rewards

    def reward_history(self, rollout_id: str, name: str | None = None) -> list[RewardScore]:
        """Every score given to the rollout's named rewards (or to ``name``), oldest first."""
        where, params = (
            ("rollout_id = ? AND name = ?", [rollout_id, name]) if name else ("rollout_id = ?", [rollout_id])
        )
        with self._read() as tx:
            if not tx.one("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)):
                raise NotFound("rollout", rollout_id)
            rows = tx.all(f"SELECT {SCORE_COLS} FROM reward_scores WHERE {where} ORDER BY id", params)
        return [score_from_row(r) for r in rows]

    def pending_rewards(
        self,
        name: str | None = None,
        source: RewardSource | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        """Succeeded rollouts with a reward still pending (``name``, from ``source``), in queue
        order: the work of evaluators and reviewers. A failed rollout keeps its pending slot but
        is not listed: there is no answer to judge."""
        where = [f"p.state = {PENDING}"]  # the slots: the subquery's conditions
        params: list[Any] = []
        for column, value in (("name", name), ("source", RewardSource(source).value if source else None)):
            if value is not None:
                where.append(f"p.{column} = ?")
                params.append(value)
        of_rollouts = [
            f"r.status = {sql_literal(RolloutStatus.SUCCEEDED)}",
            f"r.id IN (SELECT p.rollout_id FROM reward_slots p WHERE {' AND '.join(where)})",
        ]
        if cursor:
            of_rollouts.append("r.qseq > ?")
            params.append(int_cursor(cursor))
        return self._rollout_page(of_rollouts, params, page_limit(limit), newest_first=False)

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

    def attempt_state(
        self, attempt_id: str, call_key: str | None = None
    ) -> tuple[str, str, str | None] | None:
        """``(rollout_id, status, body hash)`` of the attempt, if it exists: what the gateway
        checks on every call, without building the whole attempt. With ``call_key`` (a call's
        idempotency key) the hash is that of the body its record was first made with (None: no
        record has the key), read in the same statement."""
        with self._read() as tx:
            if call_key is None:
                row = tx.one("SELECT rollout_id, status, NULL FROM attempts WHERE id = ?", (attempt_id,))
            else:
                row = tx.one(
                    "SELECT rollout_id, status, (SELECT e.request_sha256 FROM events e WHERE "
                    "e.attempt_id = a.id AND e.call_key = ? ORDER BY e.id LIMIT 1) FROM attempts a WHERE a.id = ?",
                    (f"key:{call_key}", attempt_id),
                )
        return (row[0], row[1], row[2]) if row is not None else None

    def attempt_of_agent_key(self, agent_key: str) -> tuple[str, str] | None:
        """``(rollout_id, attempt_id)`` of the attempt this agent key was minted for, if any."""
        with self._read() as tx:
            row = tx.one("SELECT rollout_id, id FROM attempts WHERE agent_key = ?", (agent_key,))
        return (row[0], row[1]) if row is not None else None

    def worker_of_token_sha256(self, digest: str) -> WorkerToken | None:
        """The registered worker whose token has this sha256 (its id, when it was last seen and
        when it was revoked), if any."""
        with self._read() as tx:
            row = tx.one("SELECT id, last_seen, revoked_at FROM workers WHERE token_sha256 = ?", (digest,))
        return WorkerToken(row[0], row[1], row[2]) if row is not None else None

    def list_workers(self, limit: int = 100) -> list[Worker]:
        with self._read() as tx:
            rows = tx.all(
                f"SELECT {_WORKER_COLS} FROM workers w ORDER BY w.last_seen DESC LIMIT ?",
                (page_limit(limit),),
            )
        return [_worker(r) for r in rows]

    def get_worker(self, worker_id: str) -> Worker:
        with self._read() as tx:
            row = tx.one(f"SELECT {_WORKER_COLS} FROM workers w WHERE w.id = ?", (worker_id,))
        if row is None:
            raise NotFound("worker", worker_id)
        return _worker(row)

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


class WorkerToken(NamedTuple):
    """What a worker token names: its worker, when that worker was last seen, when it was revoked."""

    worker_id: str
    last_seen: float
    revoked_at: float | None


_WORKER_COLS = (
    "w.id, w.last_seen, w.claims, "
    f"(SELECT COUNT(*) FROM attempts a WHERE a.worker_id = w.id AND a.status = {RUNNING}), w.revoked_at"
)


def _worker(row: Sequence[Any]) -> Worker:
    return Worker(id=row[0], last_seen=row[1], claims=row[2], running=row[3], revoked_at=row[4])
