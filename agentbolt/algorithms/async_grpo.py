"""The machinery of asynchronous GRPO: a pool of groups in flight, and the engine's idle clock.

:class:`GroupPool` keeps groups of rollouts enqueued (each at the resources version current when
it was enqueued), watches them become final, settles their rewards per group (automatic
evaluators run once a group's members are all final; named rewards still pending are awaited up
to ``reward_wait`` seconds from then), and hands out complete groups in the order they
completed. A group whose oldest member has waited more than ``group_timeout`` seconds has its
unfinished members cancelled (it then completes, and is dropped later if too few members are
left), so an update never hangs on one slow runner. :meth:`GroupPool.cancel_all` leaves no
rollout of the pool queued or running.

:meth:`GroupPool.evict_stale`, called as the policy advances, removes the groups that can no
longer give an update ``min_group_size`` samples within ``max_staleness`` versions of it (their
unfinished members cancelled), so a stale group neither takes an update's place (to be dropped
there, leaving the update fewer samples) nor keeps the engine generating for nothing; the pool's
next top-up replaces them with groups at the current version.

:class:`EngineIdleClock` samples the embedded engine's running sequences in a thread: the
seconds during which the engine had none (its :meth:`~agentbolt.engine.ModelEngine.stats` has
no busy-time counter; the sampling period bounds the error).
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from agentbolt.adapters import latest_attempt
from agentbolt.algorithms.base import BatchResult
from agentbolt.algorithms.importance import behaviour_version
from agentbolt.algorithms.rewards import RewardPlan, tally
from agentbolt.client import Client
from agentbolt.schemas import Mode, Rollout, RolloutCreate, RolloutStatus, Task

if TYPE_CHECKING:
    from agentbolt.evaluators import EvaluationReport

__all__ = ["EngineIdleClock", "GroupPool", "InFlightGroup", "batch_of", "task_for", "version_lag"]

POLL_SECONDS = 0.25


def task_for(tasks: Sequence[Task], index: int, seed: int) -> Task:
    """The task of the ``index``-th group of a run: every task once per epoch, in an order
    shuffled per epoch from ``seed`` (so a resumed run, given its count, draws the same)."""
    epoch, at = divmod(index, len(tasks))
    order = random.Random(seed * 100_003 + epoch).sample(range(len(tasks)), len(tasks))
    return tasks[order[at]]


@dataclass
class InFlightGroup:
    index: int
    group_id: str
    task: Task
    ids: list[str]
    resources_version: int
    policy_version: int
    """The engine's model version when the group was enqueued (the fallback behaviour version
    of a member whose calls reported none)."""
    enqueued_at: float
    final: dict[str, Rollout] = field(default_factory=dict)
    timed_out: int = 0
    settled_at: float | None = None
    """When its members were all final and the evaluators here had scored them."""
    completed_at: float | None = None
    report: EvaluationReport | None = None

    @property
    def rollouts(self) -> list[Rollout]:
        return [self.final[rid] for rid in self.ids if rid in self.final]

    @property
    def all_final(self) -> bool:
        return len(self.final) == len(self.ids)


def version_lag(synced: Sequence[int], version: int) -> int:
    """How many policy versions behind ``version`` is: the versions in ``synced`` (those served
    so far, in order) after it."""
    return len(synced) - bisect.bisect_right(synced, version)


def batch_of(groups: Sequence[InFlightGroup], plan: RewardPlan) -> BatchResult:
    """The taken groups' rollouts as one batch, with what the evaluators here did for them."""
    reports = [g.report for g in groups if g.report is not None]
    report = reports[0] if reports else None
    for more in reports[1:]:
        report = report + more if report is not None else more
    rollouts = [r for g in groups for r in g.rollouts]
    return BatchResult(rollouts, sum(g.timed_out for g in groups), plan.choice, report)


