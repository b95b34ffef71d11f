"""The asynchronous pool's eviction of stale groups, against a scripted client (no server)."""

from __future__ import annotations

import time
from typing import Any

from agentbolt.algorithms.async_grpo import GroupPool
from agentbolt.algorithms.grpo import GRPO
from agentbolt.schemas import Event, EventSource, Mode, Rollout, RolloutCreate, RolloutStatus, Task


class ScriptedClient:
    """Rollouts that stay queued until the test finishes them, and the llm_call events it records."""

    def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.events: dict[str, list[Event]] = {}
        self.cancelled: list[str] = []
        self.event_queries = 0

    def enqueue(self, items: list[RolloutCreate]) -> list[Rollout]:
        out = []
        for item in items:
            rid = f"r{len(self.rollouts)}"
            now = time.time()
            self.rollouts[rid] = Rollout(
                id=rid,
                task=item.task,
                mode=Mode.TRAIN,
                status=RolloutStatus.QUEUED,
                resources_version=item.resources_version,
                timeout_seconds=None,
                max_attempts=1,
                attempts=0,
                group_id=item.group_id,
                created_at=now,
                updated_at=now,
            )
            self.events[rid] = []
            out.append(self.rollouts[rid])
        return out

    def call(self, rid: str, version: int | None, attempt: str = "a1") -> None:
        data: dict[str, Any] = {} if version is None else {"model_version": version}
        n = len(self.events[rid])
        self.events[rid].append(
            Event(
                id=n,
                rollout_id=rid,
                attempt_id=attempt,
                sequence=n,
                type="llm_call",
                timestamp=0.0,
                data=data,
                source=EventSource.GATEWAY,
            )
        )

    def finish(self, rid: str, status: RolloutStatus = RolloutStatus.SUCCEEDED) -> None:
        self.rollouts[rid] = self.rollouts[rid].model_copy(update={"status": status, "reward": 1.0})

    def wait(self, ids: list[str], timeout: float = 0.0) -> Any:
        class Result:
            rollouts = [self.rollouts[i] for i in ids]

        return Result()

    def cancel(self, rid: str) -> Rollout:
        if self.rollouts[rid].status.is_final:
            raise RuntimeError("final already")
        self.cancelled.append(rid)
        self.finish(rid, RolloutStatus.CANCELLED)
        return self.rollouts[rid]

    def get_rollout(self, rid: str) -> Rollout:
        return self.rollouts[rid]

    def events_of(self, ids: list[str], type: Any = None) -> dict[str, list[Event]]:
        self.event_queries += 1
        return {i: list(self.events.get(i, [])) for i in ids}


def _pool(client: ScriptedClient, group_size: int = 4) -> GroupPool:
    tasks = [Task(id=f"t{i}", data={}) for i in range(8)]
    plan = GRPO(asynchronous=True).reward_plan()
    return GroupPool(client, tasks, plan=plan, group_size=group_size, group_prefix="run", seed=0)


def test_groups_enqueued_within_max_staleness_are_kept_without_reading_events() -> None:
    client = ScriptedClient()
    pool = _pool(client)
    pool.top_up(2, resources_version=1, policy_version=0)
    pool.top_up(3, resources_version=2, policy_version=1)
    # about to update the policy served as version 2: the version-0 groups lag 2, within 2
    assert pool.evict_stale([0, 1, 2], max_staleness=2) == (0, 0)
    assert client.event_queries == 0 and len(pool) == 3 and pool.evicted_groups == 0


def test_a_group_whose_members_are_all_stale_is_evicted_and_its_unfinished_members_cancelled() -> None:
    client = ScriptedClient()
    pool = _pool(client)
    pool.top_up(2, resources_version=1, policy_version=0)
    old, other = pool.groups
    for rid in old.ids:  # every member called version 0; two of them finished
        client.call(rid, 0)
    for rid in old.ids[:2]:
        client.finish(rid)
    pool.poll(timeout=0.0)  # the other group's members have not called the model: they may be fresh
    assert pool.evict_stale([0, 1, 2], max_staleness=1) == (1, 4)
    assert [g.index for g in pool.groups] == [other.index]
    assert sorted(client.cancelled) == sorted(old.ids[2:])
    assert (pool.evicted_groups, pool.evicted_samples) == (1, 4)
    # the pool tops up to its size again, at the current version
    assert pool.top_up(2, resources_version=3, policy_version=2) == 1
    assert pool.groups[-1].policy_version == 2


def test_a_group_keeps_its_place_while_enough_members_can_be_fresh() -> None:
    client = ScriptedClient()
    pool = _pool(client)
    pool.top_up(1, resources_version=1, policy_version=0)
    [g] = pool.groups
    a, b, c, d = g.ids
    client.call(a, 0)
    client.finish(a)  # stale
    client.call(b, 2)
    client.finish(b)  # started after the swaps: fresh
    client.call(c, 0)  # running, its first call stale
    client.call(d, 0, attempt="a1")
    client.call(d, 2, attempt="a2")  # retried: its latest attempt called version 2 only
    pool.poll(timeout=0.0)
    assert pool.evict_stale([0, 1, 2], max_staleness=1, min_group_size=2) == (0, 0)
    assert pool.evict_stale([0, 1, 2], max_staleness=1, min_group_size=3) == (1, 4)
    assert client.cancelled == [c, d] and len(pool) == 0


def test_failed_members_and_members_whose_calls_report_no_version_count_as_the_update_counts_them() -> None:
    client = ScriptedClient()
    pool = _pool(client, group_size=2)
    pool.top_up(1, resources_version=1, policy_version=0)
    [g] = pool.groups
    a, b = g.ids
    client.call(a, 2)
    client.finish(a, RolloutStatus.FAILED)  # fresh calls, but no sample
    client.call(b, None)  # a server that reports no versions: the group's enqueue version stands in
    pool.poll(timeout=0.0)
    assert pool.evict_stale([0, 1, 2], max_staleness=1, min_group_size=1) == (1, 2)
