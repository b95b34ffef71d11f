"""Named rewards in the store, on every backend: pending slots from enqueue, revisions and their
history, the write rules (finished rollouts only, one source per slot, ``replaces``, the scale),
idempotent repeats, two first scores at once, and the pending queue."""

from __future__ import annotations

from typing import Any

import pytest

from agentbolt.errors import Conflict, Forbidden, IdempotencyKeyReused, InvalidInput, NotFound
from agentbolt.schemas import (
    AttemptFinish,
    AttemptStatus,
    AwaitedReward,
    RewardCreate,
    RewardScale,
    RewardSource,
    RewardState,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.store import SqlStore
from tests.store.test_contract import run_threads

STARS = RewardScale(low=1, high=5, step=1)
HUMAN = AwaitedReward(name="human", source=RewardSource.REVIEWER, scale=STARS)
JUDGE = AwaitedReward(name="judge", source=RewardSource.EVALUATOR)
REVIEWER, EVALUATOR = RewardSource.REVIEWER, RewardSource.EVALUATOR


def enqueue(store: SqlStore, n: int = 1, **kwargs: Any) -> list[Rollout]:
    items = [
        RolloutCreate(task=Task(data={"i": i}), await_rewards=[HUMAN, JUDGE], **kwargs) for i in range(n)
    ]
    return store.enqueue(items)


def finish(store: SqlStore, status: AttemptStatus = AttemptStatus.SUCCEEDED) -> Rollout:
    claim = store.dequeue("w1")
    assert claim is not None
    error = None if status == AttemptStatus.SUCCEEDED else "boom"
    return store.finish_attempt(claim.attempt.id, AttemptFinish(status=status, reward=0.5, error=error))


def finished(store: SqlStore, n: int = 1) -> list[Rollout]:
    enqueue(store, n)
    return [finish(store) for _ in range(n)]


def star(score: float, replaces: int | None = None, **kwargs: Any) -> RewardCreate:
    return RewardCreate(name="human", score=score, replaces=replaces, **kwargs)


def test_enqueue_creates_pending_slots_once(store: SqlStore) -> None:
    item = RolloutCreate(id="ro-fixed", task=Task(data={"q": 1}), await_rewards=[HUMAN, JUDGE])
    (rollout,) = store.enqueue([item])
    assert rollout.pending_rewards == ["human", "judge"]
    assert rollout.rewards["human"].scale == STARS
    assert rollout.rewards["human"].source == REVIEWER and rollout.rewards["human"].revision == 0
    assert rollout.rewards["judge"].value is None  # pending is no value, never 0
    finish(store)
    store.add_reward("ro-fixed", star(4), source=REVIEWER, author="alice")
    # a repeated enqueue (same id) returns the rollout as it stands and resets nothing
    (again,) = store.enqueue([item])
    assert again.rewards["human"].state == RewardState.SCORED and again.rewards["human"].revision == 1
    assert again.pending_rewards == ["judge"]
    # a keyed enqueue repeated creates no second set of slots either
    keyed = [RolloutCreate(task=Task(data={"q": 2}), await_rewards=[JUDGE])]
    first = store.enqueue(keyed, key="k1")
    assert store.enqueue(keyed, key="k1")[0].rewards == first[0].rewards


def test_scores_are_revisions_with_history(store: SqlStore) -> None:
    (rollout,) = finished(store)
    slot = store.add_reward(rollout.id, star(4, comment="good"), source=REVIEWER, author="alice")
    assert (slot.state, slot.revision, slot.score, slot.value) == (RewardState.SCORED, 1, 4, 0.75)
    assert slot.author == "alice" and slot.comment == "good"
    slot = store.add_reward(rollout.id, star(2, replaces=1), source=REVIEWER, author="bob")
    assert (slot.revision, slot.score, slot.value, slot.author) == (2, 2, 0.25, "bob")
    history = store.reward_history(rollout.id, "human")
    assert [(h.revision, h.score, h.author) for h in history] == [(1, 4, "alice"), (2, 2, "bob")]
    assert history[0].comment == "good" and history[0].value == 0.75
    assert store.reward_history(rollout.id, "judge") == []
    got = store.get_rollout(rollout.id)
    assert got.rewards["human"].revision == 2 and got.rewards["human"].author == "bob"
    assert got.reward == 0.5  # the agent's own reward is untouched
    assert got.pending_rewards == ["judge"]


def test_error_state_has_no_value(store: SqlStore) -> None:
    (rollout,) = finished(store)
    create = RewardCreate(name="judge", state=RewardState.ERROR, error="malformed", data={"calls": [1]})
    slot = store.add_reward(rollout.id, create, source=EVALUATOR, author="judge")
    assert (slot.state, slot.score, slot.value, slot.error) == (RewardState.ERROR, None, None, "malformed")
    got = store.get_rollout(rollout.id).rewards["judge"]
    assert got.state == RewardState.ERROR and got.data == {"calls": [1]} and got.value is None
    # an error can be scored over (an evaluator's retry)
    slot = store.add_reward(
        rollout.id, RewardCreate(name="judge", score=0.9, replaces=1), source=EVALUATOR, author="j"
    )
    assert slot.state == RewardState.SCORED and slot.value == pytest.approx(0.9)


def test_replaces_an_old_revision_is_a_conflict_naming_who(store: SqlStore) -> None:
    (rollout,) = finished(store)
    store.add_reward(rollout.id, star(3), source=REVIEWER, author="alice")
    store.add_reward(rollout.id, star(4, replaces=1), source=REVIEWER, author="alice")
    with pytest.raises(Conflict, match=r"scored meanwhile \(revision 2 by alice\); reload and score again"):
        store.add_reward(rollout.id, star(5, replaces=1), source=REVIEWER, author="bob")
    with pytest.raises(Conflict, match="scored meanwhile"):
        store.add_reward(rollout.id, star(5), source=REVIEWER, author="bob")  # None counts as 0
    with pytest.raises(Conflict, match="has no score yet"):
        store.add_reward(
            rollout.id, RewardCreate(name="judge", score=1, replaces=3), source=EVALUATOR, author="j"
        )
    assert [h.score for h in store.reward_history(rollout.id)] == [3, 4]


def test_scale_unknown_rollout_and_source(store: SqlStore) -> None:
    (rollout,) = finished(store)
    with pytest.raises(InvalidInput, match="outside the scale 1 to 5"):
        store.add_reward(rollout.id, star(7), source=REVIEWER, author="alice")
    with pytest.raises(InvalidInput, match="not on the scale's steps"):
        store.add_reward(rollout.id, star(2.5), source=REVIEWER, author="alice")
    with pytest.raises(NotFound, match="ro-nope"):
        store.add_reward("ro-nope", star(3), source=REVIEWER, author="alice")
    with pytest.raises(NotFound):
        store.reward_history("ro-nope")
    with pytest.raises(Forbidden, match="reward 'human' is given by reviewers"):
        store.add_reward(rollout.id, star(3), source=EVALUATOR, author="judge")
    assert store.reward_history(rollout.id) == []
    assert store.get_rollout(rollout.id).pending_rewards == ["human", "judge"]


def test_a_reward_not_awaited_creates_its_slot(store: SqlStore) -> None:
    (rollout,) = store.enqueue([RolloutCreate(task=Task(data={}))])
    assert rollout.rewards == {}
    finish(store)
    ten = RewardScale(low=0, high=10)
    slot = store.add_reward(
        rollout.id, RewardCreate(name="extra", score=5, scale=ten), source=EVALUATOR, author="fn"
    )
    assert (slot.source, slot.scale, slot.value) == (EVALUATOR, ten, 0.5)
    # the slot keeps its scale and source: a later scale in the request is ignored
    slot = store.add_reward(
        rollout.id,
        RewardCreate(name="extra", score=10, replaces=1, scale=STARS),
        source=EVALUATOR,
        author="fn",
    )
    assert slot.scale == ten and slot.value == 1.0
    with pytest.raises(InvalidInput, match="outside the scale 0 to 1"):
        store.add_reward(rollout.id, RewardCreate(name="other", score=2), source=EVALUATOR, author="fn")


def test_only_finished_rollouts_are_scored(store: SqlStore) -> None:
    queued, running, cancelled = enqueue(store, 3)
    with pytest.raises(Conflict, match=f"rollout '{queued.id}' is queued: rewards are given to finished"):
        store.add_reward(queued.id, star(3), source=REVIEWER, author="a")
    store.dequeue("w1")
    with pytest.raises(Conflict, match="is running: rewards are given to finished rollouts"):
        store.add_reward(queued.id, star(3), source=REVIEWER, author="a")
    store.cancel(cancelled.id)
    with pytest.raises(Conflict, match="was cancelled"):
        store.add_reward(cancelled.id, star(3), source=REVIEWER, author="a")
    assert store.reward_history(queued.id) == [] and store.reward_history(cancelled.id) == []


def test_idempotent_repeat_stores_once(store: SqlStore) -> None:
    (rollout,) = finished(store)
    first = store.add_reward(rollout.id, star(4), source=REVIEWER, author="alice", key="k1")
    again = store.add_reward(rollout.id, star(4), source=REVIEWER, author="alice", key="k1")
    assert again == first
    # a later score does not change what a repeat of the first answers
    store.add_reward(rollout.id, star(2, replaces=1), source=REVIEWER, author="bob", key="k2")
    assert store.add_reward(rollout.id, star(4), source=REVIEWER, author="alice", key="k1") == first
    assert [h.score for h in store.reward_history(rollout.id)] == [4, 2]
    with pytest.raises(IdempotencyKeyReused, match="Idempotency-Key 'k1' was used for reward 'human'"):
        store.add_reward(
            rollout.id, RewardCreate(name="judge", score=1), source=EVALUATOR, author="j", key="k1"
        )
    # the same reward, another score under the key: refused, never the first answer
    with pytest.raises(IdempotencyKeyReused, match="first sent with another score"):
        store.add_reward(rollout.id, star(5), source=REVIEWER, author="alice", key="k1")


def test_two_scores_at_once_one_wins(store_factory) -> None:
    """Two replicas score the same revision at once (a first score, then rescores): exactly
    one wins each round, the other gets the 409, and no revision is lost or doubled."""
    stores = [store_factory.open(), store_factory.open()]
    (rollout,) = finished(stores[0])
    for seen in range(3):

        def score(i: int, seen: int = seen) -> Any:
            try:
                return stores[i].add_reward(
                    rollout.id, star(i + 2, replaces=seen), source=REVIEWER, author=f"r{i}"
                )
            except Conflict as exc:
                return exc

        results = run_threads(2, score)
        losers = [r for r in results if isinstance(r, Conflict)]
        assert len(losers) == 1, results
        assert "scored meanwhile" in str(losers[0])
        history = stores[0].reward_history(rollout.id)
        assert [h.revision for h in history] == list(range(1, seen + 2))
    assert stores[1].get_rollout(rollout.id).rewards["human"].revision == 3


def test_a_double_click_stores_once(store_factory) -> None:
    """The same request (one key) sent twice at once, to two replicas: one revision, both
    answers the same; the key reused at once for another rollout is refused, not a crash."""
    stores = [store_factory.open(), store_factory.open()]
    first, other = finished(stores[0], 2)
    results = run_threads(
        2, lambda i: stores[i].add_reward(first.id, star(4), source=REVIEWER, author="a", key="dbl")
    )
    assert results[0] == results[1] and len(stores[0].reward_history(first.id)) == 1

    def reuse(i: int) -> Any:
        target = (other, first)[i]  # each with the revision it holds
        try:
            return stores[i].add_reward(target.id, star(2, replaces=i), source=REVIEWER, author="a", key="k2")
        except IdempotencyKeyReused as exc:
            return exc

    results = run_threads(2, reuse)
    assert sum(isinstance(r, IdempotencyKeyReused) for r in results) == 1, results
    assert len(stores[0].reward_history(first.id)) + len(stores[0].reward_history(other.id)) == 2


def test_rewards_attached_on_get_list_and_by_id(store: SqlStore) -> None:
    rollouts = finished(store, 3)
    store.add_reward(rollouts[1].id, star(5), source=REVIEWER, author="alice")
    listed = {r.id: r for r in store.list_rollouts().items}
    assert listed[rollouts[1].id].rewards["human"].value == 1.0
    assert listed[rollouts[0].id].pending_rewards == ["human", "judge"]
    by_id = store.get_rollouts([r.id for r in rollouts])  # what the server's wait reads
    assert [r.pending_rewards for r in by_id] == [["human", "judge"], ["judge"], ["human", "judge"]]
    assert store.get_rollout(rollouts[1].id).rewards == listed[rollouts[1].id].rewards


def test_pending_queue(store: SqlStore) -> None:
    ok = finished(store, 3)
    failed = enqueue(store)[0]
    finish(store, AttemptStatus.FAILED)
    plain = store.enqueue([RolloutCreate(task=Task(data={"plain": True}))])[0]
    finish(store)
    queued = enqueue(store)[0]  # not final: not listed
    page = store.pending_rewards(source=REVIEWER)
    assert [r.id for r in page.items] == [r.id for r in ok]
    assert not {failed.id, plain.id, queued.id} & {r.id for r in page.items}
    assert store.get_rollout(failed.id).status == RolloutStatus.FAILED
    assert store.get_rollout(failed.id).pending_rewards == ["human", "judge"]  # kept, not listed
    store.add_reward(ok[0].id, star(3), source=REVIEWER, author="alice")
    assert [r.id for r in store.pending_rewards(name="human").items] == [ok[1].id, ok[2].id]
    assert [r.id for r in store.pending_rewards(name="judge").items] == [r.id for r in ok]
    assert store.pending_rewards(name="judge", source=REVIEWER).items == []
    first = store.pending_rewards(name="human", limit=1)
    assert [r.id for r in first.items] == [ok[1].id] and first.next_cursor
    rest = store.pending_rewards(name="human", limit=1, cursor=first.next_cursor)
    assert [r.id for r in rest.items] == [ok[2].id] and rest.next_cursor is None
    assert rest.items[0].rewards["human"].state == RewardState.PENDING
