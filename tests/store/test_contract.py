"""The store contract: every backend (SQLite file, SQLite in memory, PostgreSQL) must pass it.

Fixtures (``store``, ``store_factory``) come from ``conftest.py``; ``store_factory.open()``
opens another store object on the same data, the way a second server replica would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agentbolt.errors import AttemptEnded, InvalidTransition, LeaseLost, NotFound
from agentbolt.schemas import (
    LLM,
    AttemptFinish,
    AttemptStatus,
    Claim,
    EventCreate,
    Mode,
    PromptTemplate,
    ResourcesCreate,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.store import SqlStore

SUCCEEDED = AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=1.0)
FAILED = AttemptFinish(status=AttemptStatus.FAILED, error="boom")
RELEASED = AttemptFinish(status=AttemptStatus.RELEASED)


def make(n: int = 1, **kwargs: Any) -> list[RolloutCreate]:
    return [RolloutCreate(task=Task(data={"i": i}), **kwargs) for i in range(n)]


def claim(store: SqlStore, worker: str = "w1", **kwargs: Any) -> Claim:
    got = store.dequeue(worker, **kwargs)
    assert got is not None, "expected a queued rollout"
    return got


def drain(store: SqlStore, worker: str = "w1") -> list[Claim]:
    claims = []
    while (got := store.dequeue(worker)) is not None:
        claims.append(got)
    return claims


def publish(store: SqlStore, prompt: str) -> int:
    create = ResourcesCreate(
        resources={
            "prompt": PromptTemplate(template=prompt),
            "llm": LLM(base_url="http://127.0.0.1:1/v1", model="m", sampling_parameters={"t": 0.5}),
        },
        metadata={"note": prompt},
    )
    return store.publish_resources(create).version


def run_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """Run ``target(i)`` in ``n`` threads released together; re-raise the first error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = target(i)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------------- enqueue


def test_dequeue_is_fifo(store: SqlStore) -> None:
    first = store.enqueue(make(5))
    second = store.enqueue(make(3))
    claimed = [c.rollout.id for c in drain(store)]
    assert claimed == [r.id for r in first + second]


def test_enqueue_many(store: SqlStore) -> None:
    items = [RolloutCreate(task=Task(id=f"t{i}", data={"i": i}), mode=Mode.VAL) for i in range(650)]
    created = store.enqueue(items)  # more than one chunk of the IN (...) lookup
    assert [r.task.id for r in created] == [f"t{i}" for i in range(650)]
    assert all(r.status == RolloutStatus.QUEUED and r.attempts == 0 and r.mode == Mode.VAL for r in created)
    assert created[649].task.data == {"i": 649}
    assert len({r.id for r in created}) == 650
    assert store.stats()["rollouts"]["queued"] == 650


def test_enqueue_with_ids_is_idempotent(store: SqlStore) -> None:
    one = RolloutCreate(id="ro-fixed", task=Task(id="t1", data={"v": 1}), max_attempts=2)
    again = RolloutCreate(id="ro-fixed", task=Task(id="t1", data={"v": 2}), max_attempts=5)
    [first] = store.enqueue([one])
    [second] = store.enqueue([again])
    assert second == first  # the first enqueue wins
    assert second.max_attempts == 2
    mixed = store.enqueue([again, RolloutCreate(id="ro-new", task=Task()), again])
    assert [r.id for r in mixed] == ["ro-fixed", "ro-new", "ro-fixed"]
    assert sorted(r.id for r in store.list_rollouts().items) == ["ro-fixed", "ro-new"]
    # without ids every enqueue is a new rollout
    assert store.enqueue(make(1))[0].id != store.enqueue(make(1))[0].id


def test_concurrent_enqueue_with_the_same_id(store_factory) -> None:
    stores = [store_factory.open() for _ in range(6)]
    item = RolloutCreate(id="ro-retried", task=Task(id="t", data={"v": 1}))
    results = run_threads(6, lambda i: stores[i].enqueue([item])[0].id)
    assert results == ["ro-retried"] * 6
    assert [r.id for r in stores[0].list_rollouts().items] == ["ro-retried"]


# ---------------------------------------------------------------------------- dequeue


def test_dequeue_claims_exactly_one_attempt(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=3))
    got = claim(store, "worker-a", lease_seconds=7)
    assert got.rollout.id == queued.id
    assert got.rollout.status == RolloutStatus.RUNNING
    assert got.rollout.attempts == 1 and got.rollout.started_at is not None
    attempt = got.attempt
    assert (attempt.rollout_id, attempt.number, attempt.worker_id) == (queued.id, 1, "worker-a")
    assert attempt.status == AttemptStatus.RUNNING
    assert attempt.lease_expires_at == pytest.approx(attempt.started_at + 7)
    assert store.list_attempts(queued.id) == [attempt]
    assert store.get_attempt(attempt.id) == attempt
    assert store.dequeue("worker-b") is None  # the only rollout is taken


def test_dequeue_never_claims_a_rollout_twice(store: SqlStore) -> None:
    created = store.enqueue(make(12))
    claims = drain(store, "w1") + drain(store, "w2")
    assert sorted(c.rollout.id for c in claims) == sorted(r.id for r in created)
    assert len({c.attempt.id for c in claims}) == 12


