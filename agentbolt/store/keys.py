"""Idempotency keys that name one request: a repeat gets the first answer, a reuse a 422.

A client makes one ``Idempotency-Key`` per logical write and sends it again with each retry
of that write. The store keeps, with the key, the sha256 of the request's canonical form
(:func:`request_sha256`: the JSON of what the caller sent, keys sorted, fields it left out
left out). A repeat whose hash matches gets the first answer; one whose hash differs is
:class:`~agentbolt.errors.IdempotencyKeyReused` (422), never the first answer or any part of it.

Where the key lives: on the row its request created where there is one (an attempt's
``claim_sha256`` and ``finish_sha256``, a resources version's and a reward score's
``request_sha256``, a gateway call's record), so the hot paths write it in the statement they
run anyway; the writes that create no single row (an enqueue, a batch of events) keep it in
``request_keys``, one row per (scope, key) with the first answer, in the write's transaction.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from pydantic import BaseModel

from agentbolt.errors import IdempotencyKeyReused
from agentbolt.schemas import now
from agentbolt.store.database import Tx

__all__ = ["check_same", "first_answer", "keep_answer", "request_sha256"]


def _fields(value: Any) -> Any:
    """What JSON holds of a model: the fields its caller set (orjson's ``default``: it asks
    only for what it cannot write itself, so plain data costs no Python code)."""
    if isinstance(value, BaseModel):
        return {name: getattr(value, name) for name in value.model_fields_set}
    raise TypeError(f"not JSON: {type(value).__name__}")


def request_sha256(*parts: Any) -> str:
    """The hash a key is stored with: of ``parts`` as JSON, keys sorted, each model as its
    caller set it (a default the server fills in, such as an event's timestamp, is not part
    of it)."""
    text = orjson.dumps(parts, default=_fields, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(text).hexdigest()


def check_same(stored: str | None, sha256: str, key: str, what: str) -> None:
    """Raise :class:`IdempotencyKeyReused` when the key was first sent with another request
    (``stored`` None: a row written before keys had hashes, taken as the same)."""
    if stored is not None and stored != sha256:
        raise IdempotencyKeyReused(
            f"Idempotency-Key {key!r} was first sent with another {what}: a key names one "
            "request, and its retries send the same body; make a new key for a new request"
        )


def first_answer(tx: Tx, scope: str, key: str, sha256: str, what: str) -> str | None:
    """The answer kept for ``key`` in ``scope`` (None: the key is new); a different request
    under it is :class:`IdempotencyKeyReused`."""
    row = tx.one("SELECT body_sha256, answer FROM request_keys WHERE scope = ? AND key = ?", (scope, key))
    if row is None:
        return None
    check_same(row[0], sha256, key, what)
    return str(row[1])


def keep_answer(tx: Tx, scope: str, key: str, sha256: str, answer: str, what: str) -> str | None:
    """Keep ``answer`` as the first answer for ``key`` and return None; when the key has one
    already (an earlier request, or a repeat that raced this one on another replica), return
    that, or raise :class:`IdempotencyKeyReused` when it came with another request. The write
    must then store nothing: a write checks the key in its own statements too (``NOT EXISTS``)."""
    added = tx.run(
        "INSERT INTO request_keys (scope, key, body_sha256, answer, created_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (scope, key) DO NOTHING",
        (scope, key, sha256, answer, now()),
    )
    if added:
        return None
    first = first_answer(tx, scope, key, sha256, what)
    assert first is not None  # the conflicting row is committed: DO NOTHING waited for it
    return first
