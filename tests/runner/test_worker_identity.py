"""The runner when the server stops taking its worker token: revoked by an admin (it stops, and
says why), or expired after its worker went unseen (it registers again and goes on). Real
server on 127.0.0.1 with configured tokens, real runner."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentbolt.client import Client
from agentbolt.errors import WorkerRevoked
from agentbolt.runner.agent import rollout
from agentbolt.runner.worker import Runner
from agentbolt.schemas import RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread

ADMIN, RUNNER = "adm-identity-1f", "run-identity-2e"


@rollout
async def waits(task: Task) -> float:
    await asyncio.sleep(task.data["seconds"])
    return 1.0


def _in_thread(runner: Runner) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(runner.run(), 60))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _until(what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def secure(tmp_path):
    config = ServerConfig(
        db=str(tmp_path / "ids.db"), tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER}, sweep_interval=0.1
    )
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        yield srv, admin


def test_a_revoked_runner_stops_and_says_why_and_its_rollout_is_queued_again(secure):
    srv, admin = secure
    [ro] = admin.enqueue([RolloutCreate(task=Task(data={"seconds": 30}))])
    runner = Runner(waits, srv.url, token=RUNNER, lease_seconds=1.5, poll_wait=0.2)
    thread, errors = _in_thread(runner)
    _until(lambda: admin.get_rollout(ro.id).status == RolloutStatus.RUNNING)
    [attempt] = admin.list_attempts(ro.id)
    assert attempt.worker_id == runner.worker_id  # the issued identity
    admin.revoke_worker(runner.worker_id)
    thread.join(15)
    assert not thread.is_alive(), "the runner did not stop"
    [error] = errors
    assert isinstance(error, WorkerRevoked) and "revoked" in str(error)
    assert runner.failure is error and runner.completed == 0
    # the attempt ended at the revocation, with the reason; the rollout waits for another runner
    assert admin.get_rollout(ro.id).status == RolloutStatus.QUEUED
    [ended] = admin.list_attempts(ro.id)
    assert ended.status.value == "lease_expired" and "was revoked" in (ended.error or "")


@rollout
async def blocks(task: Task) -> float:
    """Holds the runner's event loop (a synchronous call in an async agent): no heartbeat meanwhile."""
    time.sleep(task.data["seconds"])
    return 1.0


def _slow_then_quick(tmp_path, monkeypatch, agent, seconds: float, max_rollouts: int):
    """A slow rollout, then a quick one, for one runner with a 9-second lease (a heartbeat every
    3 s) on a server whose worker tokens expire 1 s after their worker was last seen. Returns
    the admin client's view of both rollouts' attempts, the runner, and its first worker id."""
    from agentbolt.server import middleware

    monkeypatch.setattr(middleware, "RECHECK_S", 0.1)
    config = ServerConfig(
        db=str(tmp_path / "ttl.db"),
        tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER},
        worker_token_ttl=1.0,
        sweep_interval=0.1,
    )
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        slow, quick = admin.enqueue(
            [
                RolloutCreate(task=Task(data={"seconds": seconds})),
                RolloutCreate(task=Task(data={"seconds": 0})),
            ]
        )
        runner = Runner(
            agent, srv.url, token=RUNNER, lease_seconds=9, poll_wait=0.2, max_rollouts=max_rollouts
        )
        thread, errors = _in_thread(runner)
        _until(lambda: admin.get_rollout(slow.id).status == RolloutStatus.RUNNING)
        first = runner.worker_id
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
        attempts = {
            name: (admin.get_rollout(ro.id).status, [a.worker_id for a in admin.list_attempts(ro.id)])
            for name, ro in (("slow", slow), ("quick", quick))
        }
        workers = {w.id for w in admin.list_workers()}
    return attempts, runner, first, workers


def test_a_runner_heartbeats_within_its_token_ttl_so_a_long_attempt_keeps_its_finish(tmp_path, monkeypatch):
    # 2.5 s of async work: the 3-second heartbeats alone would not keep the worker seen
    attempts, runner, first, _ = _slow_then_quick(tmp_path, monkeypatch, waits, 2.5, max_rollouts=2)
    assert runner.worker_id == first and runner.lost == 0 and runner.completed == 2
    assert attempts == {
        "slow": (RolloutStatus.SUCCEEDED, [first]),
        "quick": (RolloutStatus.SUCCEEDED, [first]),
    }


def test_a_runner_whose_token_expired_registers_again_and_goes_on(tmp_path, monkeypatch):
    # the slow rollout holds the runner's event loop for longer than the token's TTL: no
    # heartbeat goes out, the worker is unseen, and its token expires
    attempts, runner, first, workers = _slow_then_quick(tmp_path, monkeypatch, blocks, 2.0, max_rollouts=1)
    # the slow one's finish was refused (expired); registered again, it ran the next one
    assert runner.worker_id != first and runner.lost == 1 and runner.completed == 1
    assert attempts["quick"] == (RolloutStatus.SUCCEEDED, [runner.worker_id])
    assert {first, runner.worker_id} <= workers


def test_a_runner_works_unchanged_on_a_server_for_registered_runners_only(tmp_path):
    config = ServerConfig(
        db=str(tmp_path / "strict.db"),
        tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER},
        registered_runners_only=True,
    )
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        ros = admin.enqueue([RolloutCreate(task=Task(data={"seconds": 0})) for _ in range(3)])
        runner = Runner(waits, srv.url, token=RUNNER, max_rollouts=3, poll_wait=0.2, tracing=True)
        asyncio.run(asyncio.wait_for(runner.run(), 60))
        assert runner.completed == 3
        for ro in ros:
            assert admin.get_rollout(ro.id).status == RolloutStatus.SUCCEEDED
            assert any(e.type == "span" for e in admin.all_events(ro.id))  # spans under the worker token