def test_concurrent_dequeue_claims_each_rollout_once(store_factory) -> None:
    created = store_factory.open().enqueue(make(20))
    # one store object (one connection pool) per thread, like 32 server replicas
    stores = [store_factory.open(pool_size=1) for _ in range(32)]
    claims = run_threads(32, lambda i: stores[i].dequeue(f"w{i}"))
    won = [c for c in claims if c is not None]
    assert len(won) == 20
    assert sorted(c.rollout.id for c in won) == sorted(r.id for r in created)
    assert len({c.attempt.id for c in won}) == 20
    check = stores[0]
    for c in won:
        assert [a.id for a in check.list_attempts(c.rollout.id)] == [c.attempt.id]
        assert c.attempt.worker_id == f"w{claims.index(c)}"
    assert check.stats()["rollouts"]["running"] == 20
    assert sum(w.claims for w in check.list_workers()) == 20


# ---------------------------------------------------------------------------- leases


def test_heartbeat_extends_the_lease(store: SqlStore) -> None:
    store.enqueue(make(1))
    attempt = claim(store, "w1", lease_seconds=1).attempt
    time.sleep(0.01)
    beat = store.heartbeat(attempt.id, "w1", lease_seconds=60)
    assert beat.heartbeat_at > attempt.heartbeat_at
    assert beat.lease_expires_at == pytest.approx(beat.heartbeat_at + 60)
    stored = store.get_attempt(attempt.id)
    assert stored.lease_expires_at == pytest.approx(beat.lease_expires_at)
    assert stored.status == AttemptStatus.RUNNING


def test_heartbeat_keeps_the_attempt_from_expiring(store: SqlStore) -> None:
    store.enqueue(make(1))
    attempt = claim(store, lease_seconds=1).attempt
    store.heartbeat(attempt.id, lease_seconds=100)
    assert store.expire(time.time() + 50) == 0  # the first lease alone would have lapsed
    assert store.get_attempt(attempt.id).status == AttemptStatus.RUNNING
    assert store.expire(time.time() + 150) == 1
    assert store.get_attempt(attempt.id).status == AttemptStatus.LEASE_EXPIRED


def test_wrong_worker_loses_the_lease(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    attempt = claim(store, "owner").attempt
    with pytest.raises(LeaseLost):
        store.heartbeat(attempt.id, "intruder")
    with pytest.raises(LeaseLost):
        store.finish_attempt(attempt.id, SUCCEEDED, worker_id="intruder")
    with pytest.raises(LeaseLost):
        store.add_events(attempt.id, [EventCreate(type="message")], worker_id="intruder")
    assert store.get_rollout(queued.id).status == RolloutStatus.RUNNING
    assert store.get_attempt(attempt.id).status == AttemptStatus.RUNNING
    store.heartbeat(attempt.id, "owner")  # the owner still holds it


def test_ended_attempt_loses_the_lease(store: SqlStore) -> None:
    store.enqueue(make(1))
    attempt = claim(store, "w1").attempt
    store.finish_attempt(attempt.id, SUCCEEDED, worker_id="w1")
    with pytest.raises(LeaseLost):
        store.heartbeat(attempt.id, "w1")
    with pytest.raises(LeaseLost):  # finishing twice: the attempt is no longer held
        store.finish_attempt(attempt.id, FAILED, worker_id="w1")
    with pytest.raises(LeaseLost):
        store.add_events(attempt.id, [EventCreate(type="message")])
    assert LeaseLost.status_code == InvalidTransition.status_code == 409
    with pytest.raises(NotFound):
        store.heartbeat("at-missing")


def test_lapsed_lease_requeues_then_fails(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=2))
    first = claim(store, lease_seconds=0.05).attempt
    time.sleep(0.1)
    assert store.expire() == 1
    assert store.expire() == 0  # already ended
    ended = store.get_attempt(first.id)
    assert ended.status == AttemptStatus.LEASE_EXPIRED and ended.ended_at is not None
    assert "lease" in (ended.error or "")
    rollout = store.get_rollout(queued.id)
    assert (rollout.status, rollout.attempts, rollout.ended_at) == (RolloutStatus.QUEUED, 1, None)
    with pytest.raises(LeaseLost):
        store.heartbeat(first.id)
    with pytest.raises(LeaseLost):
        store.finish_attempt(first.id, SUCCEEDED)

    second = claim(store, lease_seconds=0.05).attempt
    assert (second.rollout_id, second.number) == (queued.id, 2)
    time.sleep(0.1)
    assert store.dequeue("w1") is None  # dequeue expires lapsed leases itself first
    rollout = store.get_rollout(queued.id)
    assert (rollout.status, rollout.attempts) == (RolloutStatus.FAILED, 2)
    assert rollout.ended_at is not None and rollout.error
    assert [a.status for a in store.list_attempts(queued.id)] == [AttemptStatus.LEASE_EXPIRED] * 2


def test_timeout_ends_the_attempt_as_timed_out_and_fails_the_rollout_at_once(store: SqlStore) -> None:
    # issue 18: a rollout past its own deadline would time out again; attempts remain, unused
    [queued] = store.enqueue(make(1, timeout_seconds=0.05, max_attempts=2))
    first = claim(store, lease_seconds=60).attempt
    time.sleep(0.1)
    assert store.expire() == 1
    assert store.get_attempt(first.id).status == AttemptStatus.TIMED_OUT
    rollout = store.get_rollout(queued.id)
    assert (rollout.status, rollout.attempts) == (RolloutStatus.FAILED, 1)
    assert "timed out" in (rollout.error or "") and rollout.ended_at is not None
    assert store.dequeue("w1") is None
    assert [a.status for a in store.list_attempts(queued.id)] == [AttemptStatus.TIMED_OUT]


