"""Every error from reporting or uploading fails the attempt with its reason at once (never
left to lease expiry), and events reach their rollout from any thread: a real server on
loopback and a Runner in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.errors import ServerUnavailable
from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")


def _agent(name: str):
    return load_agent(f"{AGENTS}:{name}")


def _enqueue(client: Client, datas, **kw):
    return client.enqueue([RolloutCreate(task=Task(data=d), **kw) for d in datas])


def _run(runner: Runner, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(runner.run(), timeout))


def _runner_in_thread(runner: Runner, timeout: float = 60) -> threading.Thread:
    thread = threading.Thread(target=_run, args=(runner, timeout), daemon=True)
    thread.start()
    return thread


def _final(client: Client, rollout_ids: list[str], timeout: float):
    result = client.wait(rollout_ids, timeout)
    assert result.done, [r.status for r in result.rollouts]
    return {r.id: r for r in result.rollouts}


def test_a_reward_that_is_not_a_finite_number_fails_the_attempt_at_once(server, client):
    """The server's lease is 30 s: the failures come back in seconds, each with its reason."""
    ros = _enqueue(client, [{"reward": "nan"}, {"reward": "inf"}, {"reward": "-inf"}, {"reward": 0.5}])
    runner = Runner(_agent("echo"), server.url, concurrency=4)
    thread = _runner_in_thread(runner)
    started = time.monotonic()
    try:
        final = _final(client, [r.id for r in ros], timeout=10)
    finally:
        runner.stop()
        thread.join(30)
    assert time.monotonic() - started < 10
    for ro, shown in zip(ros[:3], ("nan", "inf", "-inf"), strict=True):
        rollout = final[ro.id]
        assert rollout.status == RolloutStatus.FAILED and rollout.reward is None
        assert f"reward is not a finite number: {shown}" in (rollout.error or "")
        attempts = client.list_attempts(ro.id)
        assert {a.status for a in attempts} == {AttemptStatus.FAILED}
        assert all(f"not a finite number: {shown}" in (a.error or "") for a in attempts)
        events = client.all_events(ro.id)
        assert not [e for e in events if e.type == "reward"]  # no NaN went to the server
        assert [e.data["type"] for e in events if e.type == "exception"] == ["InvalidReward"] * len(attempts)
    assert final[ros[3].id].status == RolloutStatus.SUCCEEDED and final[ros[3].id].reward == 0.5
    assert runner.completed == 1 and runner.failed >= 3 and runner.lost == 0


def test_events_the_server_refuses_are_dropped_and_fail_the_attempt_with_the_reason(tmp_path):
    config = ServerConfig(
        db=str(tmp_path / "s.db"), lease_seconds=30.0, sweep_interval=0.1, max_body_bytes=64 * 1024
    )
    with ServerThread(config) as srv, Client(srv.url) as client:
        datas = [{"huge_int": True}, {"big": 100_000}, {"unencodable": True}, {}]
        huge, big, unencodable, fine = _enqueue(client, datas, max_attempts=1)
        runner = Runner(_agent("big_events"), srv.url, concurrency=4, max_rollouts=4)
        started = time.monotonic()
        _run(runner, 20)
        assert time.monotonic() - started < 10
        final = _final(client, [huge.id, big.id, unencodable.id, fine.id], timeout=5)
        assert final[fine.id].status == RolloutStatus.SUCCEEDED
        for ro, why in (
            (huge, "the server refused event 1 (counter)"),
            (big, "the server refused event 1 (message): HTTP 413"),
            (unencodable, "could not encode event 1 (handle)"),
        ):
            rollout = final[ro.id]
            assert rollout.status == RolloutStatus.FAILED
            assert why in (rollout.error or ""), rollout.error
            assert ro is not huge or "64 bits" in (rollout.error or "")
            [attempt] = client.list_attempts(ro.id)
            assert attempt.status == AttemptStatus.FAILED and why in (attempt.error or "")
            events = client.all_events(ro.id)
            # only the refused event is missing: the two around it are kept, and the reason
            assert [e.data["content"] for e in events if e.type == "message"] == ["before", "after"]
            [record] = [e for e in events if e.type == "exception"]
            assert record.data["type"] == "EventRefused" and why in record.data["message"]
        assert runner.completed == 1 and runner.failed == 3 and runner.lost == 0


def test_a_failing_upload_does_not_stop_the_heartbeats(tmp_path):
    """Uploads fail for the whole 3 s rollout under a 1 s lease: heartbeats keep it, and the
    attempt ends failed with the upload's error, not as an expired lease."""
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=1.0, sweep_interval=0.1)
    with ServerThread(config) as srv, Client(srv.url) as client:
        [ro] = _enqueue(client, [{"sleep": 3.0}], max_attempts=1)
        runner = Runner(_agent("slow"), srv.url, lease_seconds=1.0, heartbeat_interval=0.3, max_rollouts=1)
        uploads = 0

        async def refuse(*args, **kwargs):
            nonlocal uploads
            uploads += 1
            raise ServerUnavailable("events endpoint down (test)")

        runner.client.add_events = refuse  # type: ignore[method-assign]
        _run(runner, 30)
        rollout = client.get_rollout(ro.id)
        [attempt] = client.list_attempts(ro.id)
        assert uploads >= 2  # tried while the agent ran, and once more at the end
        assert attempt.status == AttemptStatus.FAILED, attempt.error
        assert "events could not be uploaded: events endpoint down" in (attempt.error or "")
        assert rollout.status == RolloutStatus.FAILED and runner.failed == 1


def test_emit_from_a_plain_thread_reaches_the_only_running_rollout(server, client):
    [ro] = _enqueue(client, [{}])
    _run(Runner(_agent("plain_thread"), server.url, max_rollouts=1))
    assert client.get_rollout(ro.id).status == RolloutStatus.SUCCEEDED
    messages = [e.data["content"] for e in client.all_events(ro.id) if e.type == "message"]
    assert messages == [f"from a thread of {ro.task.id}"]


@pytest.mark.parametrize(
    ("agent", "outcome"),
    [("plain_thread", RolloutStatus.FAILED), ("carried_thread", RolloutStatus.SUCCEEDED)],
)
def test_emit_from_a_thread_among_two_running_rollouts(server, client, agent, outcome):
    """Two rollouts at once: a plain thread cannot tell which is its own and says how to fix
    it; a thread from rollout_thread reaches its own rollout."""
    ros = _enqueue(client, [{"pair": True}, {"pair": True}], max_attempts=1)
    _run(Runner(_agent(agent), server.url, concurrency=2, max_rollouts=2))
    for ro in ros:
        rollout = client.get_rollout(ro.id)
        assert rollout.status == outcome, rollout.error
        messages = [e.data["content"] for e in client.all_events(ro.id) if e.type == "message"]
        if outcome == RolloutStatus.FAILED:
            assert "rollout_thread" in (rollout.error or "") and messages == []
        else:
            assert messages == [f"from a thread of {ro.task.id}"]
