"""Several server processes over one PostgreSQL schema, runners spread across them.

The invariant under test: no rollout is ever claimed twice. Checked three ways: while the run
goes, a watcher polls the database for a rollout with two running attempts; afterwards every
rollout has exactly one attempt (no crash, no expiry: nothing justified a second claim) and
exactly one succeeded attempt; and rollouts whose claims were abandoned on purpose (leases
left to lapse, so all replicas' sweepers race to requeue them) end with lapsed attempts only
from the abandoning workers, then one ``succeeded``.

Size: ``AGENTBOLT_REPLICA_ROLLOUTS`` (default 400) over 3 replicas x 2 runners x 4 slots.
"""

from __future__ import annotations

import httpx
import pytest
from scale_agents import chatty, check_events
from scale_support import DoubleClaimWatch, RunnerThread, audit, pg_schema, scaled, wait_until

from agentbolt.client import Client
from agentbolt.schemas import AttemptStatus, EventCreate, PromptTemplate, RolloutCreate, Task
from agentbolt.server import ServerConfig, ServerProcess
from agentbolt.server.run import start_together

pytestmark = pytest.mark.postgres

REPLICAS = 3


def test_replicas_never_claim_a_rollout_twice():
    n = scaled("AGENTBOLT_REPLICA_ROLLOUTS", 400)
    abandoned = 12
    with pg_schema() as db:
        servers = [
            ServerProcess(ServerConfig(db=db, lease_seconds=60, sweep_interval=0.2)) for _ in range(REPLICAS)
        ]
        runners: list[RunnerThread] = []
        try:
            start_together(servers, timeout=90)
            urls = [s.url for s in servers]
            with Client(urls[0], timeout=60) as client:
                items = [
                    RolloutCreate(task=Task(data={"i": i, "events": 2}), max_attempts=3) for i in range(n)
                ]
                ids = [r.id for start in range(0, n, 500) for r in client.enqueue(items[start : start + 500])]
            # Claims abandoned on purpose, from every replica: 1 s leases nobody renews.
            zombies = []
            for i in range(abandoned):
                claim = httpx.post(
                    f"{urls[i % REPLICAS]}/api/dequeue",
                    json={"worker_id": f"zombie-{i}", "lease_seconds": 1.0},
                    timeout=30,
                ).json()
                zombies.append(claim["rollout"]["id"])
            with DoubleClaimWatch(db) as watch:
                runners = [
                    RunnerThread(
                        chatty,
                        urls[i % REPLICAS],
                        concurrency=4,
                        lease_seconds=60,
                        worker_id=f"r{i}-on-{i % REPLICAS}",
                    ).start()
                    for i in range(2 * REPLICAS)
                ]
                with Client(urls[1], timeout=90) as client:
                    wait_until(
                        lambda: client.stats()["rollouts"]["succeeded"] == n,
                        240,
                        "every rollout to succeed",
                        every=0.5,
                    )
                for r in runners:
                    r.stop()
                runners = []
        finally:
            for r in runners:
                r.stop()
            for s in servers:
                s.stop()
        report = audit(db, ids, check_events)
    assert report.problems == [], report.problems[:10]
    assert report.status_counts() == {"succeeded": n}
    assert watch.polls > 5 and watch.seen == [], watch.seen[:5]
    for rid in ids:
        got = [(a["status"], a["worker_id"].startswith("zombie")) for a in report.attempts[rid]]
        if rid in zombies:
            # a requeued rollout goes back to the head of the queue: a later zombie may take it again
            *lapsed, last = got
            assert (
                lapsed and all(x == ("lease_expired", True) for x in lapsed) and last == ("succeeded", False)
            ), got
        else:
            assert got == [("succeeded", False)], (rid, got)
    workers = {a["worker_id"] for attempts in report.attempts.values() for a in attempts}
    for replica in range(REPLICAS):  # every replica served claims (the server suffixes the name it issues)
        assert any(f"-on-{replica}-" in w for w in workers), (replica, sorted(workers)[:10])


def test_replicas_share_resources_and_events():
    """What one replica writes, the others serve at once (no replica-local state in the way)."""
    with pg_schema() as db:
        servers = [ServerProcess(ServerConfig(db=db)) for _ in range(2)]
        try:
            start_together(servers, timeout=90)
            a, b = (Client(s.url) for s in servers)
            with a, b:
                v = a.publish_resources({"p": PromptTemplate(template="one")})
                assert b.latest_resources().version == v.version  # type: ignore[union-attr]
                [ro] = a.enqueue([RolloutCreate(task=Task(data={}))])
                claim = b.dequeue("w")
                assert (
                    claim is not None and claim.rollout.id == ro.id and claim.resources.version == v.version
                )
                assert a.dequeue("w2") is None  # already claimed through the other replica
                a.add_events(claim.attempt.id, [EventCreate(sequence=0, type="message", data={"x": 1})], "w")
                b.add_events(claim.attempt.id, [EventCreate(sequence=0, type="message", data={"x": 1})], "w")
                assert len(b.all_events(ro.id)) == 1  # the re-sent event was deduplicated across replicas
                a.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w")
                assert b.get_rollout(ro.id).status == "succeeded"
        finally:
            for s in servers:
                s.stop()