def test_release_does_not_use_up_an_attempt(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=1))
    first = claim(store).attempt
    rollout = store.finish_attempt(first.id, RELEASED)
    assert (rollout.status, rollout.attempts) == (RolloutStatus.QUEUED, 0)
    assert store.get_attempt(first.id).status == AttemptStatus.RELEASED
    second = claim(store).attempt  # still allowed: max_attempts is 1 and none was used
    assert second.number == 2  # attempt numbers stay unique within a rollout
    assert [a.id for a in store.list_attempts(queued.id)] == [first.id, second.id]
    rollout = store.finish_attempt(second.id, FAILED)
    assert (rollout.status, rollout.attempts) == (RolloutStatus.FAILED, 1)


# ---------------------------------------------------------------------------- finishing


def test_finish_succeeded_records_the_reward(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    attempt = claim(store, "w1").attempt
    done = store.finish_attempt(attempt.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=0.75), "w1")
    assert done.status == RolloutStatus.SUCCEEDED
    assert (done.reward, done.error, done.attempts) == (0.75, None, 1)
    assert done.ended_at is not None and done.ended_at >= done.started_at
    assert store.get_rollout(queued.id) == done
    ended = store.get_attempt(attempt.id)
    assert (ended.status, ended.reward) == (AttemptStatus.SUCCEEDED, 0.75)
    assert ended.ended_at is not None
    assert store.dequeue("w1") is None  # a succeeded rollout is not queued again


def test_finish_failed_fails_the_rollout_at_once(store: SqlStore) -> None:
    # issue 18: the agent failed (raised, bad reward, refused report): a retry would score the
    # best of several tries, so the rollout fails although attempts remain
    [queued] = store.enqueue(make(1, max_attempts=3))
    rollout = store.finish_attempt(
        claim(store).attempt.id, AttemptFinish(status=AttemptStatus.FAILED, error="again", reward=0.0)
    )
    assert (rollout.status, rollout.attempts, rollout.error) == (RolloutStatus.FAILED, 1, "again")
    assert rollout.ended_at is not None
    assert store.get_rollout(queued.id).status == RolloutStatus.FAILED
    assert store.dequeue("w1") is None
    assert [a.status for a in store.list_attempts(queued.id)] == [AttemptStatus.FAILED]


def test_lease_expired_then_succeeded_clears_the_error(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1, max_attempts=2))
    claim(store, lease_seconds=0.01)
    time.sleep(0.05)
    assert store.expire() == 1
    assert "lease expired" in (store.get_rollout(queued.id).error or "")
    done = store.finish_attempt(
        claim(store).attempt.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=-1.5)
    )
    assert (done.status, done.reward, done.error) == (RolloutStatus.SUCCEEDED, -1.5, None)
    assert [a.status for a in store.list_attempts(queued.id)] == [
        AttemptStatus.LEASE_EXPIRED,
        AttemptStatus.SUCCEEDED,
    ]


def test_invalid_transitions(store: SqlStore) -> None:
    finished, queued, running = store.enqueue(make(3))
    store.finish_attempt(claim(store).attempt.id, SUCCEEDED)
    with pytest.raises(InvalidTransition) as info:
        store.cancel(finished.id)
    assert (info.value.old, info.value.new) == ("succeeded", "cancelled")
    assert store.get_rollout(finished.id).status == RolloutStatus.SUCCEEDED

    cancelled = store.cancel(queued.id)
    assert cancelled.status == RolloutStatus.CANCELLED and cancelled.ended_at is not None
    assert store.cancel(queued.id) == cancelled  # issue 18: cancelling again is a no-op, not a 409

    got = claim(store)
    assert got.rollout.id == running.id  # the cancelled rollout was skipped
    assert store.cancel(running.id).status == RolloutStatus.CANCELLED
    # issue 18: the cancel ended the attempt; the runner's late finish is refused, naming why
    with pytest.raises(AttemptEnded, match="cancelled"):
        store.finish_attempt(got.attempt.id, SUCCEEDED)
    assert store.get_rollout(running.id).status == RolloutStatus.CANCELLED
    assert store.get_attempt(got.attempt.id).status == AttemptStatus.CANCELLED
    with pytest.raises(NotFound):
        store.cancel("ro-missing")


# ---------------------------------------------------------------------------- events


def ev(seq: int | None, kind: str = "message", ts: float | None = None, **data: Any) -> EventCreate:
    extra = {"timestamp": ts} if ts is not None else {}
    return EventCreate(sequence=seq, type=kind, data=data, **extra)


