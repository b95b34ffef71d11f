"""Named rewards: the statements behind a rollout's reward slots and their revisions.

A slot (``reward_slots``, one per rollout and name) is a reward as it stands: who gives it
(evaluator or reviewer), its scale, its state and its revision count; ``current_id`` points at
its latest revision in ``reward_scores``, which keeps every score ever given. Awaited slots are
inserted pending at enqueue; a score for a name the rollout did not await creates its slot.
:class:`~agentbolt.store.sql.SqlStore` decides the transactions; the functions here run inside
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbolt.errors import Conflict, Forbidden, IdempotencyKeyReused, InvalidInput
from agentbolt.schemas import (
    AwaitedReward,
    RewardCreate,
    RewardScale,
    RewardScore,
    RewardSlot,
    RewardSource,
    RewardState,
    Rollout,
    RolloutStatus,
)
from agentbolt.store.database import Tx
from agentbolt.store.keys import check_same
from agentbolt.store.rows import from_json, to_json

__all__ = [
    "PENDING",
    "SCORE_COLS",
    "SLOT_COLS",
    "SLOT_FROM",
    "attach_rewards",
    "insert_awaited",
    "keyed_score",
    "score_from_row",
    "write_reward",
]

# written into the SQL text (a fixed word), so the planner sees it: index reward_slots_state
PENDING = f"'{RewardState.PENDING.value}'"
SCORE_COLS = (
    "id, rollout_id, name, revision, source, author, state, score, value, error, comment, data, created_at"
)
# a slot and its current revision (all NULL while pending)
SLOT_COLS = (
    "s.rollout_id, s.name, s.source, s.scale, s.state, s.revision, s.updated_at, "
    "c.score, c.value, c.author, c.comment, c.error, c.data"
)
SLOT_FROM = "reward_slots s LEFT JOIN reward_scores c ON c.id = s.current_id"
# a rollout may be scored once it ended; not while it may still run, nor once cancelled
_UNSCORABLE = {
    RolloutStatus.QUEUED: "is queued",
    RolloutStatus.RUNNING: "is running",
    RolloutStatus.CANCELLED: "was cancelled",
}


def insert_awaited(tx: Tx, rollout_id: str, awaited: Sequence[AwaitedReward], ts: float) -> None:
    """The pending slots of a rollout just enqueued (a slot stored already stays as it is)."""
    for reward in awaited:
        tx.run(
            "INSERT INTO reward_slots (rollout_id, name, source, scale, state, revision, updated_at) "
            "VALUES (?, ?, ?, ?, ?, 0, ?) ON CONFLICT (rollout_id, name) DO NOTHING",
            (
                rollout_id,
                reward.name,
                reward.source.value,
                _scale_json(reward.scale),
                RewardState.PENDING.value,
                ts,
            ),
        )


def _scale_json(scale: RewardScale) -> str:
    return to_json(scale.model_dump(mode="json"))


def _slot_from_row(row: Sequence[Any]) -> RewardSlot:
    _, name, source, scale, state, revision, updated, score, value, author, comment, error, data = row
    return RewardSlot(
        name=name,
        source=RewardSource(source),
        scale=RewardScale.model_validate(from_json(scale)),
        state=RewardState(state),
        revision=revision,
        value=value,
        score=score,
        author=author,
        comment=comment,
        error=error,
        data=from_json(data),
        updated_at=updated,
    )


def score_from_row(row: Sequence[Any]) -> RewardScore:
    """A revision from the columns of :data:`SCORE_COLS`."""
    sid, rid, name, revision, source, author, state, score, value, error, comment, data, created = row
    return RewardScore(
        id=sid,
        rollout_id=rid,
        name=name,
        revision=revision,
        source=RewardSource(source),
        author=author,
        state=RewardState(state),
        score=score,
        value=value,
        error=error,
        comment=comment,
        data=from_json(data),
        created_at=created,
    )


def attach_rewards(tx: Tx, rollouts: Sequence[Rollout]) -> None:
    """Fill ``rewards`` of each rollout from its slots (one statement per 500 rollouts)."""
    by_id = {r.id: r for r in rollouts}
    ids = list(by_id)
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        marks = ", ".join("?" * len(chunk))
        rows = tx.all(f"SELECT {SLOT_COLS} FROM {SLOT_FROM} WHERE s.rollout_id IN ({marks})", chunk)
        for row in sorted(rows, key=lambda r: r[1]):
            by_id[row[0]].rewards[row[1]] = _slot_from_row(row)


def keyed_score(tx: Tx, rollout_id: str, create: RewardCreate, key: str, sha256: str) -> RewardSlot | None:
    """The slot as the write with idempotency key ``key`` left it (its revision and the slot's
    scale), or None when no write used that key. A key used for another rollout or reward, or
    with another body (its hash is not ``sha256``), is :class:`IdempotencyKeyReused`: a key
    names one request."""
    row = tx.one(f"SELECT {SCORE_COLS}, request_sha256 FROM reward_scores WHERE request_key = ?", (key,))
    if row is None:
        return None
    first, name = score_from_row(row[:-1]), create.name
    if (first.rollout_id, first.name) != (rollout_id, name):
        raise IdempotencyKeyReused(
            f"Idempotency-Key {key!r} was used for reward {first.name!r} of rollout "
            f"{first.rollout_id!r}; a key names one request: make a new key for a new request"
        )
    check_same(row[-1], sha256, key, "score")
    scale = tx.one("SELECT scale FROM reward_slots WHERE rollout_id = ? AND name = ?", (rollout_id, name))
    assert scale is not None  # a revision's slot is never deleted
    return RewardSlot(
        name=name,
        source=first.source,
        scale=RewardScale.model_validate(from_json(scale[0])),
        state=first.state,
        revision=first.revision,
        value=first.value,
        score=first.score,
        author=first.author,
        comment=first.comment,
        error=first.error,
        data=first.data,
        updated_at=first.created_at,
    )


def write_reward(
    tx: Tx,
    rollout: Rollout,
    create: RewardCreate,
    source: RewardSource,
    author: str | None,
    key: str | None,
    ts: float,
    sha256: str | None = None,
) -> RewardSlot:
    """Check the write against the rollout and its slot (``rollout`` as read in ``tx``, its
    rewards attached), then store it as the slot's next revision. The caller serializes writes
    to one slot (two first scores must not both find revision 0) and has checked ``key`` for a
    repeat."""
    if (why := _UNSCORABLE.get(rollout.status)) is not None:
        raise Conflict(f"rollout {rollout.id!r} {why}: rewards are given to finished rollouts")
    slot = rollout.rewards.get(create.name)
    if slot is not None and slot.source != source:
        raise Forbidden(f"reward {create.name!r} is given by {slot.source.value}s, not by {source.value}s")
    revision = slot.revision if slot is not None else 0
    if (create.replaces or 0) != revision:
        raise Conflict(_scored_meanwhile(rollout.id, create, slot))
    scale = slot.scale if slot is not None else (create.scale or RewardScale())
    value = _value(create, scale)
    new_id = _insert_revision(tx, rollout.id, create, revision + 1, source, author, value, (key, sha256), ts)
    if slot is None:
        tx.run(
            "INSERT INTO reward_slots (rollout_id, name, source, scale, state, revision, current_id, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rollout.id,
                create.name,
                source.value,
                _scale_json(scale),
                create.state.value,
                revision + 1,
                new_id,
                ts,
            ),
        )
    else:
        tx.run(
            "UPDATE reward_slots SET state = ?, revision = ?, current_id = ?, updated_at = ? "
            "WHERE rollout_id = ? AND name = ?",
            (create.state.value, revision + 1, new_id, ts, rollout.id, create.name),
        )
    return RewardSlot(
        name=create.name,
        source=source,
        scale=scale,
        state=RewardState(create.state),
        revision=revision + 1,
        value=value,
        score=create.score,
        author=author,
        comment=create.comment,
        error=create.error,
        data=create.data,
        updated_at=ts,
    )


def _scored_meanwhile(rollout_id: str, create: RewardCreate, slot: RewardSlot | None) -> str:
    if slot is None or slot.revision == 0:
        return (
            f"reward {create.name!r} of rollout {rollout_id!r} has no score yet, but the request "
            f"replaces revision {create.replaces}; send replaces=0 for a first score"
        )
    return (
        f"reward {create.name!r} of rollout {rollout_id!r} was scored meanwhile (revision "
        f"{slot.revision} by {slot.author or 'an unnamed author'}); reload and score again"
    )


def _value(create: RewardCreate, scale: RewardScale) -> float | None:
    """The score on 0-1, or None for an error; a score off the scale is :class:`InvalidInput`."""
    if create.score is None:
        return None
    try:
        scale.check(create.score)
    except ValueError as exc:
        raise InvalidInput(f"reward {create.name!r}: {exc}") from None
    return scale.normalise(create.score)


def _insert_revision(
    tx: Tx,
    rollout_id: str,
    create: RewardCreate,
    revision: int,
    source: RewardSource,
    author: str | None,
    value: float | None,
    key: tuple[str | None, str | None],
    ts: float,
) -> int:
    """Insert the revision; ``key``: the request's idempotency key and its request's hash."""
    row = tx.one(
        "INSERT INTO reward_scores (rollout_id, name, revision, source, author, state, score, value, "
        "error, comment, data, created_at, request_key, request_sha256) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "RETURNING id",
        (
            rollout_id,
            create.name,
            revision,
            source.value,
            author,
            create.state.value,
            create.score,
            value,
            create.error,
            create.comment,
            to_json(create.data),
            ts,
            *key,
        ),
    )
    assert row is not None
    return int(row[0])
