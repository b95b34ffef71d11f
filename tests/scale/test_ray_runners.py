"""Runners as Ray actors (agentbolt.runner.ray_runners) against a real local Ray cluster (one
``ray.init`` per module, 16 logical CPUs and 4 ``sandbox`` slots on this 2-core machine) and
the real server on 127.0.0.1.

The store stays the only source of truth: an actor SIGKILLed mid-run is restarted by Ray, and
the attempts it held are retried by the store once their (2 s) leases run out, as they are
for a killed runner process. Checked from the database (``scale_support.audit``) and from the
agent's own side effects (a line per completed run, written by the agent before it returns).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scale_agents import check_events
from scale_support import HERE, audit, db_query, wait_until

from agentbolt.client import Client
from agentbolt.errors import ConfigError, MissingExtra
from agentbolt.runner.program import Program
from agentbolt.schemas import RolloutCreate, Task
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.server.run import free_port

pytestmark = pytest.mark.timeout(150)

try:
    import ray
except ImportError:  # under CI=true the fixture fails instead (scripts/test.sh installs the extra)
    ray = None  # type: ignore[assignment]

ENV = {"env_vars": {"PYTHONPATH": str(HERE)}}
"""The actors' runtime environment: tests/scale on their path, so ``ray_agents`` imports."""
SANDBOXES = 4


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster for the module; yields its address (for a second driver)."""
    from scale_support import need

    need(ray is not None, "ray is not installed: pip install 'agentbolt[ray]'")
    ray.init(
        num_cpus=16,  # logical: more actors than cores, as a cluster would place them
        resources={"sandbox": SANDBOXES},
        include_dashboard=False,
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture
def store(tmp_path) -> Iterator[tuple[ServerThread, str]]:
    db = str(tmp_path / "store.db")
    with ServerThread(ServerConfig(db=db, lease_seconds=30.0, sweep_interval=0.1)) as srv:
        yield srv, db


def _tasks(log: Path, n: int, **data: Any) -> list[RolloutCreate]:
    return [
        RolloutCreate(task=Task(data={"i": i, "events": 3, "log": str(log), **data}), max_attempts=5)
        for i in range(n)
    ]


def _lines(log: Path) -> list[tuple[str, str, int]]:
    """The agent's side effects: (rollout id, attempt id, pid) per completed run."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        rid, aid, pid = line.split()
        out.append((rid, aid, int(pid)))
    return out


