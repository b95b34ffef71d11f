"""One ``llm_call`` record per logical model call, however often its client retried it.

OpenAI's clients retry a call that failed or timed out (twice by default), sending the same body
with a growing ``x-stainless-retry-count``; other clients send an ``Idempotency-Key``. The
gateway sees each try as a call of its own; the store keeps one record per logical call:

- The record's ``call_key`` is ``key:<Idempotency-Key>`` or ``sha256:<hash of the body>``.
- A try joins the record of its logical call: with a key, the record of that key; without one,
  a try whose retry count is above 0 joins the latest record with the same body that lacks that
  retry count. A try 0 (or a call without a retry count) starts a new record: two calls with the
  same body that are not retries are two calls.
- The data of the latest try wins (it holds the answer the agent got), even when an earlier,
  slow try finishes after it: a try 0 that finds a record made by its own retry joins it and
  keeps the retry's data. The record keeps its id and the earliest try's timestamp (when the
  logical call started, so the conversation keeps its order); ``tries`` lists the retry counts recorded and
  ``retries`` how many tries there were beyond the first.

Known limit: when two calls with the same body overlap and the second one's first try is slow,
its retry may join the first call's record (the count of records stays right).

Transactions that record calls of one attempt run one after another
(:meth:`~agentbolt.store.database.Database.serialize`), so that two tries finishing together
never both find their call unrecorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentbolt.errors import NotFound
from agentbolt.schemas import EventCreate
from agentbolt.store.database import Database, Tx
from agentbolt.store.rows import from_json, to_json

__all__ = ["CALLS_LOCK", "record_call"]

# serialize() section of the records of one attempt's calls and spans
CALLS_LOCK = 2


def record_call(
    tx: Tx,
    db: Database,
    attempt_id: str,
    event: EventCreate,
    key: str | None,
    body_sha256: str,
    retry: int | None,
) -> bool:
    """Record one try of a model call; True when it started a new record, False when it
    joined the record of its logical call. :class:`NotFound` when the attempt does not exist."""
    call_key = f"key:{key}" if key is not None else f"sha256:{body_sha256}"
    db.serialize(tx, CALLS_LOCK, attempt_id)
    rows = tx.all(
        "SELECT id, timestamp, data FROM events WHERE attempt_id = ? AND call_key = ? ORDER BY id DESC",
        (attempt_id, call_key),
    )
    records = [_Record(event_id, ts, from_json(data)) for event_id, ts, data in rows]
    earlier = _joined(records, retry, keyed=key is not None)
    if earlier is not None:
        tx.run(
            "UPDATE events SET timestamp = ?, data = ? WHERE id = ?",
            (
                min(earlier.timestamp, event.timestamp),
                to_json(_merged(earlier.data, event.data, retry)),
                earlier.id,
            ),
        )
        return False
    data = {**event.data, "retries": 0, "tries": [retry or 0]}
    added = tx.run(
        "INSERT INTO events (rollout_id, attempt_id, type, timestamp, data, call_key) "
        "SELECT rollout_id, id, ?, ?, ?, ? FROM attempts WHERE id = ?",
        (event.type, event.timestamp, to_json(data), call_key, attempt_id),
    )
    if not added:
        raise NotFound("attempt", attempt_id)
    return True


@dataclass(frozen=True)
class _Record:
    """A stored ``llm_call`` event with the try's call key."""

    id: int
    timestamp: float
    data: dict[str, Any]


def _joined(records: list[_Record], retry: int | None, keyed: bool) -> _Record | None:
    """The record this try belongs to, among those with its call key (latest first); None when
    it is a new logical call."""
    for record in records:
        if keyed or (retry is not None and retry not in _tries(record.data)):
            return record
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
