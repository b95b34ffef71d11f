"""Rows and models: the columns the store reads, and how a row becomes a model.

JSON columns (task data, metadata, event data, resources) are text written by orjson; an empty
one reads as ``{}``. Page cursors are the store's own strings: a queue position (``qseq``, or a
resources version) or ``"<timestamp>:<event id>"`` for events.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from agentbolt.schemas import Attempt, Event, EventCreate, Rollout, Task

__all__ = [
    "ATTEMPT_COLS",
    "MAX_PAGE",
    "RETURNED_ROLLOUT",
    "ROLLOUT_COLS",
    "ROLLOUT_FROM",
    "attempt_from_row",
    "event_cursor",
    "event_from_row",
    "event_rows",
    "finite",
    "from_json",
    "int_cursor",
    "keyed_event_rows",
    "page_limit",
    "parse_event_cursor",
    "rollout_from_row",
    "to_json",
]

MAX_PAGE = 1000

ROLLOUT_COLS = (
    "r.id, r.task_id, t.data, t.metadata, r.mode, r.status, r.resources_version, r.timeout_seconds, "
    "r.max_attempts, r.attempts, r.group_id, r.reward, r.error, r.metadata, r.created_at, "
    "r.updated_at, r.started_at, r.ended_at"
)
ROLLOUT_FROM = "rollouts r JOIN tasks t ON t.id = r.task_id"
# the same columns in the RETURNING clause of an UPDATE of rollouts (no join there: the task's
# columns come from subqueries). The CAST is for SQLite, which otherwise scans all tasks for
# each subquery in a RETURNING clause instead of using the key.
TASK_OF_ROW = "FROM tasks t WHERE t.id = CAST(rollouts.task_id AS TEXT)"
RETURNED_ROLLOUT = (
    f"id, task_id, (SELECT t.data {TASK_OF_ROW}), (SELECT t.metadata {TASK_OF_ROW}), "
    "mode, status, resources_version, "
    "timeout_seconds, max_attempts, attempts, group_id, reward, error, metadata, created_at, "
    "updated_at, started_at, ended_at"
)
ATTEMPT_COLS = (
    "id, rollout_id, number, worker_id, status, started_at, heartbeat_at, lease_expires_at, "
    "ended_at, reward, error"
)
_ATTEMPT_KEYS = ATTEMPT_COLS.split(", ")


def to_json(value: Any) -> str:
    return orjson.dumps(value).decode()


def from_json(text: str | bytes | None) -> Any:
    return orjson.loads(text) if text else {}


def rollout_from_row(row: tuple[Any, ...]) -> Rollout:
    """A rollout from the columns of :data:`ROLLOUT_COLS` (or :data:`RETURNED_ROLLOUT`)."""
    rid, task_id, data, task_meta, mode, status, version, timeout, *rest = row
    max_attempts, attempts, group, reward, error, meta, created, updated, started, ended = rest
    return Rollout(
        id=rid,
        task=Task(id=task_id, data=from_json(data), metadata=from_json(task_meta)),
        mode=mode,  # the stored values, converted by the model (cheaper than the enum's own call)
        status=status,
        resources_version=version,
        timeout_seconds=timeout,
        max_attempts=max_attempts,
        attempts=attempts,
        group_id=group,
        reward=reward,
        error=error,
        metadata=from_json(meta),
        created_at=created,
        updated_at=updated,
        started_at=started,
        ended_at=ended,
    )


def attempt_from_row(row: tuple[Any, ...]) -> Attempt:
    """An attempt from the columns of :data:`ATTEMPT_COLS`."""
    return Attempt(**dict(zip(_ATTEMPT_KEYS, row, strict=True)))  # the model converts the status


def event_rows(events: Sequence[EventCreate]) -> list[tuple[Any, ...]]:
    """(sequence, type, timestamp, data) of each event, a sequence repeated in the batch once."""
    rows, seen = [], set()
    for e in events:
        if e.sequence is not None:
            if e.sequence in seen:
                continue
            seen.add(e.sequence)
        rows.append((e.sequence, e.type, e.timestamp, to_json(e.data)))
    return rows


def keyed_event_rows(events: Sequence[EventCreate], keys: Sequence[str | None]) -> list[tuple[Any, ...]]:
    """(type, timestamp, data, call key) of each server-recorded event, a key repeated in the
    batch once."""
    rows, seen = [], set()
    for e, key in zip(events, keys, strict=True):
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        rows.append((e.type, e.timestamp, to_json(e.data), key))
    return rows


def event_from_row(row: tuple[Any, ...]) -> Event:
    """An event from ``rollout_id, attempt_id, sequence, type, timestamp, data, id, source``."""
    rollout_id, attempt_id, seq, kind, ts, data, event_id, source = row
    return Event(
        id=event_id,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence=seq,
        type=kind,
        timestamp=ts,
        data=from_json(data),
        source=source,
    )


def event_cursor(last: Event) -> str:
    """The cursor of the page that follows ``last``."""
    return f"{last.timestamp!r}:{last.id}"


def parse_event_cursor(cursor: str) -> tuple[float, int]:
    try:
        ts, last = cursor.rsplit(":", 1)
        return float(ts), int(last)
    except ValueError:
        raise ValueError(f"invalid cursor {cursor!r}") from None


def int_cursor(cursor: str) -> int:
    try:
        return int(cursor)
    except ValueError:
        raise ValueError(f"invalid cursor {cursor!r}") from None


def page_limit(limit: int) -> int:
    return max(1, min(int(limit), MAX_PAGE))


def finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None
