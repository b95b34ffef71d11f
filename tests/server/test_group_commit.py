"""Group commit on SQLite (agentbolt.server.store_caller): the store calls of one event-loop turn
share one COMMIT; none returns (or raises) before it, a failing one rolls back alone, and other
threads using the store meanwhile wait for the group rather than join it. Real SQLite files, a
real server over HTTP."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

from agentbolt.client import AsyncClient
from agentbolt.errors import AttemptEnded, NotFound
from agentbolt.schemas import AttemptFinish, AttemptStatus, EventCreate, RolloutCreate, Task
from agentbolt.server import ServerConfig
from agentbolt.server.run import ServerThread
from agentbolt.server.store_caller import StoreCaller
from agentbolt.store import open_store

pytestmark = pytest.mark.timeout(120)


def _committed(path: str, sql: str) -> int:
    """What another connection (another process's view) reads: committed rows only."""
    with sqlite3.connect(path) as conn:
        return int(conn.execute(sql).fetchone()[0])


def test_calls_of_one_turn_share_a_commit_and_return_only_after_it(tmp_path):
    path = str(tmp_path / "store.db")
    store = open_store(path)
    commits: list[str] = []
    store.db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    call = StoreCaller(store)

    async def enqueue(i: int) -> int:
        await call(store.enqueue, [RolloutCreate(task=Task(data={"i": i}))])
        # answered: the write is in the database for every other connection
        return _committed(path, "SELECT count(*) FROM rollouts")

    async def main() -> list[int]:
        return await asyncio.gather(*(enqueue(i) for i in range(10)))

    seen = asyncio.run(main())
    assert commits == ["COMMIT"]  # ten writes, one commit
    assert seen == [10] * 10  # none returned before all ten were committed
    store.close()


def test_a_failing_call_rolls_back_alone_and_raises_after_the_commit(tmp_path):
    path = str(tmp_path / "store.db")
    store = open_store(path)
    [rollout] = store.enqueue([RolloutCreate(task=Task(data={}))])
    call = StoreCaller(store)

    def write_then_fail() -> None:
        with store.db.transaction() as tx:
            tx.run("UPDATE rollouts SET error = 'half done' WHERE id = ?", (rollout.id,))
            raise ValueError("no such thing")

    async def main() -> list[object]:
        return await asyncio.gather(
            call(store.enqueue, [RolloutCreate(task=Task(data={"n": 1}))]),
            call(write_then_fail),
            call(store.add_events, "at-missing", [EventCreate(sequence=0, type="message")]),
            call(store.enqueue, [RolloutCreate(task=Task(data={"n": 2}))]),
            return_exceptions=True,
        )

    first, failed, missing, last = asyncio.run(main())
    assert isinstance(failed, ValueError) and isinstance(missing, NotFound)
    assert not isinstance(first, BaseException) and not isinstance(last, BaseException)
    assert _committed(path, "SELECT count(*) FROM rollouts") == 3  # both enqueues kept
    assert _committed(path, "SELECT count(*) FROM rollouts WHERE error IS NOT NULL") == 0  # rolled back
    store.close()


def test_another_thread_waits_for_the_group_and_commits_on_its_own(tmp_path):
    path = str(tmp_path / "store.db")
    store = open_store(path)
    call = StoreCaller(store)
    done = threading.Event()

    def other_thread() -> None:  # a direct store user (a trainer next to a server thread)
        store.enqueue([RolloutCreate(task=Task(data={"other": True}))])
        done.set()

    async def main() -> None:
        await call(store.enqueue, [RolloutCreate(task=Task(data={"n": 1}))])  # opens and commits a group
        thread = threading.Thread(target=other_thread)
        task = asyncio.ensure_future(call(store.enqueue, [RolloutCreate(task=Task(data={"n": 2}))]))
        await asyncio.sleep(0)  # the group is open now, its lock held by this thread
        thread.start()
        await task
        await asyncio.to_thread(thread.join, 30)

    asyncio.run(main())
    assert done.is_set()
    assert _committed(path, "SELECT count(*) FROM rollouts") == 3
    store.close()


def test_the_runner_path_over_http_keeps_every_write(tmp_path):
    path = str(tmp_path / "store.db")
    with ServerThread(ServerConfig(db=path)) as server:

        async def worker(client: AsyncClient, wid: str) -> int:
            done = 0
            while (claim := await client.dequeue(wid)) is not None:
                events = [EventCreate(sequence=i, type="message", data={"i": i}) for i in range(3)]
                await client.add_events(claim.attempt.id, events, wid)
                await client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, None, wid)
                done += 1
            return done

        async def main() -> int:
            client = AsyncClient(server.url, max_connections=16)
            try:
                await client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(60)])
                return sum(await asyncio.gather(*(worker(client, f"w{i}") for i in range(12))))
            finally:
                await client.aclose()

        assert asyncio.run(main()) == 60
        assert (
            _committed(path, "SELECT count(*) FROM rollouts WHERE status = 'succeeded' AND attempts = 1")
            == 60
        )
        assert _committed(path, "SELECT count(*) FROM attempts WHERE status = 'succeeded'") == 60
        assert _committed(path, "SELECT count(*) FROM events") == 180
        assert _committed(path, "SELECT count(*) FROM workers") == 12