def test_add_events_is_idempotent_on_sequence(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    attempt = claim(store, "w1").attempt
    assert store.add_events(attempt.id, [ev(0, n=0), ev(1, n=1), ev(2, n=2)], worker_id="w1") == 3
    assert store.add_events(attempt.id, [ev(1, n=99), ev(2), ev(3, n=3)]) == 1  # a retried batch
    assert store.add_events(attempt.id, [ev(4, n=4), ev(4, n=44)]) == 1  # duplicate inside a batch
    assert store.add_events(attempt.id, [ev(None, "llm_call"), ev(None, "llm_call")]) == 2
    assert store.add_events(attempt.id, [ev(None, "llm_call")]) == 1  # server events never dedupe
    assert store.add_events(attempt.id, []) == 0
    events = store.list_events(queued.id).items
    by_seq = {e.sequence: e.data for e in events if e.sequence is not None}
    assert by_seq == {0: {"n": 0}, 1: {"n": 1}, 2: {"n": 2}, 3: {"n": 3}, 4: {"n": 4}}
    assert sum(e.sequence is None for e in events) == 3
    assert {(e.rollout_id, e.attempt_id) for e in events} == {(queued.id, attempt.id)}
    # sequences are per attempt: the next attempt may reuse them
    store.finish_attempt(attempt.id, RELEASED)
    nxt = claim(store).attempt
    assert store.add_events(nxt.id, [ev(0), ev(1)]) == 2
    assert store.stats()["events"] == 10


def test_concurrent_retries_of_one_batch_store_it_once(store_factory) -> None:
    store = store_factory.open()
    store.enqueue(make(1))
    attempt = claim(store).attempt
    stores = [store_factory.open(pool_size=1) for _ in range(6)]
    batch = [ev(i, n=i) for i in range(20)]
    added = run_threads(6, lambda i: stores[i].add_events(attempt.id, batch))
    assert sum(added) >= 20  # racing batches may each count an event the other stored
    events = store.list_events(attempt_id=attempt.id, limit=1000).items
    assert sorted(e.sequence for e in events) == list(range(20))


def test_large_sequence_numbers(store: SqlStore) -> None:
    store.enqueue(make(1))
    attempt = claim(store).attempt
    assert store.add_events(attempt.id, [ev(2**53 - 1), ev(2**31)]) == 2
    assert store.add_events(attempt.id, [ev(2**53 - 1)]) == 0
    assert {e.sequence for e in store.list_events(attempt_id=attempt.id).items} == {2**53 - 1, 2**31}


def test_list_events_order_filters_and_cursor(store: SqlStore) -> None:
    first, second = store.enqueue(make(2))
    a1 = claim(store).attempt
    a2 = claim(store).attempt
    base = 1_700_000_000.0
    # out of order on purpose, with ties on the timestamp (broken by id)
    stamps = [base + 5, base + 1, base + 3, base + 3, base + 3, base + 0.5, base + 9, base + 3]
    store.add_events(
        a1.id, [ev(i, "reward" if i % 3 == 0 else "message", ts, i=i) for i, ts in enumerate(stamps)]
    )
    store.add_events(a2.id, [ev(0, "message", base, other=True)])
    full = store.list_events(first.id, limit=1000)
    assert full.next_cursor is None
    assert len(full.items) == len(stamps)
    keys = [(e.timestamp, e.id) for e in full.items]
    assert keys == sorted(keys)
    assert [e.timestamp for e in full.items] == sorted(stamps)

    pages, cursor = [], None
    while True:
        page = store.list_events(first.id, limit=3, cursor=cursor)
        pages.append(page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert [len(p) for p in pages] == [3, 3, 2]
    assert [e.id for p in pages for e in p] == [e.id for e in full.items]

    rewards = store.list_events(first.id, types=["reward"]).items
    assert [e.data["i"] for e in rewards] == [3, 0, 6] and all(e.type == "reward" for e in rewards)
    assert [e.data for e in store.list_events(attempt_id=a2.id).items] == [{"other": True}]
    assert [e.rollout_id for e in store.list_events(second.id).items] == [second.id]
    assert len(store.list_events(limit=1000).items) == len(stamps) + 1
    with pytest.raises(NotFound):
        store.list_events("ro-missing")
    with pytest.raises(ValueError):
        store.list_events(first.id, cursor="garbage")


def test_list_events_of_many_rollouts(store: SqlStore) -> None:
    rollouts = store.enqueue(make(3))
    attempts = [claim(store).attempt for _ in rollouts]
    for n, a in enumerate(attempts):
        store.add_events(
            a.id, [ev(i, "reward" if i == 0 else "message", 100.0 + 10 * i + n, n=n) for i in range(3)]
        )
    wanted = [rollouts[2].id, rollouts[0].id, "ro-not-stored"]
    both = store.list_events(rollout_ids=wanted, limit=1000).items
    assert sorted({e.rollout_id for e in both}) == sorted(wanted[:2]) and len(both) == 6
    assert [e.timestamp for e in both] == sorted(e.timestamp for e in both)
    assert [e.data["n"] for e in both if e.rollout_id == rollouts[0].id] == [0, 0, 0]
    pages, cursor = [], None
    while True:
        page = store.list_events(rollout_ids=wanted, limit=4, cursor=cursor)
        pages.append([e.id for e in page.items])
        if (cursor := page.next_cursor) is None:
            break
    assert pages[0] + pages[1] == [e.id for e in both] and len(pages) == 2
    rewards = store.list_events(rollout_ids=wanted, types=["reward"]).items
    assert [e.type for e in rewards] == ["reward", "reward"]
    assert store.list_events(rollout_ids=["ro-not-stored"]).items == []
    assert store.list_events(rollout_ids=[]).items == []


# ---------------------------------------------------------------------------- queries


def _ids(rollouts: list[Rollout]) -> list[str]:
    return [r.id for r in rollouts]


def test_list_rollouts_filters(store: SqlStore) -> None:
    publish(store, "v1")
    publish(store, "v2")
    train_g1 = store.enqueue(make(3, mode=Mode.TRAIN, group_id="g1", resources_version=1, max_attempts=1))
    val_g2 = store.enqueue(make(2, mode=Mode.VAL, group_id="g2", resources_version=2))
    test_latest = store.enqueue(make(2, mode=Mode.TEST))
    c1 = claim(store)  # train_g1[0]
    store.finish_attempt(c1.attempt.id, SUCCEEDED)
    c2 = claim(store)  # train_g1[1]
    store.finish_attempt(c2.attempt.id, AttemptFinish(status=AttemptStatus.FAILED))
    store.cancel(train_g1[2].id)
    claim(store)  # val_g2[0] -> running

    everything = _ids(train_g1 + val_g2 + test_latest)
    assert _ids(store.list_rollouts().items) == everything
    by_status = store.list_rollouts(status=[RolloutStatus.QUEUED]).items
    assert _ids(by_status) == _ids(val_g2[1:] + test_latest)
    finals = [RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]
    assert _ids(store.list_rollouts(status=finals).items) == _ids(train_g1)
    assert _ids(store.list_rollouts(status=[RolloutStatus.RUNNING]).items) == [val_g2[0].id]
    assert _ids(store.list_rollouts(mode=Mode.VAL).items) == _ids(val_g2)
    assert _ids(store.list_rollouts(mode=Mode.TEST).items) == _ids(test_latest)
    assert _ids(store.list_rollouts(group_id="g1").items) == _ids(train_g1)
    assert _ids(store.list_rollouts(group_id="nope").items) == []
    assert _ids(store.list_rollouts(resources_version=1).items) == _ids(train_g1)
    assert _ids(store.list_rollouts(resources_version=2).items) == _ids(val_g2)
    combined = store.list_rollouts(mode=Mode.TRAIN, status=[RolloutStatus.SUCCEEDED], group_id="g1").items
    assert _ids(combined) == [train_g1[0].id]
    assert _ids(store.get_rollouts([val_g2[1].id, "ro-missing", train_g1[0].id])) == [
        val_g2[1].id,
        train_g1[0].id,
    ]
    with pytest.raises(NotFound):
        store.get_rollout("ro-missing")


@pytest.mark.parametrize("newest_first", [False, True])
def test_list_rollouts_pagination(store: SqlStore, newest_first: bool) -> None:
    created = store.enqueue(make(21, group_id="g"))
    store.enqueue(make(4, group_id="other"))  # interleaved noise the filter must drop
    store.enqueue(make(3, group_id="g"))
    expected = [r.id for r in store.list_rollouts(group_id="g", limit=1000, newest_first=newest_first).items]
    assert len(expected) == 24 and set(expected) >= {r.id for r in created}
    assert expected == (sorted(expected, key=expected.index))  # stable order
    if newest_first:
        assert expected[-1] == created[0].id
    else:
        assert expected[0] == created[0].id

    seen, cursor, sizes = [], None, []
    for _ in range(10):
        page = store.list_rollouts(group_id="g", limit=8, cursor=cursor, newest_first=newest_first)
        seen += _ids(page.items)
        sizes.append(len(page.items))
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sizes == [8, 8, 8]  # an exact multiple: no empty trailing page
    assert seen == expected  # no duplicates, no gaps
    with pytest.raises(ValueError):
        store.list_rollouts(cursor="not-a-number")


# ---------------------------------------------------------------------------- resources


def test_resources_versions(store: SqlStore) -> None:
    assert store.latest_resources() is None
    assert store.list_resources().items == []
    v1, v2, v3 = publish(store, "one {x}"), publish(store, "two"), publish(store, "three")
    assert (v1, v2, v3) == (1, 2, 3)
    latest = store.latest_resources()
    assert latest is not None and latest.version == 3
    first = store.get_resources(1)
    prompt = first.resources["prompt"]
    assert isinstance(prompt, PromptTemplate) and prompt.format(x="X") == "one X"
    llm = first.resources["llm"]
    assert isinstance(llm, LLM) and llm.sampling_parameters == {"t": 0.5}
    assert first.metadata == {"note": "one {x}"}
    assert [r.version for r in store.list_resources().items] == [3, 2, 1]
    page = store.list_resources(limit=2)
    assert [r.version for r in page.items] == [3, 2] and page.next_cursor is not None
    rest = store.list_resources(limit=2, cursor=page.next_cursor)
    assert [r.version for r in rest.items] == [1] and rest.next_cursor is None
    with pytest.raises(NotFound):
        store.get_resources(99)


def test_resources_version_resolved_at_dequeue(store: SqlStore) -> None:
    [unversioned] = store.enqueue(make(1))
    got = claim(store)
    assert got.resources is None and got.rollout.resources_version is None  # nothing published yet

    early, pinned = store.enqueue(make(1)) + store.enqueue(make(1, resources_version=1))
    publish(store, "v1")
    late = store.enqueue(make(1))[0]
    publish(store, "v2")
    assert early.resources_version is None and late.resources_version is None
    for expected_id, version in [(early.id, 2), (pinned.id, 1), (late.id, 2)]:
        got = claim(store)
        assert got.rollout.id == expected_id
        assert got.rollout.resources_version == version
        assert got.resources is not None and got.resources.version == version
        assert store.get_rollout(expected_id).resources_version == version
    assert store.get_rollout(unversioned.id).resources_version is None


def test_rollout_pinned_to_an_unpublished_version_waits_for_it(store: SqlStore) -> None:
    publish(store, "v1")
    [future] = store.enqueue(make(1, resources_version=2))
    [now_] = store.enqueue(make(1))
    got = claim(store)
    assert got.rollout.id == now_.id  # the older, pinned rollout is passed over, not failed
    assert store.dequeue("w1") is None
    assert store.get_rollout(future.id).status == RolloutStatus.QUEUED
    publish(store, "v2")
    got = claim(store)
    assert got.rollout.id == future.id
    assert got.resources is not None and got.resources.version == 2


def test_concurrent_publishes_get_distinct_versions(store_factory) -> None:
    stores = [store_factory.open(pool_size=1) for _ in range(8)]  # 8 replicas publishing at once
    versions = run_threads(8, lambda i: publish(stores[i], f"p{i}"))
    assert sorted(versions) == list(range(1, 9))
    assert sorted(r.version for r in stores[0].list_resources().items) == list(range(1, 9))


def test_stats_and_workers(store: SqlStore) -> None:
    publish(store, "v1")
    store.enqueue(make(5, mode=Mode.TRAIN))
    store.enqueue(make(2, mode=Mode.VAL))
    a = claim(store, "alpha").attempt
    store.finish_attempt(a.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=1.0))
    b = claim(store, "alpha").attempt
    store.finish_attempt(b.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=0.5))
    c = claim(store, "beta").attempt
    store.finish_attempt(c.id, AttemptFinish(status=AttemptStatus.FAILED, reward=0.0))  # fails at once
    claim(store, "beta")  # running
    time.sleep(0.01)
    store.add_events(claim(store, "gamma").attempt.id, [ev(0), ev(1)])

    stats = store.stats()
    assert stats["rollouts"] == {"queued": 2, "running": 2, "succeeded": 2, "failed": 1, "cancelled": 0}
    assert stats["events"] == 2
    assert stats["by_version"] == [
        {
            "resources_version": 1,
            "mode": "train",
            "count": 3,
            "mean_reward": 0.5,
            "succeeded": 2,
            "failed": 1,
        }
    ]
    workers = store.list_workers()
    assert [w.id for w in workers] == ["gamma", "beta", "alpha"]  # most recently seen first
    assert {w.id: (w.claims, w.running) for w in workers} == {
        "gamma": (1, 1),
        "beta": (2, 1),
        "alpha": (2, 0),
    }
    assert [w.id for w in store.list_workers(limit=1)] == ["gamma"]