def _wait_all(client: Client, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not client.wait(ids, timeout=min(30.0, max(0.1, deadline - time.monotonic()))).done:
        assert time.monotonic() < deadline, f"not final in {timeout:g} s: {client.stats()['rollouts']}"


def _running_of(db: str, worker_id: str) -> list[str]:
    rows = db_query(db, "SELECT id FROM attempts WHERE worker_id = ? AND status = 'running'", (worker_id,))
    return [r[0] for r in rows]


def _sandboxes_free() -> float:
    return float(ray.available_resources().get("sandbox", 0.0))


# ---------------------------------------------------------------------------- one actor killed


def test_100_rollouts_through_4_actors_one_killed(ray_cluster, store, tmp_path):
    """100 rollouts, 4 actors (2 slots each, one sandbox slot each), 2 s leases. Once work is
    under way, the process of actor 1 is SIGKILLed while it holds attempts: Ray restarts it (a
    new process behind the same handle, registered anew), the store retries its attempts after
    their leases expire, and every rollout ends succeeded with exactly one succeeded attempt."""
    from agentbolt.runner.ray_runners import RayRunners

    srv, db = store
    log = tmp_path / "done.log"
    runners = RayRunners(
        replicas=4, num_cpus=1, resources={"sandbox": 1}, concurrency=2, lease_seconds=2, runtime_env=ENV
    )
    with Client(srv.url) as client:
        runners.start("ray_agents:counted", srv.url)
        try:
            infos = runners.wait_ready(timeout=90)
            assert len({i["pid"] for i in infos}) == 4 and all(i["worker_id"] for i in infos)
            assert _sandboxes_free() == 0  # each actor holds its sandbox slot
            ids = [r.id for r in client.enqueue(_tasks(log, 100, sleep=0.1))]  # all four take part
            victim = infos[0]
            wait_until(lambda: len(_lines(log)) >= 10, 60, "10 rollouts done")
            wait_until(lambda: _running_of(db, victim["worker_id"]), 30, "the victim to hold attempts")
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.time()
            time.sleep(0.3)  # a request it sent just before is answered; its leases run 2 s
            held = _running_of(db, victim["worker_id"])
            assert held, "the victim finished everything it held before it died: kill it busier"

            # Ray restarts it: the same handle answers from a new process, with a new identity
            again = ray.get(runners.actors[0].ready.remote(), timeout=60)
            assert again["pid"] != victim["pid"] and again["worker_id"] != victim["worker_id"]
            assert again["started"] > killed_at

            _wait_all(client, ids, 90)

            # the restarted actor serves: with the three others stopped, it does new work alone
            for actor in runners.actors[1:]:
                ray.get(actor.stop.remote(5.0), timeout=30)
            more = [r.id for r in client.enqueue(_tasks(log, 6, sleep=0.0))]
            _wait_all(client, more, 60)
        finally:
            totals = runners.stop()
    assert totals["completed"] >= 6  # the last lives' counts (the killed life's are gone)

    checked = audit(db, ids + more, check_events)
    assert not checked.problems, checked.problems[:5]
    assert checked.status_counts() == {"succeeded": 106}
    won_by = {a["worker_id"] for rid in ids for a in checked.attempts[rid] if a["status"] == "succeeded"}
    assert {i["worker_id"] for i in infos} <= won_by  # all four did work, the victim before it died
    workers = {a["worker_id"] for a in checked.attempts[more[0]]}
    assert {a["worker_id"] for rid in more for a in checked.attempts[rid]} == {again["worker_id"]} == workers

    # the killed attempts: expired with their leases, retried by another runner, which succeeded
    for aid in held:
        [(rid, status)] = db_query(db, "SELECT rollout_id, status FROM attempts WHERE id = ?", (aid,))
        assert status == "lease_expired", (aid, status)
        [won] = [a for a in checked.attempts[rid] if a["status"] == "succeeded"]
        assert won["worker_id"] != victim["worker_id"] and won["number"] > 1

    # side effects: each rollout completed successfully once; other completions are only of
    # attempts that died with the killed actor (finished by the agent, never reported)
    lines = _lines(log)
    by_rollout: dict[str, list[str]] = defaultdict(list)
    for rid, aid, _ in lines:
        by_rollout[rid].append(aid)
    assert set(by_rollout) == set(ids + more)
    for rid, aids in by_rollout.items():
        [won] = [a["id"] for a in checked.attempts[rid] if a["status"] == "succeeded"]
        assert aids.count(won) == 1, (rid, aids)
        assert set(aids) - {won} <= set(held), (rid, aids)
    wait_until(lambda: _sandboxes_free() == SANDBOXES, 30, "the actors' sandbox slots to be freed")


# ---------------------------------------------------------------------------- program agents


def test_a_program_agent_on_ray(ray_cluster, store):
    """A Program (a tiny Python program per rollout, reward in its result file) runs in Ray
    actors as in a runner process: each rollout's reward is the one its program wrote."""
    from agentbolt.runner.ray_runners import RayRunners

    srv, _ = store
    code = "import os; open(os.environ['AGENTBOLT_RESULT_FILE'], 'w').write(str({n} / 10))"
    program = Program([sys.executable, "-c", code])
    with Client(srv.url) as client:
        ids = [r.id for r in client.enqueue([RolloutCreate(task=Task(data={"n": n})) for n in range(6)])]
        with RayRunners(replicas=2, num_cpus=0.5, concurrency=3) as runners:
            runners.start(program, srv.url)
            infos = runners.wait_ready(timeout=90)
            _wait_all(client, ids, 60)
        rollouts = [client.get_rollout(rid) for rid in ids]
        assert [r.reward for r in rollouts] == [n / 10 for n in range(6)]
        workers = {a.worker_id for rid in ids for a in client.list_attempts(rid)}
    assert workers <= {i["worker_id"] for i in infos}


# ---------------------------------------------------------------------------- Trainer


def test_trainer_runs_its_runners_as_ray_actors(ray_cluster, tmp_path):
    """``Trainer(..., ray=RayRunners(...))``: the embedded server, the runners as actors (the
    agent sent by name), the evaluation done by them, the actors freed afterwards."""
    import ray_agents

    from agentbolt.algorithms import Evaluate
    from agentbolt.runner.ray_runners import RayRunners
    from agentbolt.trainer import Trainer

    log = tmp_path / "done.log"
    runners = RayRunners(replicas=2, resources={"sandbox": 1}, runtime_env=ENV)
    trainer = Trainer(Evaluate(), ray=runners, run_dir=tmp_path / "run", lease_seconds=5)
    val = [{"i": i, "events": 1, "log": str(log)} for i in range(6)]
    summary = trainer.fit(ray_agents.counted, val_tasks=val)
    assert (summary.count, summary.succeeded, summary.mean_reward) == (6, 6, 1.0)
    assert len(_lines(log)) == 6 and os.getpid() not in {pid for *_, pid in _lines(log)}
    assert not runners.actors
    wait_until(lambda: _sandboxes_free() == SANDBOXES, 30, "the actors' sandbox slots to be freed")


def test_trainer_says_when_ray_cannot_place_its_runners(ray_cluster, tmp_path):
    import ray_agents

    from agentbolt.algorithms import Evaluate
    from agentbolt.runner.ray_runners import RayRunners
    from agentbolt.trainer import Trainer

    runners = RayRunners(replicas=2, resources={"sandbox": SANDBOXES + 1}, runtime_env=ENV)
    trainer = Trainer(Evaluate(), ray=runners, run_dir=tmp_path / "run", runner_start_timeout=3)
    with pytest.raises(ConfigError) as err:
        trainer.fit(ray_agents.counted, val_tasks=[{"i": 0}])
    assert "could not place 2 of 2 runner actor(s) within 3 s" in str(err.value)
    assert f"sandbox={SANDBOXES + 1:g}" in str(err.value) and "sandbox=4" in str(err.value)
    with pytest.raises(ConfigError, match="replicas"):
        Trainer(Evaluate(), ray=RayRunners(replicas=2), n_runners=3)


# ---------------------------------------------------------------------------- the CLI


def _cli(*args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "wb") if log else subprocess.PIPE  # noqa: SIM115 - closed by the test
    return subprocess.Popen(
        [sys.executable, "-m", "agentbolt", "runner", *args], stdout=out, stderr=subprocess.STDOUT
    )


@pytest.mark.parametrize(("stop_signal", "twice"), [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_cli_runner_on_ray_stops_gracefully(ray_cluster, store, tmp_path, stop_signal, twice):
    """``agentbolt runner --ray ADDRESS --replicas 2 ...`` joins the running cluster as a
    second driver. SIGINT or SIGTERM (which ray.init would take over) lets the running
    rollout finish (3 s, within the 10 s grace); a second signal releases a 60 s one at once.
    Either way the command exits 0 and the actors are freed."""
    srv, _ = store
    done, out = tmp_path / "done.log", tmp_path / "cli.log"
    agent = f"{HERE / 'ray_agents.py'}:counted"
    args = ["--ray", ray_cluster, "--replicas", "2", "--ray-cpus", "0.5", "--ray-resource", "sandbox=1"]
    args += ["--ray-memory", "64MiB", "--server", srv.url, "--agent", agent, "--concurrency", "2"]
    proc = _cli(*args, log=out)
    try:
        with Client(srv.url) as client:
            ready = "2 Ray runner actor(s) ready; each asks for CPU=0.5, memory=64MiB, sandbox=1"
            wait_until(lambda: ready in out.read_text() or proc.poll() is not None, 90, "the actors")
            assert ready in out.read_text(), out.read_text()[-3000:]
            ids = [r.id for r in client.enqueue(_tasks(done, 10))]
            _wait_all(client, ids, 90)
            assert _sandboxes_free() == SANDBOXES - 2
            [slow] = client.enqueue(_tasks(done, 1, events=1, sleep=60.0 if twice else 3.0))
            wait_until(lambda: client.list_attempts(slow.id), 30, "the slow rollout to start")
            proc.send_signal(stop_signal)
            if twice:
                time.sleep(1.0)
                proc.send_signal(stop_signal)
            started = time.monotonic()
            assert proc.wait(60) == 0, out.read_text()[-3000:]
            [attempt] = client.list_attempts(slow.id)
            if twice:  # released at once, back in the queue for another runner
                assert time.monotonic() - started < 9
                assert (attempt.status, client.get_rollout(slow.id).status) == ("released", "queued")
                assert "stopped: 10 completed, 0 failed, 0 lost, 1 abandoned" in out.read_text()
            else:  # finished within the grace
                assert (attempt.status, client.get_rollout(slow.id).status) == ("succeeded", "succeeded")
                assert "stopped: 11 completed, 0 failed, 0 lost, 0 abandoned" in out.read_text()
        assert "Traceback" not in out.read_text()
        wait_until(lambda: _sandboxes_free() == SANDBOXES, 30, "the CLI's actors to be freed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_cli_starts_a_local_cluster_and_exits_after_max_rollouts(store, tmp_path):
    """``--ray local`` starts a one-machine cluster inside the command (not the module's); the
    actor stops after ``--max-rollouts`` and the command exits by itself, the cluster with it."""
    srv, _ = store
    done = tmp_path / "done.log"
    with Client(srv.url) as client:
        ids = [r.id for r in client.enqueue(_tasks(done, 3, events=1))]
        agent = f"{HERE / 'ray_agents.py'}:counted"
        proc = _cli("--ray", "local", "--max-rollouts", "3", "--server", srv.url, "--agent", agent)
        out, _ = proc.communicate(timeout=120)
        text = out.decode()
        assert proc.returncode == 0, text[-3000:]
        assert "Started a local Ray instance" in text  # its own, not the module's cluster
        assert "1 Ray runner actor(s) ready; each asks for CPU=1\n" in text
        assert "stopped: 3 completed, 0 failed, 0 lost, 0 abandoned" in text
        assert [client.get_rollout(rid).status for rid in ids] == ["succeeded"] * 3
    assert len({pid for *_, pid in _lines(done)}) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray", "127.0.0.1:{port}"], "cannot reach the Ray cluster at 127.0.0.1:"),
        (["--replicas", "2"], "--replicas and the --ray-* options need --ray ADDRESS"),
        (["--ray", "local", "--ray-resource", "sandbox"], "must look like NAME=AMOUNT"),
        (["--ray", "local", "--ray-memory", "lots"], "must be a size above 0"),
    ],
)
def test_cli_ray_errors_are_one_line(args, message):
    args = [a.replace("{port}", str(free_port())) for a in args]
    proc = _cli(*args, "--agent", f"{HERE / 'ray_agents.py'}:counted")
    out, _ = proc.communicate(timeout=60)
    text = " ".join(out.decode().split())  # rich wraps long lines at the terminal's width
    assert proc.returncode == 1, text
    assert message in text and "Traceback" not in text, text


# ---------------------------------------------------------------------------- clear errors


def test_an_unplaceable_request_is_a_clear_error(ray_cluster, store):
    from agentbolt.runner.ray_runners import RayRunners

    srv, _ = store
    runners = RayRunners(
        replicas=1, resources={"sandbox": 9}, memory=1024**2, ready_timeout=3, runtime_env=ENV
    )
    runners.start("ray_agents:counted", srv.url)
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        runners.wait_ready()
    assert time.monotonic() - started < 15
    text = str(err.value)
    assert "could not place 1 of 1 runner actor(s) within 3 s" in text
    assert "each asks for CPU=1, memory=1MiB, sandbox=9" in text and "sandbox=4" in text
    assert not runners.actors  # killed: nothing left pending in the cluster


def test_actors_that_cannot_reach_the_server_are_a_clear_error(ray_cluster):
    from agentbolt.runner.ray_runners import RayRunners

    # 20 s: a worker process on a loaded 2-core machine can take more than 8 s to start
    runners = RayRunners(replicas=1, ready_timeout=20)
    runners.start(f"{HERE / 'ray_agents.py'}:counted", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError) as err:
        runners.wait_ready()
    assert "runner actor(s) 1 of 1 did not register with the server within 20 s" in str(err.value)
    assert not runners.actors


def test_an_agent_the_actors_cannot_import_is_a_clear_error(ray_cluster, store):
    from agentbolt.runner.ray_runners import RayRunners

    srv, _ = store
    runners = RayRunners(replicas=1)  # no runtime_env: tests/scale is not on the actor's path
    runners.start("ray_agents:counted", srv.url)
    with pytest.raises(ConfigError) as err:
        runners.wait_ready(timeout=60)
    assert "the agent could not be loaded in the Ray actor" in str(err.value)
    assert "No module named 'ray_agents'" in str(err.value)
    assert not runners.actors


def test_bad_settings_and_missing_ray(monkeypatch):
    from agentbolt.cli.ray import parse_memory
    from agentbolt.runner.ray_runners import RayRunners

    for bad, match in [
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"num_cpus": -1}, "num_cpus must be >= 0"),
        ({"resources": {"CPU": 2}}, "num_cpus / memory"),
        ({"resources": {"sandbox": -1}}, "must be a number >= 0"),
        ({"ready_timeout": 0}, "ready_timeout must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            RayRunners(**bad)
    assert parse_memory("2GiB") == 2 * 1024**3 and parse_memory("512MB") == 512 * 1000**2
    assert parse_memory("1000") == 1000
    with pytest.raises(ConfigError, match="does not exist"):
        RayRunners().start("no/such/file.py:agent", "http://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(MissingExtra, match=r"pip install 'agentbolt\[ray\]'"):
        RayRunners().start("ray_agents:counted", "http://127.0.0.1:1")
