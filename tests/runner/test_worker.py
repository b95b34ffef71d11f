"""The runner against a real server: sync and async agents, failures, outages, signals."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import AttemptStatus, EventSource, PromptTemplate, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerProcess

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")


def _agent(name: str):
    return load_agent(f"{AGENTS}:{name}")


def _run(runner: Runner, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(runner.run(), timeout))


def _enqueue(client: Client, datas, **kw):
    return client.enqueue([RolloutCreate(task=Task(data=d), **kw) for d in datas])


def test_sync_agent_with_concurrency(server, client):
    client.publish_resources({"system_prompt": PromptTemplate(template="P:")})
    ros = _enqueue(client, [{"q": str(i), "reward": i / 10} for i in range(12)])
    runner = Runner(_agent("echo"), server.url, concurrency=4, max_rollouts=12)
    _run(runner)
    done = client.wait([r.id for r in ros], 5)
    assert done.done and runner.completed == 12
    assert sorted(r.reward for r in done.rollouts) == pytest.approx([i / 10 for i in range(12)])
    messages = [e.data["content"] for e in client.all_events(ros[3].id) if e.type == "message"]
    assert messages == ["P:3"]


def test_async_agent_events_from_threads_and_tasks(server, client):
    [ro] = _enqueue(client, [{}])
    _run(Runner(_agent("AsyncToolAgent"), server.url, max_rollouts=1))
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward == 0.5
    events = client.all_events(ro.id)
    types = [e.type for e in events]
    assert types.count("tool_call") == 2 and types.count("trajectory") == 1
    assert sorted(e.data["name"] for e in events if e.type == "reward" and "name" in e.data) == [
        "part0",
        "part1",
        "part2",
    ]
    assert sorted(e.sequence for e in events) == list(range(len(events)))


def test_reward_from_emitted_rewards_when_agent_returns_none(server, client):
    [ro] = _enqueue(client, [{}])
    _run(Runner(_agent("emits_only"), server.url, max_rollouts=1))
    assert client.get_rollout(ro.id).reward == pytest.approx(0.75)


def test_agent_exception_fails_attempt_with_traceback_event(server, client):
    """An agent that raises fails its rollout at once: attempts left are for infrastructure
    failures (a lost lease), not for retrying the agent."""
    [ro] = _enqueue(client, [{"fail": True}], max_attempts=2)
    runner = Runner(_agent("echo"), server.url, max_rollouts=1)
    _run(runner)
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.FAILED and "asked to fail" in (rollout.error or "")
    attempts = client.list_attempts(ro.id)
    assert [a.status for a in attempts] == [AttemptStatus.FAILED]
    exc = [e for e in client.all_events(ro.id) if e.type == "exception"]
    assert len(exc) == 1 and "Traceback" in exc[0].data["traceback"] and exc[0].data["type"] == "ValueError"


def _cli_runner(url: str, agent: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "agentbolt",
        "runner",
        "--server",
        url,
        "--agent",
        f"{AGENTS}:{agent}",
        *extra,
    ]
    return subprocess.Popen(
        cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_sigterm_finishes_running_rollouts_then_exits(server, client):
    ros = _enqueue(client, [{"sleep": 1.0}] * 4)
    proc = _cli_runner(server.url, "slow", "--concurrency", "2")
    _wait_until(lambda: client.stats()["rollouts"]["running"] == 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    statuses = sorted(client.get_rollout(r.id).status for r in ros)
    assert statuses.count(RolloutStatus.SUCCEEDED) == 2 and statuses.count(RolloutStatus.QUEUED) == 2


def test_second_signal_releases_attempts_without_using_them_up(server, client):
    [ro] = _enqueue(client, [{"sleep": 60}], max_attempts=1)
    proc = _cli_runner(server.url, "slow")
    _wait_until(lambda: client.get_rollout(ro.id).status == RolloutStatus.RUNNING)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.QUEUED and rollout.attempts == 0
    assert client.list_attempts(ro.id)[0].status == AttemptStatus.RELEASED


def test_sigkilled_runner_rollout_is_retried_and_succeeds_once(tmp_path):
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=1.0, sweep_interval=0.1)
    with ServerProcess(config) as srv, Client(srv.url) as client:
        [ro] = _enqueue(client, [{"sleep": 1.5}], max_attempts=3)
        victim = _cli_runner(srv.url, "slow", "--lease-seconds", "1")
        _wait_until(lambda: client.get_rollout(ro.id).status == RolloutStatus.RUNNING)
        victim.kill()
        victim.wait(10)
        survivor = _cli_runner(srv.url, "slow", "--lease-seconds", "1", "--max-rollouts", "1")
        try:
            assert survivor.wait(60) == 0
        finally:
            survivor.kill()
        rollout = client.get_rollout(ro.id)
        attempts = client.list_attempts(ro.id)
        assert rollout.status == RolloutStatus.SUCCEEDED
        assert [a.status for a in attempts] == [AttemptStatus.LEASE_EXPIRED, AttemptStatus.SUCCEEDED]
        assert attempts[0].worker_id != attempts[1].worker_id


def test_runner_survives_a_server_restart(tmp_path):
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=5.0, sweep_interval=0.1)
    srv = ServerProcess(config).start()
    try:
        with Client(srv.url) as client:
            ros = _enqueue(client, [{"sleep": 0.2}] * 10)
        runner = Runner(_agent("slow"), srv.url, concurrency=2, lease_seconds=5.0, max_rollouts=10)
        thread = threading.Thread(target=_run, args=(runner, 90))
        thread.start()
        time.sleep(0.5)
        srv.kill()  # SIGKILL: no chance to flush anything
        time.sleep(1.5)
        srv.start()
        thread.join(90)
        assert not thread.is_alive()
        with Client(srv.url) as client:
            final = client.wait([r.id for r in ros], 30)
        assert final.done
        assert all(r.status == RolloutStatus.SUCCEEDED for r in final.rollouts)
    finally:
        srv.stop()


class _FailingEventsStore:
    """The real SQLite store, except that adding events to attempts of a rollout whose task says
    ``"poison"`` raises: the server answers those requests HTTP 500, every time (a fault of
    the server on one request, not an outage)."""

    def __init__(self, store) -> None:
        self._store = store
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def add_events(self, attempt_id, events, worker_id=None, source=EventSource.RUNNER, key=None):
        attempt = self._store.get_attempt(attempt_id)
        if self._store.get_rollout(attempt.rollout_id).task.data.get("poison"):
            self.refused += 1
            raise RuntimeError("the store cannot take these events")
        return self._store.add_events(attempt_id, events, worker_id, source, key)


def test_a_request_the_server_fails_on_ends_the_attempt_with_the_reason(tmp_path, caplog):
    """The runner rides out outages forever, but a request answered 500 again and again is given
    up after RetryPolicy.server_errors tries: that attempt fails naming the error (the warning
    logged on the way), and the runner's other rollouts go on."""
    from agentbolt.server import ServerThread
    from agentbolt.store import open_store

    store = _FailingEventsStore(open_store(str(tmp_path / "store.db"), lease_seconds=30.0))
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=30.0)
    with ServerThread(config, store=store) as srv, Client(srv.url) as client:
        datas = [{"poison": True}, {"q": "a", "reward": 1.0}, {"q": "b", "reward": 1.0}]
        poison, *fine = _enqueue(client, datas, max_attempts=1)
        runner = Runner(_agent("echo"), srv.url, concurrency=1, max_rollouts=3)
        runner.client.retry = dataclasses.replace(runner.client.retry, base_delay=0.01, max_delay=0.01)
        with caplog.at_level("WARNING", logger="agentbolt.client"):
            _run(runner)
        done = client.wait([r.id for r in (poison, *fine)], 10)
        assert done.done
        by_id = {r.id: r for r in done.rollouts}
        assert by_id[poison.id].status == RolloutStatus.FAILED
        [attempt] = client.list_attempts(poison.id)
        assert "events could not be uploaded" in (attempt.error or "")
        assert "failed after 5 tries" in attempt.error and "HTTP 500" in attempt.error
        assert [by_id[r.id].status for r in fine] == [RolloutStatus.SUCCEEDED] * 2
        # each batch of events that reached the store was tried exactly server_errors (5) times
        assert store.refused >= 5 and store.refused % 5 == 0
        assert runner.failed == 1 and runner.completed == 2
    assert any(
        "has failed 3 times" in r.getMessage() and "HTTP 500" in r.getMessage() for r in caplog.records
    )


def test_an_unreachable_server_is_retried_past_the_server_error_limit_with_warnings(caplog):
    """No connection is an outage: with ``attempts=0`` (the runner's) the call keeps trying
    beyond ``server_errors`` tries, and says so in the log."""
    from agentbolt.client import AsyncClient, RetryPolicy
    from agentbolt.server.run import free_port

    async def main() -> None:
        client = AsyncClient(
            f"http://127.0.0.1:{free_port()}",
            retry=RetryPolicy(attempts=0, base_delay=0.001, max_delay=0.002),
        )
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.health(), 3.0)
        finally:
            await client.aclose()

    with caplog.at_level("WARNING", logger="agentbolt.client"):
        asyncio.run(main())
    counts = [r.getMessage() for r in caplog.records if "has failed" in r.getMessage()]
    assert any("has failed 3 times" in m for m in counts)
    assert any("has failed 20 times" in m for m in counts)  # well past server_errors (5)
