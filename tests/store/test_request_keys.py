"""Idempotency keys in the store (every backend): a repeat gets the first answer, the key sent
with another request is IdempotencyKeyReused and stores nothing; the agent's quota counts in
the store's transaction."""

from __future__ import annotations

import pytest

from agentbolt.errors import AttemptEnded, IdempotencyKeyReused, LeaseLost, QuotaExceeded
from agentbolt.schemas import (
    LLM,
    AttemptFinish,
    AttemptStatus,
    EventCreate,
    ResourcesCreate,
    RolloutCreate,
    Task,
)
from agentbolt.store import SqlStore
from agentbolt.store.quotas import EventQuota


def _claim(store: SqlStore, worker: str = "w1"):
    store.enqueue([RolloutCreate(task=Task(data={"i": 0}))])
    claim = store.dequeue(worker)
    assert claim is not None
    return claim


def _batch(*sequences: int) -> list[EventCreate]:
    return [EventCreate(sequence=s, type="message", timestamp=1.0, data={"s": s}) for s in sequences]


@pytest.mark.parametrize("size", [3, 700])  # one statement; several, in a transaction
def test_a_keyed_batch_answers_its_repeats_with_the_first_answer(store: SqlStore, size: int) -> None:
    c = _claim(store)
    batch = _batch(*range(size))
    assert store.add_events(c.attempt.id, _batch(0), "w1") == 1  # stored before, without a key
    assert store.add_events(c.attempt.id, batch, "w1", key="b1") == size - 1
    assert store.add_events(c.attempt.id, batch, "w1", key="b1") == size - 1  # the first answer
    with pytest.raises(IdempotencyKeyReused, match="'b1' was first sent with another batch"):
        store.add_events(c.attempt.id, _batch(size, size + 1), "w1", key="b1")
    assert store.add_events(c.attempt.id, batch, "w1", key="b2") == 0  # another request: its own answer
    assert len(store.list_events(c.rollout.id, limit=1000).items) == min(size, 1000)
    with pytest.raises(LeaseLost):
        store.add_events(c.attempt.id, _batch(size + 5), "w-other", key="b3")
    store.finish_attempt(c.attempt.id, AttemptFinish(status=AttemptStatus.SUCCEEDED), "w1")
    assert store.add_events(c.attempt.id, batch, "w1", key="b1") == size - 1  # after the end too
    with pytest.raises(AttemptEnded):
        store.add_events(c.attempt.id, _batch(size + 9), "w1", key="b4")
    assert store.list_events(c.rollout.id, limit=1000).items[-1].sequence == min(size, 1000) - 1


def test_an_empty_keyed_batch_is_an_answer_too(store: SqlStore) -> None:
    c = _claim(store)
    assert store.add_events(c.attempt.id, [], "w1", key="none") == 0
    assert store.add_events(c.attempt.id, [], "w1", key="none") == 0
    with pytest.raises(IdempotencyKeyReused):
        store.add_events(c.attempt.id, _batch(0), "w1", key="none")
    with pytest.raises(LeaseLost):  # an empty batch still says why the attempt takes nothing
        store.add_events(c.attempt.id, [], "w-other", key="other")


def test_a_key_is_per_attempt(store: SqlStore) -> None:
    first, second = _claim(store), _claim(store)
    assert store.add_events(first.attempt.id, _batch(0), "w1", key="same") == 1
    assert store.add_events(second.attempt.id, _batch(0, 1), "w1", key="same") == 2


def test_every_keyed_write_refuses_its_key_with_another_request(store: SqlStore) -> None:
    store.enqueue([RolloutCreate(task=Task(id="a", data={}))], key="e1")
    with pytest.raises(IdempotencyKeyReused, match="another enqueue"):
        store.enqueue([RolloutCreate(task=Task(id="b", data={}))], key="e1")
    assert [r.task.id for r in store.enqueue([RolloutCreate(task=Task(id="a", data={}))], key="e1")] == ["a"]
    assert store.dequeue("w1", 30, key="d1") is not None
    with pytest.raises(IdempotencyKeyReused, match="another dequeue request"):
        store.dequeue("w1", 60, key="d1")
    c = store.dequeue("w1", 30, key="d1")
    assert c is not None
    done = AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=1.0)
    store.finish_attempt(c.attempt.id, done, "w1", key="f1")
    with pytest.raises(IdempotencyKeyReused, match="another outcome"):
        store.finish_attempt(c.attempt.id, AttemptFinish(status=AttemptStatus.FAILED), "w1", key="f1")
    assert store.finish_attempt(c.attempt.id, done, "w1", key="f1").reward == 1.0
    published = ResourcesCreate(resources={"llm": LLM(base_url="http://a/v1", model="m")})
    version = store.publish_resources(published, key="p1").version
    with pytest.raises(IdempotencyKeyReused, match="another resources"):
        store.publish_resources(
            ResourcesCreate(resources={"llm": LLM(base_url="http://b/v1", model="m")}), "p1"
        )
    assert store.publish_resources(published, key="p1").version == version
    assert store.latest_resources().version == version  # nothing new was stored


def test_an_agents_quota_counts_in_the_store_and_refuses_whole_posts(store: SqlStore) -> None:
    c = _claim(store)
    quota = EventQuota(events=3, bytes=0)
    post = [EventCreate(type="message", data={"n": i}) for i in range(2)]
    assert store.add_agent_events(c.attempt.id, post, None, quota=quota) == 2
    with pytest.raises(QuotaExceeded, match="at most 3 events") as refused:
        store.add_agent_events(c.attempt.id, post, None, quota=quota)
    assert refused.value.status_code == 429
    assert store.add_agent_events(c.attempt.id, post[:1], "k", quota=quota) == 1  # fits exactly
    assert store.add_agent_events(c.attempt.id, post[:1], "k", quota=quota) == 1  # a repeat: not counted
    assert len(store.list_events(c.rollout.id).items) == 3
    big = [EventCreate(type="message", data={"text": "x" * 100})]
    with pytest.raises(QuotaExceeded, match="at most 50 bytes") as too_big:
        store.add_agent_events(c.attempt.id, big, None, quota=EventQuota(events=0, bytes=50))
    assert too_big.value.status_code == 413
