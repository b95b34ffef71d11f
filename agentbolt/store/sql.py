"""The store: the only owner of state (queue, attempts, events, resources).

All queue logic lives in :class:`SqlStore`, written once in portable SQL with ``?`` placeholders.
A backend (:mod:`.sqlite`, :mod:`.postgres`) supplies only a :class:`~.database.Database` —
connections, transactions (and statements that commit on their own), placeholder style, the
planner's statistics — and the few words that differ: how dequeue locks the row it claims, the
schema's types. The schema and its migrations are in :mod:`.schema`, the mapping of rows to
models in :mod:`.rows`, the reads in :mod:`.queries`. The store is synchronous; the server
decides how to call it (directly for SQLite, from a thread for PostgreSQL).

The hot operations are few statements each, since on PostgreSQL every statement is a round
trip: a claim is one ``UPDATE ... RETURNING``, the attempt's ``INSERT`` and the worker's row; a
batch of events one ``INSERT ... SELECT`` that checks the attempt in the same statement; a
finish two ``UPDATE`` statements.

Retried writes: every write a client may repeat takes the request's idempotency key and keeps
it on the row the first request created, in the same transaction, so a repeat finds it there
(for as long as that row exists) and answers with the first result: an enqueue derives the ids
of its new rollouts from the key, a dequeue keeps it on its attempt, a finish on the attempt it
ended, a publish on its resources version.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from typing import Any

from agentbolt.errors import AttemptEnded, NotFound
from agentbolt.schemas import (
    Attempt,
    AttemptFinish,
    AttemptStatus,
    Claim,
    Resources,
    ResourcesCreate,
    RewardCreate,
    RewardSlot,
    RewardSource,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
    Worker,
    check_transition,
    new_id,
    now,
)
from agentbolt.store.database import Database, Tx
from agentbolt.store.event_writes import EventWrites
from agentbolt.store.keys import check_same, first_answer, keep_answer, request_sha256
from agentbolt.store.queries import Queries
from agentbolt.store.rewards import keyed_score, write_reward
from agentbolt.store.rows import (
    ATTEMPT_COLS,
    RETURNED_ROLLOUT,
    from_json,
    rollout_from_row,
    to_json,
)
from agentbolt.store.schema import migrate
from agentbolt.store.statements import (
    CLAIMED_WITH,
    LATEST_VERSION,
    NEXT_QUEUED,
    RUNNING,
    cancel_running,
    claim_made,
    end_attempt,
    expire_lapsed,
    held,
    insert_rollout,
    insert_version,
    rollouts_by_id,
    touch_worker,
)

__all__ = [
    "AGENT_KEY_PREFIX",
    "WORKER_TOKEN_PREFIX",
    "Database",
    "SqlStore",
    "Tx",
    "keyed_rollout_id",
    "token_sha256",
]

DEFAULT_LEASE_SECONDS = 30.0
# dequeue ends lapsed attempts itself at most this often (seconds); the server's sweep runs too
EXPIRE_EVERY = 0.05
# serialize() key of publish_resources (any constant distinct from other serialized sections)
_PUBLISH_LOCK = 1
# serialize() key of the repeats of one dequeue (with ``on``: the worker and the key)
_CLAIM_LOCK = 3
# serialize() key of the writes to one named reward (with ``on``: the rollout and the name)
_REWARD_LOCK = 4
# what the credentials the store issues start with, so the server can tell them from the
# tokens it was configured with
AGENT_KEY_PREFIX, WORKER_TOKEN_PREFIX = "ak_", "wt_"


def _credential(prefix: str) -> str:
    """A new credential: the prefix and 32 url-safe random characters (192 bits)."""
    return prefix + secrets.token_urlsafe(24)


def token_sha256(token: str) -> str:
    """What the store keeps of a worker token: a leaked database does not hand out the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def keyed_rollout_id(key: str, index: int) -> str:
    """The id of the ``index``-th item of an enqueue with idempotency key ``key`` (an item
    without an id of its own): a retried enqueue names the same rollouts."""
    return "ro-" + hashlib.sha256(f"{key}:{index}".encode()).hexdigest()[:24]


