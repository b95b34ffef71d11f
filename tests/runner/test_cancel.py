"""Cancellation stops work: the runner learns of it at its next heartbeat, cancels the agent
and its slot takes new work at once. A real server on loopback and a Runner in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from agentbolt.client import Client
from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")
LEASE = 3.0  # the runner heartbeats every LEASE / 3 = 1 s


def _start(runner: Runner) -> threading.Thread:
    thread = threading.Thread(target=asyncio.run, args=(asyncio.wait_for(runner.run(), 90),), daemon=True)
    thread.start()
    return thread


def _wait_until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
    return time.monotonic() - started


def _running(client: Client) -> int:
    return int(client.stats()["rollouts"]["running"])


def test_cancelled_async_agents_stop_and_their_slots_take_new_work(tmp_path):
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=LEASE, sweep_interval=0.1)
    log = tmp_path / "cancelled.log"
    with ServerThread(config) as srv, Client(srv.url) as client:
        runner = Runner(load_agent(f"{AGENTS}:AsyncSleeper"), srv.url, concurrency=10)
        thread = _start(runner)
        try:
            stuck = client.enqueue([RolloutCreate(task=Task(data={"sleep": 60, "log": str(log)}))] * 10)
            _wait_until(lambda: _running(client) == 10, 30)
            for ro in stuck:
                client.cancel(ro.id)
            took = _wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 10, 10)
            assert took < LEASE / 3 + 1.5  # one heartbeat interval, and time to act on it
            fresh = client.enqueue([RolloutCreate(task=Task(data={"sleep": 0.2}))] * 10)
            done = client.wait([r.id for r in fresh], 10)
            assert done.done and {r.status for r in done.rollouts} == {RolloutStatus.SUCCEEDED}
        finally:
            runner.stop()
            thread.join(30)
        for ro in stuck:
            assert client.get_rollout(ro.id).status == RolloutStatus.CANCELLED
            [attempt] = client.list_attempts(ro.id)
            assert attempt.status == AttemptStatus.CANCELLED
        cancelled = {line.split()[1] for line in log.read_text().splitlines()}
        assert cancelled == {ro.task.id for ro in stuck}
        assert runner.lost == 10 and runner.completed == 10 and runner.abandoned == 0


def test_a_cancelled_sync_agent_is_abandoned_and_its_slot_takes_new_work(tmp_path):
    """A sync agent's thread cannot be interrupted: it sleeps on in the background, counted
    in ``abandoned``, while the runner's only slot runs the next rollout."""
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=LEASE, sweep_interval=0.1)
    with ServerThread(config) as srv, Client(srv.url) as client:
        runner = Runner(load_agent(f"{AGENTS}:slow"), srv.url, concurrency=1, spare_threads=1)
        thread = _start(runner)
        try:
            [stuck] = client.enqueue([RolloutCreate(task=Task(data={"sleep": 8}))])
            _wait_until(lambda: _running(client) == 1, 30)
            client.cancel(stuck.id)
            _wait_until(lambda: runner.abandoned == 1, LEASE / 3 + 1.5)
            [fresh] = client.enqueue([RolloutCreate(task=Task(data={"sleep": 0.2}))])
            done = client.wait([fresh.id], 5)  # well before the abandoned thread's 8 s are up
            assert done.done and done.rollouts[0].status == RolloutStatus.SUCCEEDED
            # the server records the finish before the runner's answer to it arrives and counts it
            _wait_until(lambda: runner.completed == 1, 2)
            assert runner.abandoned == 1 and runner.lost == 1 and runner.completed == 1
        finally:
            runner.stop()
            thread.join(30)
        assert client.get_rollout(stuck.id).status == RolloutStatus.CANCELLED


def test_slots_wait_for_a_thread_while_abandoned_ones_hold_them_all(tmp_path):
    """One slot and one spare thread: after two abandoned agents, the next rollout is claimed
    only once the first abandoned thread ends (not claimed, then stuck behind it)."""
    config = ServerConfig(db=str(tmp_path / "s.db"), lease_seconds=LEASE, sweep_interval=0.1)
    with ServerThread(config) as srv, Client(srv.url) as client:
        runner = Runner(load_agent(f"{AGENTS}:slow"), srv.url, concurrency=1, spare_threads=1)
        thread = _start(runner)
        try:
            first, second = client.enqueue([RolloutCreate(task=Task(data={"sleep": 5}))] * 2)
            _wait_until(lambda: client.get_rollout(first.id).status == RolloutStatus.RUNNING, 30)
            first_started = time.monotonic()
            client.cancel(first.id)
            _wait_until(lambda: client.get_rollout(second.id).status == RolloutStatus.RUNNING, 5)
            client.cancel(second.id)
            _wait_until(lambda: runner.abandoned == 2, LEASE / 3 + 1.5)
            [fresh] = client.enqueue([RolloutCreate(task=Task(data={"sleep": 0.2}))])
            _wait_until(lambda: client.get_rollout(fresh.id).status != RolloutStatus.QUEUED, 15)
            assert time.monotonic() - first_started > 4.5  # claimed once the first thread ended
            done = client.wait([fresh.id], 5)
            assert done.done and done.rollouts[0].status == RolloutStatus.SUCCEEDED
        finally:
            runner.stop()
            thread.join(30)