# ---------------------------------------------------------------------------- credentials


def test_each_attempt_gets_its_own_agent_key_and_a_keyed_retry_the_same(store: SqlStore) -> None:
    store.enqueue(make(2))
    first = claim(store, "w1", key="claim-1")
    again = claim(store, "w1", key="claim-1")  # the answer was lost: the same claim and key
    other = claim(store, "w2")
    assert first.agent_key is not None and first.agent_key.startswith("ak_") and len(first.agent_key) == 35
    assert again.attempt.id == first.attempt.id and again.agent_key == first.agent_key
    assert other.agent_key not in (None, first.agent_key)
    assert store.attempt_of_agent_key(first.agent_key) == (first.rollout.id, first.attempt.id)
    assert store.attempt_of_agent_key("ak_" + "x" * 32) is None
    assert "agent_key" not in store.get_attempt(first.attempt.id).model_dump()  # never served


def test_a_registered_workers_token_is_kept_as_its_hash(store: SqlStore) -> None:
    from agentbolt.store.sql import token_sha256

    worker_id, token = store.register_worker("host-a")
    other_id, other_token = store.register_worker("host-a")
    assert worker_id.startswith("host-a-") and other_id != worker_id and token.startswith("wt_")
    found = store.worker_of_token_sha256(token_sha256(token))
    assert found is not None and found.worker_id == worker_id and found.revoked_at is None
    assert store.worker_of_token_sha256(token_sha256(other_token)).worker_id == other_id  # type: ignore[union-attr]
    assert store.worker_of_token_sha256(token_sha256("wt_unknown")) is None
    with store.db.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM workers WHERE token_sha256 = ?", (token,)) == (0,)
    store.enqueue(make(1))
    claim(store, worker_id)  # the worker row is touched (last seen now), its token kept
    seen = store.worker_of_token_sha256(token_sha256(token))
    assert seen is not None and seen.worker_id == worker_id and seen.last_seen >= found.last_seen
    assert worker_id in [w.id for w in store.list_workers()]


