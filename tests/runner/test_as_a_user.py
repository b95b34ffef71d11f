"""Issue 18's findings, tried as a new user would: `agentbolt server` and `agentbolt runner`
as real processes, the rollouts enqueued and cancelled with the client."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agentbolt.client import Client
from agentbolt.schemas import AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server.run import free_port, wait_healthy

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")


def _agentbolt(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbolt", *args],
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _end(proc: subprocess.Popen) -> str:
    """Stop a process we started (SIGTERM, then SIGKILL) and return what it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    out, _ = proc.communicate(timeout=10)
    return out or ""


@contextlib.contextmanager
def _server(tmp_path: Path, *args: str) -> Iterator[Client]:
    port = free_port()
    proc = _agentbolt("server", "--db", str(tmp_path / "s.db"), "--port", str(port), *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30)
        with Client(url) as client:
            yield client
    finally:
        _end(proc)


@contextlib.contextmanager
def _runner(client: Client, agent: str, *args: str) -> Iterator[subprocess.Popen]:
    proc = _agentbolt("runner", "--server", client.url, "--agent", f"{AGENTS}:{agent}", *args)
    try:
        yield proc
    finally:
        out = _end(proc)
        assert "Traceback" not in out, out


def _wait_until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_nan_reward_fails_in_seconds_with_its_reason(tmp_path):
    """It used to end 6 s later (the lease) as "lease expired"."""
    with _server(tmp_path, "--lease-seconds", "6") as client, _runner(client, "echo"):
        [ro] = client.enqueue([RolloutCreate(task=Task(data={"reward": "nan"}), max_attempts=1)])
        # the runner process may take a while to start on a loaded machine: time from its claim
        _wait_until(lambda: client.get_rollout(ro.id).status != RolloutStatus.QUEUED, 30)
        done = client.wait([ro.id], 5)  # less than the lease
        assert done.done
        rollout = done.rollouts[0]
        assert rollout.status == RolloutStatus.FAILED
        assert "reward is not a finite number: nan" in (rollout.error or "")
        [attempt] = client.list_attempts(ro.id)
        assert attempt.status == AttemptStatus.FAILED


def test_a_default_runner_keeps_a_rollout_longer_than_the_servers_lease(tmp_path):
    """`agentbolt server --lease-seconds 6`, a runner without a lease flag, a 9 s rollout."""
    with _server(tmp_path, "--lease-seconds", "6") as client, _runner(client, "slow"):
        [ro] = client.enqueue([RolloutCreate(task=Task(data={"sleep": 9}), max_attempts=1)])
        _wait_until(lambda: client.get_rollout(ro.id).status != RolloutStatus.QUEUED, 30)
        done = client.wait([ro.id], 20)
        assert done.done and done.rollouts[0].status == RolloutStatus.SUCCEEDED
        [attempt] = client.list_attempts(ro.id)
        assert attempt.status == AttemptStatus.SUCCEEDED


def test_cancelled_rollouts_free_their_slots_for_the_next_ones(tmp_path):
    """Ten 60 s rollouts on ten slots, cancelled: their agents stop within one heartbeat
    interval (2 s under a 6 s lease) and the next ten rollouts run at once and succeed."""
    log = tmp_path / "cancelled.log"
    with (
        _server(tmp_path, "--lease-seconds", "6") as client,
        _runner(client, "AsyncSleeper", "--concurrency", "10"),
    ):
        stuck = client.enqueue([RolloutCreate(task=Task(data={"sleep": 60, "log": str(log)}))] * 10)
        _wait_until(lambda: client.stats()["rollouts"]["running"] == 10, 30)
        for ro in stuck:
            client.cancel(ro.id)
        took = _wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 10, 15)
        assert took < 2.0 + 2.0  # one heartbeat interval, and time to act on it
        fresh = client.enqueue([RolloutCreate(task=Task(data={"sleep": 0.5}), max_attempts=1)] * 10)
        done = client.wait([r.id for r in fresh], 10)
        assert done.done and {r.status for r in done.rollouts} == {RolloutStatus.SUCCEEDED}
        assert {line.split()[1] for line in log.read_text().splitlines()} == {ro.task.id for ro in stuck}
        assert {client.get_rollout(ro.id).status for ro in stuck} == {RolloutStatus.CANCELLED}


def test_a_class_that_needs_constructor_arguments_is_one_clear_message(tmp_path):
    proc = _agentbolt("runner", "--server", "http://127.0.0.1:9", "--agent", f"{AGENTS}:NeedsArgs")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert "Traceback" not in out and "TypeError" not in out
    assert "NeedsArgs needs constructor arguments (model)" in out