class GroupPool:
    def __init__(
        self,
        client: Client,
        tasks: Sequence[Task],
        *,
        plan: RewardPlan,
        group_size: int,
        group_prefix: str,
        seed: int,
        next_index: int = 0,
        group_timeout: float = 600.0,
        rollout_timeout: float | None = None,
        max_attempts: int = 3,
        console: Console | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.client, self.tasks, self.plan = client, list(tasks), plan
        self.group_size, self.group_prefix, self.seed = group_size, group_prefix, seed
        self.next_index = next_index
        self.group_timeout, self.rollout_timeout, self.max_attempts = (
            group_timeout,
            rollout_timeout,
            max_attempts,
        )
        self.console, self.progress = console, progress
        self.groups: list[InFlightGroup] = []
        self.evicted_groups = self.evicted_samples = 0
        """Groups evicted as too stale so far, and their members."""
        # the evaluators run with no wait of their own: the pool awaits pending rewards itself
        self._score = RewardPlan(plan.choice, plan.evaluators, 0.0)

    def __len__(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ enqueue

    def top_up(self, target: int, resources_version: int, policy_version: int) -> int:
        """Enqueue groups until ``target`` are in the pool; returns how many were enqueued."""
        missing = max(0, target - len(self.groups))
        if not missing or not self.tasks:
            return 0
        awaited = self.plan.awaited()
        new: list[tuple[int, Task, str]] = []
        items: list[RolloutCreate] = []
        for _ in range(missing):
            index = self.next_index
            self.next_index += 1
            task = task_for(self.tasks, index, self.seed)
            group_id = f"{self.group_prefix}:g{index}:{task.id}"
            new.append((index, task, group_id))
            items += [
                RolloutCreate(
                    task=task,
                    mode=Mode.TRAIN,
                    resources_version=resources_version,
                    timeout_seconds=self.rollout_timeout,
                    max_attempts=self.max_attempts,
                    group_id=group_id,
                    await_rewards=awaited,
                )
                for _ in range(self.group_size)
            ]
        ids = [r.id for r in self.client.enqueue(items)]
        now = time.monotonic()
        for k, (index, task, group_id) in enumerate(new):
            members = ids[k * self.group_size : (k + 1) * self.group_size]
            self.groups.append(
                InFlightGroup(index, group_id, task, members, resources_version, policy_version, now)
            )
        return missing

    # ------------------------------------------------------------------ watching

    def poll(self, timeout: float = POLL_SECONDS) -> None:
        """Read the members not yet final (a long poll of up to ``timeout``), cancel those of
        overdue groups, settle the rewards of groups that became final."""
        waiting = [rid for g in self.groups for rid in g.ids if rid not in g.final]
        if waiting:
            result = self.client.wait(waiting[:2000], timeout=timeout)
            by_id = {r.id: r for r in result.rollouts if r.status.is_final}
            for g in self.groups:
                for rid in g.ids:
                    if rid in by_id and rid not in g.final:
                        g.final[rid] = by_id[rid]
        else:
            time.sleep(timeout)  # only rewards are awaited: nothing to long-poll on
        now = time.monotonic()
        for g in self.groups:
            if not g.all_final and now - g.enqueued_at > self.group_timeout:
                self._cancel_rest(g)
        for g in self.groups:
            if g.all_final and g.completed_at is None:
                self._settle(g, now)

    def _cancel_rest(self, group: InFlightGroup) -> None:
        for rid in group.ids:
            if rid in group.final:
                continue
            try:
                group.final[rid] = self.client.cancel(rid)
                group.timed_out += 1
            except Exception:  # finished in the meantime
                group.final[rid] = self.client.get_rollout(rid)

    def _settle(self, group: InFlightGroup, now: float) -> None:
        if self.plan.is_agent_only:
            group.settled_at = group.completed_at = now
            return
        if group.settled_at is None:
            settled, report = self._score.settle(self.client, group.rollouts, self.console, self.progress)
            group.final = {r.id: r for r in settled}
            group.report, group.settled_at = report, time.monotonic()
        elif tally(group.rollouts, self.plan.choice).pending:
            fresh = self.client.wait(group.ids, timeout=0.1).rollouts
            group.final.update({r.id: r for r in fresh})
        pending = tally(group.rollouts, self.plan.choice).pending
        if not pending or time.monotonic() - group.settled_at >= self.plan.wait:
            group.completed_at = time.monotonic()

    # ------------------------------------------------------------------ handing out

    @property
    def complete(self) -> list[InFlightGroup]:
        """Complete groups, in the order they completed (enqueue order among equals)."""
        done = [g for g in self.groups if g.completed_at is not None]
        return sorted(done, key=lambda g: (g.completed_at or 0.0, g.index))

    def wait_for(self, n: int, on_poll: Callable[[], None] | None = None) -> float:
        """Poll until ``n`` groups are complete (or every group in the pool is); the seconds waited."""
        started = time.monotonic()
        while len(self.complete) < min(n, len(self.groups)):
            self.poll()
            if on_poll is not None:
                on_poll()
        return time.monotonic() - started

    def take(self, n: int) -> list[InFlightGroup]:
        """The first ``n`` complete groups, out of the pool."""
        taken = self.complete[:n]
        gone = {g.index for g in taken}
        self.groups = [g for g in self.groups if g.index not in gone]
        return taken

    # ------------------------------------------------------------------ staleness

    def evict_stale(
        self, synced: Sequence[int], max_staleness: int, min_group_size: int = 2
    ) -> tuple[int, int]:
        """Evict the groups that can no longer give ``min_group_size`` samples at most
        ``max_staleness`` versions behind the policy about to be updated (the last of ``synced``,
        the policy versions served so far, in order); returns the groups and members evicted.

        A sample's lag is counted as the update counts it: the number of versions in ``synced``
        after its behaviour version, the oldest engine version among the calls of its latest
        attempt (the group's version at enqueue time when they reported none). A group enqueued
        within ``max_staleness`` versions is kept without looking further: no member can be
        older than its enqueue version. Otherwise each member's calls recorded so far are read:
        a member that failed gives no sample; one that succeeded is stale by its behaviour version; an unfinished one once a call it has
        made is stale (its oldest version can only get older, relative to the policy); one that
        has made no call yet may still be fresh. The evicted groups' unfinished members are
        cancelled."""

        suspects = [g for g in self.groups if version_lag(synced, g.policy_version) > max_staleness]
        if not suspects:
            return 0, 0
        events = self.client.events_of([rid for g in suspects for rid in g.ids], type=["llm_call"])
        doomed: list[InFlightGroup] = []
        for g in suspects:
            usable = 0
            for rid in g.ids:
                attempt = latest_attempt(events.get(rid, []))
                seen = behaviour_version(attempt)
                if rid in g.final and g.final[rid].status != RolloutStatus.SUCCEEDED:
                    continue  # failed or cancelled: no sample
                if rid in g.final or any(e.type == "llm_call" for e in attempt):
                    behaviour = seen if seen is not None else g.policy_version
                    usable += version_lag(synced, behaviour) <= max_staleness
                else:
                    usable += 1  # no call yet: its calls may all come from a fresh enough policy
            if usable < min_group_size:
                doomed.append(g)
        for g in doomed:
            self._cancel_rest(g)
        gone = {g.index for g in doomed}
        self.groups = [g for g in self.groups if g.index not in gone]
        samples = sum(len(g.ids) for g in doomed)
        self.evicted_groups += len(doomed)
        self.evicted_samples += samples
        return len(doomed), samples

    def cancel_all(self) -> int:
        """Cancel every member of the pool not yet final; returns how many were cancelled."""
        cancelled = 0
        for g in self.groups:
            for rid in g.ids:
                if rid in g.final:
                    continue
                try:
                    self.client.cancel(rid)
                    cancelled += 1
                except Exception:  # final already
                    pass
        self.groups = []
        return cancelled

    def stats(self) -> dict[str, Any]:
        running = sum(1 for g in self.groups for rid in g.ids if rid not in g.final)
        return {"groups": len(self.groups), "unfinished": running}


class EngineIdleClock:
    """Seconds the embedded engine had no running sequence, sampled every ``period`` seconds."""

    def __init__(self, running: Callable[[], int], period: float = 0.02) -> None:
        self._running, self.period = running, period
        self._idle = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-idle-clock", daemon=True)

    def __enter__(self) -> EngineIdleClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    @property
    def idle_seconds(self) -> float:
        with self._lock:
            return self._idle

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            try:
                idle = self._running() == 0
            except Exception:  # the engine is closing
                idle = False
            if idle:
                with self._lock:
                    self._idle += now - last
            last = now