def test_a_revoked_worker_can_neither_claim_nor_renew_and_its_attempts_move_on(store: SqlStore) -> None:
    from agentbolt.errors import WorkerRevoked
    from agentbolt.store.sql import token_sha256

    worker_id, token = store.register_worker("host-r")
    store.enqueue(make(2))
    held = claim(store, worker_id)
    revoked = store.revoke_worker(worker_id)
    assert revoked.id == worker_id and revoked.revoked_at is not None and revoked.running == 0
    assert store.worker_of_token_sha256(token_sha256(token)).revoked_at == revoked.revoked_at  # type: ignore[union-attr]
    [attempt] = store.list_attempts(held.rollout.id)
    assert attempt.status == AttemptStatus.LEASE_EXPIRED and "revoked" in (attempt.error or "")
    assert store.get_rollout(held.rollout.id).status == RolloutStatus.QUEUED
    with pytest.raises(WorkerRevoked):
        store.dequeue(worker_id)
    assert store.stats()["rollouts"]["queued"] == 2  # the refused claim was rolled back
    assert store.revoke_worker(worker_id).revoked_at == revoked.revoked_at  # again: unchanged
    with pytest.raises(NotFound):
        store.revoke_worker("nobody")


def test_agent_events_honour_their_key_and_stop_when_the_attempt_ends(store: SqlStore) -> None:
    store.enqueue(make(1))
    c = claim(store)
    reward = [EventCreate(type="reward", data={"value": 1.0}), EventCreate(type="message")]
    assert store.add_agent_events(c.attempt.id, reward, "k1") == 2
    assert store.add_agent_events(c.attempt.id, reward, "k1") == 2  # a repeat: the first answer
    assert store.add_agent_events(c.attempt.id, [EventCreate(type="reward")], None) == 1
    store.add_events(c.attempt.id, [EventCreate(sequence=0, type="mine")], "w1")  # the runner's own
    events = store.list_events(c.rollout.id).items
    assert [e.type for e in events] == ["reward", "message", "reward", "mine"]
    assert [e.sequence for e in events] == [None, None, None, 0]
    with pytest.raises(LeaseLost):
        store.add_agent_events(c.attempt.id, reward, "k2", worker_id="w-other")
    store.cancel(c.rollout.id)
    with pytest.raises(AttemptEnded, match="cancelled"):
        store.add_agent_events(c.attempt.id, reward, "k3")
    with pytest.raises(NotFound):
        store.add_agent_events("at-missing", reward, None)