class SqlStore(EventWrites, Queries):
    """Queue with leases, attempts, events and versioned resources over a :class:`Database`."""

    def __init__(self, db: Database, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        super().__init__(db)
        self.lease_seconds = lease_seconds
        self._expired_at = -math.inf  # when dequeue last ended lapsed attempts
        migrate(db)

    @property
    def backend(self) -> str:
        return self.db.name

    def close(self) -> None:
        self.db.close()

    def _tx(self) -> Any:
        """A transaction (a context manager yielding its :class:`Tx`)."""
        return self.db.transaction()

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, items: Sequence[RolloutCreate], key: str | None = None) -> list[Rollout]:
        """Create rollouts (and their tasks). An item whose ``id`` exists already is returned as
        is; with ``key``, items without an id get ids derived from it (:func:`keyed_rollout_id`),
        so a repeat returns the first enqueue's rollouts (the key sent with other items is
        :class:`~agentbolt.errors.IdempotencyKeyReused`). A task id stored with other data or
        metadata is a :class:`~agentbolt.errors.Conflict`."""
        ts = now()
        ids = [item.id or (keyed_rollout_id(key, i) if key else new_id("ro")) for i, item in enumerate(items)]
        tasks: dict[str, Task] = {}
        sha256 = request_sha256(items) if key is not None else ""
        with self._tx() as tx:
            if key is not None and (first := first_answer(tx, "enqueue", key, sha256, "enqueue")):
                return rollouts_by_id(tx, from_json(first))
            for rid, item in zip(ids, items, strict=True):
                insert_rollout(tx, rid, item, ts, fixed=item.id is not None or key is not None, tasks=tasks)
            if key is not None and (
                earlier := keep_answer(tx, "enqueue", key, sha256, to_json(ids), "enqueue")
            ):
                ids = from_json(earlier)  # a repeat that raced this one on another replica
            created = rollouts_by_id(tx, ids)
        self.db.inserted(("rollouts", "tasks"), len(items))
        return created

    # ------------------------------------------------------------------ dequeue and leases

    def dequeue(
        self, worker_id: str, lease_seconds: float | None = None, key: str | None = None
    ) -> Claim | None:
        """Claim one new attempt for the oldest queued rollout, or return None. With ``key``, a
        repeat (by the same worker) returns the claim the first one made, even if its answer was
        lost or it is still being made, and never claims a second rollout. The attempt gets its
        own agent key (:attr:`Claim.agent_key`); a repeat returns the same one.

        One transaction: end lapsed attempts first (so their rollouts can be claimed now; at
        most every ``EXPIRE_EVERY`` seconds per store, the server's sweep does the rest), then
        claim: one UPDATE picks, marks and returns the rollout (its task read in the same
        statement), one INSERT records the attempt."""
        lease = lease_seconds or self.lease_seconds
        ts = now()
        with self._tx() as tx:
            if key is not None:
                # repeats of one dequeue run one after another, so that each sees what an
                # earlier one claimed (one that found every queued row locked by an earlier one
                # would answer "no work" while that one claims)
                self.db.serialize(tx, _CLAIM_LOCK, f"{worker_id}:{key}")
            if ts - self._expired_at >= EXPIRE_EVERY or ts < self._expired_at:
                expire_lapsed(tx, ts)
                self._expired_at = ts
            sha256 = request_sha256(worker_id, lease_seconds) if key is not None else None
            claimed = self._claim(tx, worker_id, ts, lease, key, sha256)
            touch_worker(tx, worker_id, ts, claimed=int(claimed is not None))
            if claimed is None and key is not None and sha256 is not None:
                claimed = claim_made(tx, worker_id, key, sha256)  # a repeat: the first one's claim
        return self._as_claim(*claimed, lease) if claimed is not None else None

    def _as_claim(self, rollout: Rollout, attempt: Attempt, agent_key: str | None, lease: float) -> Claim:
        version = rollout.resources_version
        resources = self.get_resources(version) if version is not None else None
        return Claim(
            rollout=rollout, attempt=attempt, resources=resources, lease_seconds=lease, agent_key=agent_key
        )

    def _claim(
        self, tx: Tx, worker_id: str, ts: float, lease: float, key: str | None, sha256: str | None
    ) -> tuple[Rollout, Attempt, str | None] | None:
        """Mark the oldest queued rollout running and insert its new attempt; with ``key``,
        only if this worker made no claim with that key yet (checked in the same statement: a
        repeat costs no extra round trip until it finds nothing to claim)."""
        unclaimed = f" AND NOT EXISTS ({CLAIMED_WITH})" if key is not None else ""
        row = tx.one(
            f"UPDATE rollouts SET status = ?, attempts = attempts + 1, last_attempt = last_attempt + 1, "
            f"resources_version = COALESCE(resources_version, {LATEST_VERSION}), "
            f"started_at = COALESCE(started_at, ?), updated_at = ? "
            f"WHERE qseq = ({NEXT_QUEUED} {self.db.claim_lock}){unclaimed} "
            f"RETURNING {RETURNED_ROLLOUT}, last_attempt",
            (RolloutStatus.RUNNING.value, ts, ts) + ((worker_id, key) if key is not None else ()),
        )
        if row is None:
            return None
        rollout, number = rollout_from_row(row[:-1]), row[-1]
        timeout = rollout.timeout_seconds
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
        agent_key = _credential(AGENT_KEY_PREFIX)
        tx.run(
            f"INSERT INTO attempts ({ATTEMPT_COLS}, deadline, claim_key, agent_key, claim_sha256) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?)",
            (
                attempt.id,
                rollout.id,
                number,
                worker_id,
                AttemptStatus.RUNNING.value,
                ts,
                ts,
                ts + lease,
                ts + timeout if timeout else None,
                key,
                agent_key,
                sha256,
            ),
        )
        return rollout, attempt, agent_key

    def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        """Extend the lease of a running attempt (409 :class:`~agentbolt.errors.AttemptEnded`
        when it ended, e.g. cancelled, or when its lease already lapsed: the sweep may have
        requeued the rollout by now; 409 ``LeaseLost`` when another worker holds it)."""
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
                raise AttemptEnded(f"attempt {attempt_id!r} ended meanwhile, it is no longer running")
            touch_worker(tx, attempt.worker_id, ts, claimed=0)
            return attempt.model_copy(update={"heartbeat_at": ts, "lease_expires_at": expires})

    def expire(self, ts: float | None = None) -> int:
        """End attempts whose lease lapsed (their rollouts are requeued while attempts remain)
        or whose rollout timed out (failed)."""
        ts = ts or now()
        with self._tx() as tx:
            return expire_lapsed(tx, ts)

    # ------------------------------------------------------------------ finishing

    def finish_attempt(
        self, attempt_id: str, finish: AttemptFinish, worker_id: str | None = None, key: str | None = None
    ) -> Rollout:
        """End a running attempt. Success ends the rollout, failure fails it (the agent would
        fail again); ``released`` (a runner stopping) requeues it without using up an attempt.
        A repeat of the finish that ended the attempt (same ``key``) returns the rollout; the key
        sent with another outcome is :class:`~agentbolt.errors.IdempotencyKeyReused`."""
        ts = now()
        sha256 = request_sha256(finish) if key is not None else None
        with self._tx() as tx:
            status = AttemptStatus(finish.status)
            rollout = end_attempt(tx, attempt_id, finish, status, ts, worker_id, key, sha256)
            if rollout is not None:
                return rollout
            if key is not None and sha256 is not None:
                mine = tx.one(
                    "SELECT rollout_id, finish_sha256 FROM attempts WHERE id = ? AND finish_key = ?",
                    (attempt_id, key),
                )
                if mine is not None:
                    check_same(mine[1], sha256, key, "outcome")
                    return rollouts_by_id(tx, [mine[0]])[0]
            held(tx, attempt_id, worker_id)  # NotFound, AttemptEnded or LeaseLost, with the reason
            raise AttemptEnded(f"attempt {attempt_id!r} ended meanwhile, it is no longer running")

    def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a queued or running rollout and end its running attempt as ``cancelled``.
        Cancelling a cancelled rollout returns it; a succeeded or failed one is a 409."""
        ts = now()
        with self._tx() as tx:
            rollout = _one_rollout(tx, rollout_id)
            if rollout.status == RolloutStatus.CANCELLED:
                return rollout
            check_transition("rollout", rollout_id, rollout.status, RolloutStatus.CANCELLED)
            # the attempt's row before the rollout's, the order a finish or an expiry takes them
            # in: the other order could deadlock with them on PostgreSQL
            cancel_running(tx, rollout_id, ts)
            live = [s.value for s in RolloutStatus if not s.is_final]
            changed = tx.run(
                "UPDATE rollouts SET status = ?, updated_at = ?, ended_at = ? WHERE id = ? AND status IN (?, ?)",
                (RolloutStatus.CANCELLED.value, ts, ts, rollout_id, *live),
            )
            if changed != 1:  # ended by another replica since we read it
                final = _one_rollout(tx, rollout_id)
                if final.status != RolloutStatus.CANCELLED:
                    check_transition("rollout", rollout_id, final.status, RolloutStatus.CANCELLED)
                return final
            cancel_running(tx, rollout_id, ts)  # claimed between the two statements above
            return _one_rollout(tx, rollout_id)

    # ------------------------------------------------------------------ named rewards

    def add_reward(
        self,
        rollout_id: str,
        create: RewardCreate,
        *,
        source: RewardSource,
        author: str | None,
        key: str | None = None,
    ) -> RewardSlot:
        """Score a named reward of a finished rollout: its slot's next revision. A repeat of
        ``key`` returns the slot as the first request left it and stores nothing. Otherwise:
        an unknown rollout is :class:`~agentbolt.errors.NotFound`; a queued, running or
        cancelled one a ``Conflict``; a slot another source gives ``Forbidden``; ``replaces``
        other than the slot's revision (someone scored meanwhile) a ``Conflict`` naming who; a
        score off the slot's scale ``InvalidInput``. Writes to one slot run one after another."""
        with self._tx() as tx:
            if key is not None:  # the key first, the slot second: every write takes them in this order
                self.db.serialize(tx, _REWARD_LOCK, f"key\n{key}")
            self.db.serialize(tx, _REWARD_LOCK, f"{rollout_id}\n{create.name}")
            sha256 = request_sha256(create) if key is not None else None
            if key is not None and (first := keyed_score(tx, rollout_id, create, key, sha256 or "")):
                return first
            rollout = _one_rollout(tx, rollout_id)
            return write_reward(tx, rollout, create, source, author, key, now(), sha256)

    # ------------------------------------------------------------------ workers

    def register_worker(self, name: str | None = None) -> tuple[str, str]:
        """Issue a new worker identity: ``(worker_id, worker_token)``. The id is the ``name``
        hint with a random suffix, so a registration never takes over an existing worker; only
        the token's sha256 is kept."""
        worker_id = f"{name or 'worker'}-{secrets.token_hex(6)}"
        token = _credential(WORKER_TOKEN_PREFIX)
        with self._tx() as tx:
            tx.run(
                "INSERT INTO workers (id, last_seen, claims, token_sha256) VALUES (?, ?, 0, ?)",
                (worker_id, now(), token_sha256(token)),
            )
        return worker_id, token

    def revoke_worker(self, worker_id: str) -> Worker:
        """Revoke a worker: its token is refused from now on (by every server replica within
        :data:`~agentbolt.server.middleware.RECHECK_S` seconds), no token may claim or renew work
        under its id, and its running attempts end now, as if their leases had lapsed (their
        rollouts are requeued while attempts remain). Revoking again changes nothing."""
        ts = now()
        with self._tx() as tx:
            changed = tx.run(
                "UPDATE workers SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (ts, worker_id)
            )
            if not changed and tx.one("SELECT 1 FROM workers WHERE id = ?", (worker_id,)) is None:
                raise NotFound("worker", worker_id)
            running = tx.all(
                f"SELECT id FROM attempts WHERE worker_id = ? AND status = {RUNNING} ORDER BY id",
                (worker_id,),
            )
            finish = AttemptFinish(status=AttemptStatus.FAILED, error=f"worker {worker_id!r} was revoked")
            for (attempt_id,) in running:
                end_attempt(tx, attempt_id, finish, AttemptStatus.LEASE_EXPIRED, ts, worker_id)
        return self.get_worker(worker_id)

    # ------------------------------------------------------------------ resources

    def publish_resources(self, create: ResourcesCreate, key: str | None = None) -> Resources:
        """Store a new resources version (a ``trial`` one never becomes the latest). A repeat
        with the same ``key`` returns the version the first one stored."""
        ts = now()
        with self._tx() as tx:
            # two replicas publishing at once must not both read the same MAX(version)
            self.db.serialize(tx, _PUBLISH_LOCK)
            sha256 = request_sha256(create) if key is not None else None
            if key is not None and (
                first := tx.one("SELECT version, request_sha256 FROM resources WHERE request_key = ?", (key,))
            ):
                check_same(first[1], sha256 or "", key, "resources")
                version = first[0]
            else:
                version = insert_version(tx, create, key, ts, sha256)
        return self.get_resources(version)


def _one_rollout(tx: Tx, rollout_id: str) -> Rollout:
    found = rollouts_by_id(tx, [rollout_id])
    if not found:
        raise NotFound("rollout", rollout_id)
    return found[0]
