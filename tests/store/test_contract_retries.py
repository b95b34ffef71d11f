"""The store contract of issue 18 on every backend: repeated writes, failure kinds, cancellation,
immutable tasks and trial resources.

A client retries a write whose answer it did not get with the same idempotency key; the store
answers the repeat with the first result and creates nothing new. Fixtures as in
``test_contract.py`` (``store_factory.open()`` is another replica on the same data).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
from test_contract import FAILED, SUCCEEDED, claim, ev, make, publish, run_threads

from agentbolt.errors import AttemptEnded, Conflict, InvalidTransition, LeaseLost, NotFound
from agentbolt.schemas import (
    AttemptFinish,
    AttemptStatus,
    EventCreate,
    PromptTemplate,
    ResourcesCreate,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.store import SqlStore
from agentbolt.store.sql import keyed_rollout_id


def _count(store: SqlStore, table: str) -> int:
    with store.db.autocommit() as tx:
        row = tx.one(f"SELECT COUNT(*) FROM {table}")
    assert row is not None
    return int(row[0])


# ---------------------------------------------------------------------------- enqueue


def test_enqueue_with_a_key_derives_the_ids_so_a_repeat_returns_the_same_rollouts(store: SqlStore) -> None:
    items = make(3) + [RolloutCreate(id="ro-mine", task=Task(id="t-mine"))]
    first = store.enqueue(items, key="k1")
    assert [r.id for r in first[:3]] == [keyed_rollout_id("k1", i) for i in range(3)]
    assert keyed_rollout_id("k1", 0) == "ro-" + hashlib.sha256(b"k1:0").hexdigest()[:24]
    assert first[3].id == "ro-mine"
    again = store.enqueue(items, key="k1")
    assert again == first
    assert _count(store, "rollouts") == 4 and _count(store, "tasks") == 4
    other = store.enqueue(make(3), key="k2")  # another logical call: new rollouts
    assert not {r.id for r in other} & {r.id for r in first}
    assert _count(store, "rollouts") == 7


def test_a_repeat_after_a_claim_returns_the_rollouts_as_they_stand(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1), key="k")
    got = claim(store)
    [again] = store.enqueue(make(1), key="k")
    assert again.id == queued.id and again.status == RolloutStatus.RUNNING
    assert store.dequeue("w2") is None  # nothing new was queued
    assert got.rollout.id == queued.id


# ---------------------------------------------------------------------------- tasks


def test_a_task_id_enqueued_again_with_other_data_is_a_conflict(store: SqlStore) -> None:
    store.enqueue([RolloutCreate(task=Task(id="t1", data={"q": 1, "a": [1, 2]}, metadata={"m": 1}))])
    # the same task again (keys in another order, 2 as 2.0) is fine: a GRPO group shares one
    same = Task(id="t1", data={"a": [1, 2.0], "q": 1}, metadata={"m": 1})
    assert len(store.enqueue([RolloutCreate(task=same), RolloutCreate(task=same)])) == 2
    for other in (
        Task(id="t1", data={"q": 2, "a": [1, 2]}, metadata={"m": 1}),
        Task(id="t1", data=same.data),
    ):
        with pytest.raises(Conflict, match="'t1'") as info:
            store.enqueue([RolloutCreate(task=Task(id="t-new")), RolloutCreate(task=other)])
        assert info.value.status_code == 409
    assert _count(store, "rollouts") == 3  # a refused enqueue stores none of its items
    assert _count(store, "tasks") == 1
    [rollout] = store.list_rollouts(limit=1).items
    assert rollout.task.data == {"q": 1, "a": [1, 2]}  # the older rollout's task is as it ran


def test_an_existing_rollout_id_with_other_task_data_is_returned_unchanged(store: SqlStore) -> None:
    [first] = store.enqueue([RolloutCreate(id="ro-x", task=Task(id="t", data={"v": 1}))])
    [again] = store.enqueue([RolloutCreate(id="ro-x", task=Task(id="t", data={"v": 2}))])
    assert again == first


# ---------------------------------------------------------------------------- dequeue


def test_a_repeated_dequeue_returns_the_same_claim_and_claims_nothing_else(store: SqlStore) -> None:
    v = publish(store, "v1")
    store.enqueue(make(3))
    first = claim(store, "w1", key="d1", lease_seconds=12)
    assert first.lease_seconds == 12 and first.resources is not None and first.resources.version == v
    again = claim(store, "w1", key="d1", lease_seconds=12)  # the first answer was lost
    assert again == first
    assert store.stats()["rollouts"]["running"] == 1
    assert store.list_workers()[0].claims == 1
    assert claim(store, "w1", key="d2").rollout.id != first.rollout.id  # a new call, a new claim
    # a key is the worker's own: another worker's same key is another call
    assert claim(store, "w2", key="d1").rollout.id not in {first.rollout.id}
    assert store.stats()["rollouts"] == {
        "queued": 0,
        "running": 3,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }


def test_a_repeated_dequeue_after_the_attempt_moved_on_returns_it_as_it_stands(store: SqlStore) -> None:
    store.enqueue(make(2))
    first = claim(store, "w1", key="d1")
    store.finish_attempt(first.attempt.id, SUCCEEDED)
    again = claim(store, "w1", key="d1")
    assert again.attempt.id == first.attempt.id and again.attempt.status == AttemptStatus.SUCCEEDED
    assert again.rollout.status == RolloutStatus.SUCCEEDED
    assert store.stats()["rollouts"]["queued"] == 1


def test_an_empty_dequeue_with_a_key_claims_once_work_arrives(store: SqlStore) -> None:
    assert store.dequeue("w1", key="poll") is None  # a long poll asks again with its key
    [queued] = store.enqueue(make(1))
    assert claim(store, "w1", key="poll").rollout.id == queued.id
    assert claim(store, "w1", key="poll").rollout.id == queued.id


def test_the_claim_carries_the_lease_the_server_granted(store_factory) -> None:
    store = store_factory.open(lease_seconds=7.5)
    store.enqueue(make(2))
    assert claim(store).lease_seconds == 7.5  # the store's default
    got = claim(store, lease_seconds=3)
    assert got.lease_seconds == 3
    assert got.attempt.lease_expires_at == pytest.approx(got.attempt.started_at + 3)


def test_concurrent_repeats_of_one_dequeue_claim_once(store_factory) -> None:
    store_factory.open().enqueue(make(5))
    stores = [store_factory.open(pool_size=1) for _ in range(8)]  # the retries reach 8 replicas
    claims = run_threads(8, lambda i: stores[i].dequeue("w1", key="same"))
    assert all(c is not None for c in claims)
    assert len({c.attempt.id for c in claims}) == 1 and len({c.rollout.id for c in claims}) == 1
    check = stores[0]
    assert check.stats()["rollouts"]["running"] == 1 and check.stats()["rollouts"]["queued"] == 4
    assert [a.id for a in check.list_attempts(claims[0].rollout.id)] == [claims[0].attempt.id]


# ---------------------------------------------------------------------------- finish


def test_a_repeated_finish_returns_the_rollout_instead_of_a_conflict(store: SqlStore) -> None:
    store.enqueue(make(2))
    attempt = claim(store, "w1").attempt
    done = store.finish_attempt(attempt.id, SUCCEEDED, "w1", key="f1")
    assert store.finish_attempt(attempt.id, SUCCEEDED, "w1", key="f1") == done
    with pytest.raises(AttemptEnded, match="succeeded, not running"):  # another call
        store.finish_attempt(attempt.id, SUCCEEDED, "w1", key="f2")
    with pytest.raises(AttemptEnded):
        store.finish_attempt(attempt.id, SUCCEEDED, "w1")
    failing = claim(store, "w1").attempt
    failed = store.finish_attempt(failing.id, FAILED, "w1", key="f3")
    assert failed.status == RolloutStatus.FAILED
    assert store.finish_attempt(failing.id, FAILED, "w1", key="f3") == failed
    assert [a.status for a in store.list_attempts(failed.id)] == [AttemptStatus.FAILED]


# ---------------------------------------------------------------------------- failure kinds


@pytest.mark.parametrize(
    ("ending", "status", "used"),
    [
        ("runner failed", RolloutStatus.FAILED, 1),
        ("lease expired", RolloutStatus.QUEUED, 1),
        ("released", RolloutStatus.QUEUED, 0),
        ("timed out", RolloutStatus.FAILED, 1),
    ],
)
def test_only_a_lost_runner_or_a_release_requeues(
    store: SqlStore, ending: str, status: RolloutStatus, used: int
) -> None:
    [queued] = store.enqueue(make(1, max_attempts=3, timeout_seconds=0.05 if ending == "timed out" else None))
    attempt = claim(store, lease_seconds=0.05 if ending == "lease expired" else 60).attempt
    if ending == "runner failed":
        store.finish_attempt(attempt.id, AttemptFinish(status=AttemptStatus.FAILED, error="agent raised"))
    elif ending == "released":
        store.finish_attempt(attempt.id, AttemptFinish(status=AttemptStatus.RELEASED))
    else:
        time.sleep(0.1)
        assert store.expire() == 1
    rollout = store.get_rollout(queued.id)
    assert (rollout.status, rollout.attempts) == (status, used)
    assert (store.dequeue("w2") is not None) == (status == RolloutStatus.QUEUED)


def test_a_lease_expiry_requeues_until_the_attempts_are_used_up(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=3))
    for n in range(3):
        claim(store, lease_seconds=0.02)
        time.sleep(0.05)
        assert store.expire() == 1
        expected = RolloutStatus.QUEUED if n < 2 else RolloutStatus.FAILED
        assert store.get_rollout(queued.id).status == expected
    assert [a.status for a in store.list_attempts(queued.id)] == [AttemptStatus.LEASE_EXPIRED] * 3


# ---------------------------------------------------------------------------- cancel


def test_cancel_ends_the_running_attempt_and_its_holder_learns_it(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    attempt = claim(store, "w1").attempt
    cancelled = store.cancel(queued.id)
    assert cancelled.status == RolloutStatus.CANCELLED
    ended = store.get_attempt(attempt.id)
    assert ended.status == AttemptStatus.CANCELLED and ended.ended_at is not None
    message = f"attempt '{attempt.id}' is cancelled, not running"
    calls: list[Any] = [
        lambda: store.heartbeat(attempt.id, "w1"),
        lambda: store.add_events(attempt.id, [ev(0)], "w1"),
        lambda: store.finish_attempt(attempt.id, SUCCEEDED, "w1"),
    ]
    for call in calls:
        with pytest.raises(AttemptEnded) as info:
            call()
        assert str(info.value) == message and isinstance(info.value, LeaseLost)
    assert store.cancel(queued.id) == cancelled  # idempotent
    assert store.list_events(queued.id).items == []
    assert store.expire(time.time() + 3600) == 0  # nothing left running to expire
    assert store.list_workers()[0].running == 0  # the runner's slot is free


def test_cancels_racing_finishes_leave_each_rollout_whole(store_factory) -> None:
    """A cancel and a finish of the same running rollout at once (replicas, PostgreSQL row
    locks): one of them wins the attempt and the rollout together, the other is refused; no
    deadlock, no cancelled rollout whose attempt succeeded."""
    first = store_factory.open()
    rollouts = first.enqueue(make(10))
    attempts = [claim(first, "w1").attempt for _ in rollouts]
    stores = [store_factory.open(pool_size=1) for _ in range(20)]

    def race(i: int) -> str:
        n, store = i // 2, stores[i]
        try:
            if i % 2:
                store.cancel(rollouts[n].id)
            else:
                store.finish_attempt(attempts[n].id, SUCCEEDED, "w1")
        except (AttemptEnded, InvalidTransition) as exc:
            return type(exc).__name__
        return "won"

    outcomes = run_threads(20, race)
    for n, rollout in enumerate(rollouts):
        status = first.get_rollout(rollout.id).status
        attempt = first.get_attempt(attempts[n].id).status
        finish, cancel = outcomes[2 * n], outcomes[2 * n + 1]
        assert (status, attempt, finish, cancel) in {
            (RolloutStatus.SUCCEEDED, AttemptStatus.SUCCEEDED, "won", "InvalidTransition"),
            (RolloutStatus.CANCELLED, AttemptStatus.CANCELLED, "AttemptEnded", "won"),
        }


def test_cancel_of_a_finished_rollout_stays_a_conflict(store: SqlStore) -> None:
    done, failed = store.enqueue(make(2))
    store.finish_attempt(claim(store).attempt.id, SUCCEEDED)
    store.finish_attempt(claim(store).attempt.id, FAILED)
    for rollout in (done, failed):
        with pytest.raises(InvalidTransition):
            store.cancel(rollout.id)
    assert [a.status for a in store.list_attempts(done.id)] == [AttemptStatus.SUCCEEDED]


def test_cancel_of_a_queued_rollout_that_was_requeued_leaves_old_attempts_alone(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=2))
    claim(store, lease_seconds=0.02)
    time.sleep(0.05)
    store.expire()
    assert store.cancel(queued.id).status == RolloutStatus.CANCELLED
    assert [a.status for a in store.list_attempts(queued.id)] == [AttemptStatus.LEASE_EXPIRED]


def test_an_expired_lease_is_named_in_the_refusal(store: SqlStore) -> None:
    store.enqueue(make(1))
    attempt = claim(store, lease_seconds=0.02).attempt
    time.sleep(0.05)
    with pytest.raises(AttemptEnded, match="lease_expired, not running"):
        store.heartbeat(attempt.id)


# ---------------------------------------------------------------------------- resources


def _create(prompt: str, trial: bool = False) -> ResourcesCreate:
    return ResourcesCreate(resources={"prompt": PromptTemplate(template=prompt)}, trial=trial)


def test_a_repeated_publish_returns_the_same_version(store: SqlStore) -> None:
    first = store.publish_resources(_create("a"), key="p1")
    assert store.publish_resources(_create("a"), key="p1") == first
    assert store.publish_resources(_create("b"), key="p2").version == first.version + 1
    assert store.publish_resources(_create("c")).version == first.version + 2
    assert _count(store, "resources") == 3


def test_concurrent_repeats_of_one_publish_store_one_version(store_factory) -> None:
    stores = [store_factory.open(pool_size=1) for _ in range(6)]
    versions = run_threads(6, lambda i: stores[i].publish_resources(_create("x"), key="same").version)
    assert versions == [1] * 6
    assert [r.version for r in stores[0].list_resources().items] == [1]


def test_a_trial_version_is_never_the_latest_but_runs_what_is_pinned_to_it(store: SqlStore) -> None:
    assert store.publish_resources(_create("trial first", trial=True)).trial
    assert store.latest_resources() is None  # only a trial so far
    base = store.publish_resources(_create("base"))
    trial = store.publish_resources(_create("candidate", trial=True))
    assert (base.version, trial.version, base.trial, trial.trial) == (2, 3, False, True)
    assert store.latest_resources() == base
    assert store.get_resources(3).trial and not store.get_resources(2).trial
    assert [(r.version, r.trial) for r in store.list_resources().items] == [(3, True), (2, False), (1, True)]
    unpinned, pinned = store.enqueue(make(1)) + store.enqueue(make(1, resources_version=trial.version))
    got = [claim(store), claim(store)]
    assert [(c.rollout.id, c.rollout.resources_version) for c in got] == [(unpinned.id, 2), (pinned.id, 3)]
    prompt = got[1].resources.resources["prompt"] if got[1].resources else None
    assert isinstance(prompt, PromptTemplate) and prompt.template == "candidate"


def test_a_rollout_pinned_to_a_trial_not_published_yet_waits_for_it(store: SqlStore) -> None:
    publish(store, "v1")
    [pinned] = store.enqueue(make(1, resources_version=2))
    assert store.dequeue("w1") is None
    store.publish_resources(_create("trial", trial=True))
    assert claim(store).rollout.id == pinned.id


# ---------------------------------------------------------------------------- server records


def test_spans_recorded_twice_are_stored_once(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    attempt = claim(store).attempt
    spans = [EventCreate(type="span", data={"n": i}) for i in range(3)]
    keys = ["span:t:1", "span:t:2", None]  # a span without ids cannot be recognised
    assert store.record_events(attempt.id, spans, keys) == 3
    assert store.record_events(attempt.id, spans, keys) == 1
    assert store.record_events(attempt.id, spans[:1] * 2, ["span:t:9", "span:t:9"]) == 1
    assert len(store.list_events(queued.id).items) == 5
    store.finish_attempt(attempt.id, SUCCEEDED)  # spans may arrive after the finish
    assert store.record_events(attempt.id, spans[:1], ["span:t:10"]) == 1
    assert store.record_events(attempt.id, spans[:1], ["span:t:10"]) == 0


def _call(n: int) -> EventCreate:
    return EventCreate(type="llm_call", timestamp=1000.0 + n, data={"answer": n})


def _calls(store: SqlStore, rollout_id: str) -> list[tuple[float, dict[str, Any]]]:
    return [(e.timestamp, e.data) for e in store.list_events(rollout_id, types=["llm_call"]).items]


def test_a_retried_model_call_is_one_record_with_the_retry_s_answer(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    assert store.record_call(aid, _call(0), None, "h1", retry=0)
    assert not store.record_call(aid, _call(1), None, "h1", retry=1)  # the client retried
    assert not store.record_call(aid, _call(2), None, "h1", retry=2)
    assert _calls(store, queued.id) == [(1000.0, {"answer": 2, "retries": 2, "tries": [0, 1, 2]})]
    # the same body again, not a retry: another call
    assert store.record_call(aid, _call(3), None, "h1", retry=0)
    assert store.record_call(aid, _call(4), None, "h1", retry=None)
    assert not store.record_call(aid, _call(5), None, "h1", retry=1)  # a retry of the latest
    assert [d for _, d in _calls(store, queued.id)] == [
        {"answer": 2, "retries": 2, "tries": [0, 1, 2]},
        {"answer": 3, "retries": 0, "tries": [0]},
        {"answer": 5, "retries": 1, "tries": [0, 1]},
    ]


def test_a_slow_first_try_recorded_after_its_retry_keeps_the_retry_s_answer(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    assert store.record_call(aid, _call(1), None, "h", retry=1)  # the retry answered first
    assert not store.record_call(aid, _call(0), None, "h", retry=0)  # then the timed-out try
    # the record starts when the logical call did: the first try's start
    assert _calls(store, queued.id) == [(1000.0, {"answer": 1, "retries": 1, "tries": [0, 1]})]


def test_a_model_call_with_a_key_is_one_record_whatever_its_body(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    assert store.record_call(aid, _call(0), "k", "h1", retry=None)
    assert not store.record_call(aid, _call(1), "k", "h2", retry=None)  # no count: arrival order
    assert [d for _, d in _calls(store, queued.id)] == [{"answer": 1, "retries": 1, "tries": [0, 1]}]
    assert store.record_call(aid, _call(2), "k2", "h1", retry=0)
    assert not store.record_call(aid, _call(3), "k2", "h1", retry=1)
    # a count seen already (the call sent again as a new request): the later arrival wins
    assert not store.record_call(aid, _call(4), "k2", "h1", retry=0)
    assert [d for _, d in _calls(store, queued.id)][1] == {"answer": 4, "retries": 2, "tries": [0, 1, 2]}
    # with a key, a slow first try recorded after its retry keeps the retry's answer
    assert store.record_call(aid, _call(6), "k3", "h1", retry=1)
    assert not store.record_call(aid, _call(5), "k3", "h1", retry=0)
    assert _calls(store, queued.id)[2] == (1005.0, {"answer": 6, "retries": 1, "tries": [0, 1]})
    with pytest.raises(NotFound):
        store.record_call("at-missing", _call(0), None, "h", retry=0)


def test_concurrent_tries_of_one_call_leave_one_record(store_factory) -> None:
    store = store_factory.open()
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    stores = [store_factory.open(pool_size=1) for _ in range(3)]
    run_threads(3, lambda i: stores[i].record_call(aid, _call(i), None, "h", retry=i))
    [(_, data)] = _calls(store, queued.id)
    assert data == {"answer": 2, "retries": 2, "tries": [0, 1, 2]}


def test_many_calls_with_one_body_stay_many_and_a_retry_joins_the_latest(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    for n in range(60):  # e.g. sampling one prompt again and again
        assert store.record_call(aid, _call(n), None, "same", retry=0)
    assert not store.record_call(aid, _call(60), None, "same", retry=1)
    calls = [d for _, d in _calls(store, queued.id)]
    assert len(calls) == 60 and calls[-1] == {"answer": 60, "retries": 1, "tries": [0, 1]}
    assert all(d["retries"] == 0 for d in calls[:-1])