# ---------------------------------------------------------------------------- durability


@pytest.mark.durable
def test_reopened_store_keeps_everything(store_factory) -> None:
    store = store_factory.open()
    publish(store, "v1")
    done, running, queued = store.enqueue(make(3, group_id="g"))
    attempt = claim(store, "w1").attempt
    store.add_events(attempt.id, [ev(0, n=0), ev(None, "llm_call")])
    store.finish_attempt(attempt.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=0.25))
    held = claim(store, "w2", lease_seconds=600).attempt
    before = (
        store.list_rollouts().items,
        store.list_events(done.id).items,
        store.stats(),
        store.list_workers(),
    )
    store.close()
    store_factory.opened.remove(store)

    reopened = store_factory.open()  # migrations run again: they must be a no-op
    after = (
        reopened.list_rollouts().items,
        reopened.list_events(done.id).items,
        reopened.stats(),
        reopened.list_workers(),
    )
    assert after == before
    assert reopened.get_resources(1).resources["prompt"].template == "v1"  # type: ignore[union-attr]
    assert reopened.get_rollout(done.id).reward == 0.25
    reopened.heartbeat(held.id, "w2")  # the lease survived the restart
    assert reopened.add_events(held.id, [ev(0)]) == 1
    with pytest.raises(LeaseLost):
        reopened.add_events(attempt.id, [ev(1)])
    [newer] = reopened.enqueue(make(1))
    assert [c.rollout.id for c in drain(reopened)] == [queued.id, newer.id]  # FIFO continues
    assert reopened.get_rollout(running.id).status == RolloutStatus.RUNNING


# ---------------------------------------------------------------------------- PostgreSQL only


def test_placeholders_are_rewritten_outside_quotes() -> None:
    from agentbolt.store.postgres import to_pyformat

    sql = """SELECT ?, '?', "a?b", 'it''s ?', 7 % 4 FROM t WHERE x = ?"""
    assert to_pyformat(sql) == """SELECT %s, '?', "a?b", 'it''s ?', 7 %% 4 FROM t WHERE x = %s"""


def _pg_store(dsn: str, schema: str, pool_size: int = 2) -> SqlStore:
    from agentbolt.store.postgres import PostgresDatabase

    return SqlStore(PostgresDatabase(dsn, schema=schema, pool_size=pool_size))


@pytest.mark.postgres
def test_postgres_quotes_and_percent_signs_reach_the_server(pg_dsn: str, pg_schema: str) -> None:
    store = _pg_store(pg_dsn, pg_schema)
    try:
        with store.db.transaction() as tx:
            assert tx.one("SELECT '?', ?, 7 % 4, current_schema()", ("x",)) == ("?", "x", 3, pg_schema)
    finally:
        store.close()


@pytest.mark.postgres
def test_replicas_starting_together_migrate_once(pg_dsn: str, pg_schema: str) -> None:
    from agentbolt.store.schema import MIGRATIONS

    stores = run_threads(6, lambda i: _pg_store(pg_dsn, pg_schema, pool_size=1))
    try:
        with stores[0].db.transaction() as tx:
            assert tx.all("SELECT version FROM schema_migrations") == [(v,) for v, _ in MIGRATIONS]
        stores[1].enqueue(make(1))
        assert stores[5].dequeue("w") is not None
    finally:
        for store in stores:
            store.close()


def _lose_race(
    pg_dsn: str, schema: str, lock: str, key: str, replica_b: Callable[[], Any], *winner: str
) -> Any:
    """Replica A holds the row (``lock`` on ``key``); replica B runs ``replica_b`` until it waits
    for that row; then A runs the ``winner`` statements and commits. Returns B's result (or the
    store error it raised)."""
    import psycopg

    result: list[Any] = []

    def body() -> None:
        try:
            result.append(replica_b())
        except (LeaseLost, InvalidTransition) as exc:
            result.append(exc)

    with psycopg.connect(pg_dsn, options=f"-c search_path={schema}") as a:  # one transaction
        a.execute(lock, (key,))
        thread = threading.Thread(target=body)
        thread.start()
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            blocked, deadline = 0, time.monotonic() + 10
            while not blocked and time.monotonic() < deadline:
                time.sleep(0.01)
                query = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
                blocked = watch.execute(query, (a.info.backend_pid,)).fetchone()[0]  # type: ignore[index]
        assert blocked, "replica B never waited for the row lock"
        for statement in winner:
            a.execute(statement, (key,))
    thread.join(timeout=10)
    assert not thread.is_alive() and len(result) == 1
    return result[0]