def test_a_finish_after_the_end_is_still_refused(tmp_path):
    """Savepoints keep each call's checks: a second finish of one attempt in the same turn is a 409."""
    store = open_store(str(tmp_path / "store.db"))
    store.enqueue([RolloutCreate(task=Task(data={}))])
    claim = store.dequeue("w1")
    assert claim is not None
    call = StoreCaller(store)
    finish = AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=1.0)

    async def main() -> list[object]:
        return await asyncio.gather(
            call(store.finish_attempt, claim.attempt.id, finish, "w1"),
            call(store.finish_attempt, claim.attempt.id, finish, "w1"),
            return_exceptions=True,
        )

    first, second = asyncio.run(main())
    assert not isinstance(first, BaseException) and first.status.value == "succeeded"
    assert isinstance(second, AttemptEnded) and "is succeeded, not running" in str(second)
    store.close()


def test_a_thread_waiting_for_the_store_gets_its_turn_while_the_server_is_busy(tmp_path):
    """With groups back to back (32 runners calling again as soon as they are answered), a
    thread using the store directly still gets the connection between two groups."""
    path = str(tmp_path / "store.db")
    store = open_store(path)
    call = StoreCaller(store)
    took: list[float] = []

    def other_thread() -> None:
        t0 = time.monotonic()
        for i in range(50):
            store.enqueue([RolloutCreate(task=Task(data={"other": i}))])
        took.append(time.monotonic() - t0)

    async def busy() -> int:
        thread = threading.Thread(target=other_thread)
        deadline = time.monotonic() + 20
        calls = 0
        warm = 64  # the thread starts once the runners have this many answers: the server is busy

        async def runner() -> None:  # a runner that calls again as soon as it is answered
            nonlocal calls
            while time.monotonic() < deadline:
                await call(store.enqueue, [RolloutCreate(task=Task(data={}))])
                calls += 1
                if calls == warm:
                    thread.start()
                elif calls > warm and not thread.is_alive():
                    return

        await asyncio.gather(*(runner() for _ in range(32)))
        await asyncio.to_thread(thread.join, 30)
        return calls - warm

    rounds = asyncio.run(busy())
    assert took and took[0] < 10, took  # not starved until the loop stopped
    assert rounds > 0  # the runners kept calling after the thread started: the server was busy
    assert (
        _committed(
            path,
            "SELECT count(*) FROM rollouts WHERE task_id IN (SELECT id FROM tasks WHERE data LIKE '%other%')",
        )
        == 50
    )
    store.close()


def test_a_read_with_no_group_open_takes_no_transaction_and_one_in_a_group_waits_for_it(tmp_path):
    """``StoreCaller.read`` (the gateway's attempt check on every call): alone in its turn it is
    answered at once, no BEGIN/COMMIT; beside a write of its turn it joins the write's group,
    sees the write and answers only once it is committed."""
    path = str(tmp_path / "store.db")
    store = open_store(path)
    [first] = store.enqueue([RolloutCreate(task=Task(data={}))])
    statements: list[str] = []
    store.db.conn.set_trace_callback(statements.append)
    call = StoreCaller(store)

    def count() -> int:
        with store.db.autocommit() as tx:
            return int(tx.all("SELECT count(*) FROM rollouts")[0][0])

    async def read_in_group() -> tuple[tuple[int, int], int]:
        inside = await call.read(lambda: (count(), _committed(path, "SELECT count(*) FROM rollouts")))
        return inside, _committed(path, "SELECT count(*) FROM rollouts")  # once answered

    async def main() -> tuple[str, list[object]]:
        await call(store.enqueue, [RolloutCreate(task=Task(data={"n": 1}))])  # a group, committed
        statements.clear()
        alone = await call.read(store.get_rollout, first.id)
        assert not [s for s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")]
        grouped = await asyncio.gather(
            call(store.enqueue, [RolloutCreate(task=Task(data={"n": 2}))]),
            read_in_group(),
        )
        return alone.id, grouped

    alone, (_, ((seen, committed_then), committed_after)) = asyncio.run(main())
    assert alone == first.id
    assert seen == 3 and committed_then == 2  # inside the group: its write, not committed yet
    assert committed_after == 3  # answered after the group's commit
    assert statements.count("COMMIT") == 1  # the read added no commit of its own
    assert _committed(path, "SELECT count(*) FROM rollouts") == 3
    store.close()
