"""One ``llm_call`` record per logical model call, however often its client retried it.

OpenAI's clients retry a call that failed or timed out (twice by default), sending the same body
with a growing ``x-stainless-retry-count``; other clients send an ``Idempotency-Key``. The
gateway sees each try as a call of its own; the store keeps one record per logical call:

- A try with a key joins the record of that key (``call_key`` ``key:<key>``); the record keeps
  the sha256 of the key's first body (``request_sha256``): the gateway refuses the key sent with
  another body (422, before forwarding it; :meth:`~agentbolt.store.SqlStore.attempt_state`).
- Without a key, a try whose retry count is above 0 joins the latest record with the same body
  (``sha256:<hash of the body>``) that lacks that retry count; when there is none (its first
  try is still running: the client timed out) it starts a record marked as waiting for its
  first try (``sha256:<hash>:retried``). A try 0 joins such a waiting record, else starts a new
  one; so does a call without a retry count. Two calls with the same body that are not retries
  are two calls.
- The data of the latest try wins (it holds the answer the agent got), even when an earlier,
  slow try finishes after it. The record keeps its id and the earliest try's timestamp (when
  the logical call started, so the conversation keeps its order); ``tries`` lists the retry
  counts recorded and ``retries`` how many tries there were beyond the first.

Each try reads at most a few records, through the index on (attempt, call key, id): an agent
that sends the same body a thousand times does not make each call read a thousand records.

Known limit: when two calls with the same body overlap and the second one's first try is slow,
its retry may join the first call's record (the count of records stays right).

Transactions that record calls of one attempt run one after another
(:meth:`~agentbolt.store.database.Database.serialize`), so that two tries finishing together
never both find their call unrecorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from agentbolt.errors import NotFound
from agentbolt.store.database import Database, Tx
from agentbolt.store.rows import from_json, to_json

__all__ = ["CALLS_LOCK", "CallEvent", "CallRecord", "NewEvent", "record_call", "record_new_call"]

# serialize() section of the records of one attempt's calls and spans
CALLS_LOCK = 2
# a retry whose call has several records with its body looks this far back for its own
_RECENT = 8


class NewEvent(Protocol):
    """What recording a call reads of its event: an :class:`~agentbolt.schemas.EventCreate`,
    or a :class:`CallEvent`."""

    @property
    def type(self) -> str: ...
    @property
    def timestamp(self) -> float: ...
    @property
    def data(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class CallEvent:
    """An ``llm_call`` event the gateway built itself from parsed JSON: nothing for
    validation to catch, so no pydantic model (building one cost a tenth of the store's part
    of a call)."""

    type: str
    timestamp: float
    data: dict[str, Any]


@dataclass(frozen=True)
class CallRecord:
    """Where a try of a model call was recorded: ``id`` is the ``llm_call`` event's id (the
    call id the gateway hands the agent), ``new`` whether this try started that record. True
    as a boolean when it did (what ``record_call`` answered before it gave the id)."""

    id: int
    new: bool

    def __bool__(self) -> bool:
        return self.new


@dataclass(frozen=True)
class _Record:
    """A stored ``llm_call`` event that a try may join."""

    id: int
    timestamp: float
    data: dict[str, Any]


def record_call(
    tx: Tx,
    db: Database,
    attempt_id: str,
    event: NewEvent,
    key: str | None,
    body_sha256: str,
    retry: int | None,
) -> CallRecord:
    """Record one try of a model call: the id of its record, and whether this try started it
    (it joined the record of its logical call otherwise). :class:`NotFound` when the attempt
    does not exist."""
    db.serialize(tx, CALLS_LOCK, attempt_id)
    settled = f"key:{key}" if key is not None else f"sha256:{body_sha256}"
    earlier = _earlier_try(tx, attempt_id, settled, keyed=key is not None, retry=retry)
    if earlier is not None:
        merged = _merged(earlier.data, event.data, retry)
        waiting = key is None and 0 not in merged["tries"]
        tx.run(
            "UPDATE events SET timestamp = ?, data = ?, call_key = ? WHERE id = ?",
            (
                min(earlier.timestamp, event.timestamp),
                to_json(merged),
                f"{settled}:retried" if waiting else settled,
                earlier.id,
            ),
        )
        return CallRecord(earlier.id, new=False)
    waiting = key is None and retry is not None and retry > 0
    data = {**event.data, "retries": 0, "tries": [retry or 0]}
    added = tx.one(
        "INSERT INTO events (rollout_id, attempt_id, type, timestamp, data, call_key, source, request_sha256) "
        "SELECT rollout_id, id, ?, ?, ?, ?, 'gateway', ? FROM attempts WHERE id = ? RETURNING id",
        (
            event.type,
            event.timestamp,
            to_json(data),
            f"{settled}:retried" if waiting else settled,
            body_sha256 if key is not None else None,
            attempt_id,
        ),
    )
    if added is None:
        raise NotFound("attempt", attempt_id)
    return CallRecord(int(added[0]), new=True)


def record_new_call(
    tx: Tx, attempt_id: str, event: NewEvent, key: str | None, body_sha256: str, retry: int | None
) -> CallRecord | None:
    """The usual case in one statement: a try that no earlier record can be joined to
    starts its record; ``None`` when there is one to join (or no such attempt), which
    :func:`record_call` then handles. Only where one statement is atomic against every other
    writer (SQLite: one writer at a time), and never for a retry (retry count above 0), whose
    record is picked by its data."""
    if retry is not None and retry > 0:
        return None
    settled = f"key:{key}" if key is not None else f"sha256:{body_sha256}"
    if key is not None:
        joins: list[str] = [settled]
    elif retry == 0:
        joins = [f"{settled}:retried"]  # a record made by its retry, waiting for it
    else:
        joins = []  # nothing says it is a try of an earlier call
    marks = ", ".join("?" * len(joins))
    where = f" AND NOT EXISTS (SELECT 1 FROM events WHERE attempt_id = ? AND call_key IN ({marks}))"
    where = where if joins else ""
    data = {**event.data, "retries": 0, "tries": [retry or 0]}
    added = tx.one(
        "INSERT INTO events (rollout_id, attempt_id, type, timestamp, data, call_key, source, request_sha256) "
        f"SELECT rollout_id, id, ?, ?, ?, ?, 'gateway', ? FROM attempts WHERE id = ?{where} RETURNING id",
        (
            event.type,
            event.timestamp,
            to_json(data),
            settled,
            body_sha256 if key is not None else None,
            attempt_id,
            *((attempt_id, *joins) if joins else ()),
        ),
    )
    return CallRecord(int(added[0]), new=True) if added is not None else None


def _earlier_try(tx: Tx, attempt_id: str, settled: str, keyed: bool, retry: int | None) -> _Record | None:
    """The record this try joins; None when it is a new logical call."""
    if keyed:
        keys, limit = [settled], 1
    elif retry is None:
        return None  # nothing says it is a retry
    elif retry == 0:
        keys, limit = [f"{settled}:retried"], 1  # a record made by its retry, waiting for it
    else:
        keys, limit = [settled, f"{settled}:retried"], _RECENT
    marks = ", ".join("?" * len(keys))
    rows = tx.all(
        f"SELECT id, timestamp, data FROM events WHERE attempt_id = ? AND call_key IN ({marks}) "
        "ORDER BY id DESC LIMIT ?",
        (attempt_id, *keys, limit),
    )
    for event_id, ts, text in rows:
        data = from_json(text)
        if keyed or retry not in _tries(data):
            return _Record(event_id, ts, data)
    return None


def _merged(old: dict[str, Any], new: dict[str, Any], retry: int | None) -> dict[str, Any]:
    """The record once a try joined it: the data of the latest try, with the tries counted."""
    tries = _tries(old)
    # with a key, a count missing or seen already (a client that sent the call again as a new
    # request, its count back at 0) says nothing about order: the later arrival is the later try
    this = retry if retry is not None and retry not in tries else max(tries) + 1
    latest = new if this > max(tries) else old
    seen = sorted({*tries, this})
    return {**latest, "retries": len(seen) - 1, "tries": seen}


def _tries(data: dict[str, Any]) -> list[int]:
    tries = data.get("tries")
    return [int(t) for t in tries] if isinstance(tries, list) and tries else [0]
