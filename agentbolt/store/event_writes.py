"""The store's writes of events: the runner's batches, the agent's posts to its events URL,
and the records the server makes itself (model calls, spans).

A part of :class:`~agentbolt.store.sql.SqlStore` (its base class), in a module of its own to
keep each under 500 lines. With an idempotency key, a batch (the runner's or the agent's) keeps
its key, the hash of its body and its answer in ``request_keys`` in the batch's transaction
(:mod:`.keys`): a repeat gets the first answer, a different body under the key a 422. The
agent's posts count against its attempt's quotas (:mod:`.quotas`) in the same transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbolt.schemas import EventCreate, EventSource, now
from agentbolt.store.calls import CALLS_LOCK, CallRecord, NewEvent, record_call, record_new_call
from agentbolt.store.database import Database
from agentbolt.store.keys import first_answer, keep_answer, request_sha256
from agentbolt.store.quotas import EventQuota, charge_agent_events
from agentbolt.store.rows import event_rows, keyed_event_rows
from agentbolt.store.statements import (
    EVENTS_PER_INSERT,
    RUNNING,
    attempt_row,
    check_call_refs,
    events_insert,
    held,
    insert_events,
    insert_keyed_events,
)

__all__ = ["EventWrites"]

_BATCH = "batch of events"  # what a reused key was first sent with, as its 422 says


class EventWrites:
    """Event writes over ``self.db`` (see the module docstring)."""

    db: Database

    def _tx(self) -> Any:
        return self.db.transaction()

    def _read(self) -> Any:
        return self.db.autocommit()

    @property
    def backend(self) -> str:
        return self.db.name

    def add_events(
        self,
        attempt_id: str,
        events: Sequence[EventCreate],
        worker_id: str | None = None,
        source: EventSource = EventSource.RUNNER,
        key: str | None = None,
    ) -> int:
        """Append events to a running attempt; a (attempt, sequence) already stored is skipped.
        Returns how many were new. ``source``: who posts them (the route says, from the
        credential). With ``key`` (the request's idempotency key) a repeat returns the first
        answer, and the key sent with another batch is
        :class:`~agentbolt.errors.IdempotencyKeyReused`."""
        rows = event_rows(events)
        if key is not None:
            return self._add_keyed_batch(attempt_id, events, rows, worker_id, source, key)
        with self._events_tx(rows) as tx:
            new = insert_events(tx, attempt_id, rows, running=True, worker_id=worker_id, source=source)
            if new == 0:  # nothing stored: not held (say why), or every event a repeat
                held(tx, attempt_id, worker_id)
            return new

    def _add_keyed_batch(
        self,
        attempt_id: str,
        events: Sequence[EventCreate],
        rows: list[tuple[Any, ...]],
        worker_id: str | None,
        source: EventSource,
        key: str,
    ) -> int:
        scope, sha256 = f"events:{attempt_id}", request_sha256(worker_id, events)
        if self.backend == "postgres" and 0 < len(rows) <= EVENTS_PER_INSERT:  # (VALUES ) is no SQL
            return self._add_keyed_batch_at_once(attempt_id, rows, worker_id, source, (scope, key), sha256)
        with self._tx() as tx:
            # two statements: the events unless the key is known, then the key (or its first answer)
            new = insert_events(tx, attempt_id, rows, True, worker_id, source, unless=(scope, key))
            first = keep_answer(tx, scope, key, sha256, str(new), _BATCH)
            if first is not None:
                return int(first)
            if new == 0:  # not held (say why: the key goes with the rollback), or all repeats
                held(tx, attempt_id, worker_id)
            return new

    def _add_keyed_batch_at_once(
        self,
        attempt_id: str,
        rows: list[tuple[Any, ...]],
        worker_id: str | None,
        source: EventSource,
        scoped_key: tuple[str, str],
        sha256: str,
    ) -> int:
        """:meth:`_add_keyed_batch` on PostgreSQL in one statement (no BEGIN and COMMIT round
        trips on the runner's hot path): the events unless the key is known, and the key with
        their count while the attempt is held. Known limit: two different batches sent under
        one key at the same moment, to two replicas, may both store their events (the later
        one still answers 422); a retry, which sends the same batch, never stores twice."""
        insert, params = events_insert(attempt_id, rows, True, worker_id, source, scoped_key)
        holder = " AND worker_id = ?" if worker_id is not None else ""
        sql = (
            f"WITH e AS ({insert} RETURNING 1) "
            "INSERT INTO request_keys (scope, key, body_sha256, answer, created_at) "
            "SELECT ?, ?, ?, CAST((SELECT COUNT(*) FROM e) AS TEXT), ? "
            f"WHERE EXISTS (SELECT 1 FROM attempts WHERE id = ? AND status = {RUNNING}{holder}) "
            "ON CONFLICT (scope, key) DO NOTHING RETURNING answer"
        )
        params += [*scoped_key, sha256, now(), attempt_id, *((worker_id,) if worker_id is not None else ())]
        with self._read() as tx:
            row = tx.one(sql, params)
            if row is not None:
                return int(row[0])
            first = first_answer(tx, *scoped_key, sha256, _BATCH)  # a repeat, or the key reused
            if first is not None:
                return int(first)
            held(tx, attempt_id, worker_id)  # why the attempt took nothing
            return 0

    def record_events(
        self,
        attempt_id: str,
        events: Sequence[EventCreate],
        keys: Sequence[str | None] | None = None,
        source: EventSource = EventSource.RUNNER,
    ) -> int:
        """Append events the server observed itself (gateway calls, OTLP spans). Unlike
        :meth:`add_events` the attempt may have ended: a span can arrive after the finish.
        ``keys`` (one per event, or None): an event whose key the attempt holds already is a
        repeat and skipped (a span's trace and span id)."""
        if keys is not None:
            return self._record_keyed(attempt_id, keyed_event_rows(events, keys), source)
        rows = event_rows(events)
        with self._events_tx(rows) as tx:
            new = insert_events(tx, attempt_id, rows, running=False, worker_id=None, source=source)
            if new == 0:
                attempt_row(tx, attempt_id)  # NotFound when there is no such attempt
            return new

    def _record_keyed(self, attempt_id: str, rows: list[tuple[Any, ...]], source: EventSource) -> int:
        with self._tx() as tx:
            self.db.serialize(tx, CALLS_LOCK, attempt_id)
            new = insert_keyed_events(tx, attempt_id, rows, source)
            if new == 0:
                attempt_row(tx, attempt_id)
            return new

    def record_call(
        self, attempt_id: str, event: NewEvent, key: str | None, body_sha256: str, retry: int | None
    ) -> CallRecord:
        """Record one try of a model call the gateway forwarded: a new ``llm_call`` event, or
        (false as a boolean) this try joined the record of its logical call (see :mod:`.calls`);
        either way the record's id, the call id the gateway returns to the agent."""
        if self.backend == "sqlite":  # one statement, no BEGIN/COMMIT, for a call's first try
            with self.db.autocommit() as tx:
                added = record_new_call(tx, attempt_id, event, key, body_sha256, retry)
            if added is not None:
                return added
        with self._tx() as tx:
            return record_call(tx, self.db, attempt_id, event, key, body_sha256, retry)

    def add_agent_events(
        self,
        attempt_id: str,
        events: Sequence[EventCreate],
        key: str | None,
        worker_id: str | None = None,
        source: EventSource = EventSource.AGENT,
        quota: EventQuota | None = None,
    ) -> int:
        """Append events posted to an attempt's events URL while it runs. They carry no
        sequence (the runner numbers its own events; the store's order is theirs); with ``key``
        (the request's idempotency key) a repeat of the request stores nothing new and gets the
        first answer, another body under it is :class:`~agentbolt.errors.IdempotencyKeyReused`.
        An ended attempt is :class:`~agentbolt.errors.AttemptEnded` naming its state; a
        per-call reward or state naming no model call of this attempt
        :class:`~agentbolt.errors.InvalidInput`. An agent's own posts (``source`` agent) count
        against ``quota``: over it, :class:`~agentbolt.errors.QuotaExceeded` and nothing stored."""
        keys = [f"agent:{key}:{i}" if key is not None else None for i in range(len(events))]
        rows = keyed_event_rows(events, keys)
        scope, sha256 = f"agent:{attempt_id}", request_sha256(events) if key is not None else ""
        with self._tx() as tx:
            self.db.serialize(tx, CALLS_LOCK, attempt_id)
            if key is not None and (first := first_answer(tx, scope, key, sha256, _BATCH)) is not None:
                return int(first)
            if worker_id is not None:  # a worker token posts only to attempts its worker holds
                held(tx, attempt_id, worker_id)
            check_call_refs(tx, attempt_id, events)
            if quota is not None and source == EventSource.AGENT and rows:
                charge_agent_events(tx, attempt_id, rows, quota)
            new = insert_keyed_events(tx, attempt_id, rows, source, running=True)
            if new == 0:  # nothing stored: not running (say why), or an empty list
                held(tx, attempt_id, worker_id)
            if key is not None:  # checked above, under the attempt's lock: the key is new
                keep_answer(tx, scope, key, sha256, str(new), _BATCH)
            return new

    def _events_tx(self, rows: list[tuple[Any, ...]]) -> Any:
        """One INSERT commits on its own; several (a batch over ``EVENTS_PER_INSERT``) need a
        transaction, so that an attempt ending meanwhile gets all of them or none."""
        return self._tx() if len(rows) > EVENTS_PER_INSERT else self._read()