@pytest.mark.postgres
@pytest.mark.parametrize("loser", ["expire", "finish", "heartbeat"])
def test_replica_that_loses_a_race_on_an_attempt_changes_nothing(
    pg_dsn: str, pg_schema: str, loser: str
) -> None:
    """Replica B read attempt 1 as running; before its UPDATE lands, replica A expires that
    attempt and the rollout is claimed again (attempt 2). B must not requeue or finish the
    rollout a second time."""
    b = _pg_store(pg_dsn, pg_schema)
    try:
        [ro] = b.enqueue(make(1, max_attempts=3))
        first = claim(b, "w1", lease_seconds=0.05 if loser == "expire" else 60).attempt
        time.sleep(0.1)
        action = {
            "expire": lambda: b.expire(),
            "finish": lambda: b.finish_attempt(first.id, SUCCEEDED, worker_id="w1"),
            "heartbeat": lambda: b.heartbeat(first.id, "w1"),
        }[loser]
        outcome = _lose_race(
            pg_dsn,
            pg_schema,
            "SELECT 1 FROM attempts WHERE id = %s FOR UPDATE",
            first.id,
            action,
            "UPDATE attempts SET status = 'lease_expired', ended_at = 1 WHERE id = %s",
            "INSERT INTO attempts (id, rollout_id, number, worker_id, status, started_at, heartbeat_at, "
            "lease_expires_at) SELECT 'at-second', rollout_id, 2, 'w2', 'running', 1, 1, 1e12 "
            "FROM attempts WHERE id = %s",
            "UPDATE rollouts SET attempts = 2 WHERE id = (SELECT rollout_id FROM attempts WHERE id = %s)",
        )
        if loser == "expire":
            assert outcome == 0
        else:
            assert isinstance(outcome, LeaseLost)
        rollout = b.get_rollout(ro.id)
        assert (rollout.status, rollout.attempts, rollout.reward) == (RolloutStatus.RUNNING, 2, None)
        attempts = b.list_attempts(ro.id)
        assert [(a.id, a.status) for a in attempts][1] == ("at-second", AttemptStatus.RUNNING)
        assert attempts[0].status == AttemptStatus.LEASE_EXPIRED and attempts[0].reward is None
    finally:
        b.close()


@pytest.mark.postgres
def test_cancel_that_loses_a_race_to_a_finish_raises(pg_dsn: str, pg_schema: str) -> None:
    b = _pg_store(pg_dsn, pg_schema)
    try:
        [ro] = b.enqueue(make(1))
        claim(b)
        outcome = _lose_race(
            pg_dsn,
            pg_schema,
            "SELECT 1 FROM rollouts WHERE id = %s FOR UPDATE",
            ro.id,
            lambda: b.cancel(ro.id),
            "UPDATE rollouts SET status = 'succeeded', reward = 1 WHERE id = %s",
        )
        assert isinstance(outcome, InvalidTransition)
        assert b.get_rollout(ro.id).status == RolloutStatus.SUCCEEDED
    finally:
        b.close()


@pytest.mark.postgres
def test_finish_that_loses_a_race_to_a_cancel_keeps_it_cancelled(pg_dsn: str, pg_schema: str) -> None:
    b = _pg_store(pg_dsn, pg_schema)
    try:
        [ro] = b.enqueue(make(1))
        attempt = claim(b).attempt
        outcome = _lose_race(
            pg_dsn,
            pg_schema,
            "SELECT 1 FROM rollouts WHERE id = %s FOR UPDATE",
            ro.id,
            lambda: b.finish_attempt(attempt.id, SUCCEEDED),
            "UPDATE rollouts SET status = 'cancelled' WHERE id = %s",
        )
        assert isinstance(outcome, Rollout) and outcome.status == RolloutStatus.CANCELLED
        assert b.get_rollout(ro.id).status == RolloutStatus.CANCELLED
        assert b.get_attempt(attempt.id).status == AttemptStatus.SUCCEEDED
    finally:
        b.close()


def test_postgres_rejects_unsafe_schema_names() -> None:
    from agentbolt.errors import ConfigError
    from agentbolt.store.postgres import PostgresDatabase

    for bad in ["Upper", "a-b", "x; DROP TABLE rollouts", ""]:
        with pytest.raises(ConfigError):
            PostgresDatabase("postgresql://nobody@127.0.0.1:1/none", schema=bad)


@pytest.mark.postgres
def test_open_store_with_a_postgres_url(pg_dsn: str, pg_schema: str) -> None:
    import psycopg

    from agentbolt.store import open_store

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {pg_schema}")
    joiner = "&" if "?" in pg_dsn else "?"
    store = open_store(f"{pg_dsn}{joiner}options=-csearch_path%3D{pg_schema}", lease_seconds=5)
    try:
        assert store.backend == "postgres" and store.lease_seconds == 5
        [ro] = store.enqueue(make(1))
        with store.db.transaction() as tx:
            assert tx.one("SELECT current_schema(), COUNT(*) FROM rollouts") == (pg_schema, 1)
        assert claim(store).rollout.id == ro.id
    finally:
        store.close()
