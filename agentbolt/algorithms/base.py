"""What every algorithm shares: the context the Trainer hands it, running a batch of rollouts
to completion with a progress bar and a bound on waiting, and a validation pass at a version."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentbolt.client import Client
from agentbolt.schemas import Mode, Rollout, RolloutCreate, RolloutStatus, Task

__all__ = ["DEFAULT_MAX_ATTEMPTS", "Algorithm", "BatchResult", "TrainContext", "run_rollouts", "validate"]

DEFAULT_MAX_ATTEMPTS = 3
"""Attempts per rollout unless the user says otherwise. The store retries only infrastructure
failures (a lost lease, a dead runner, a released attempt); an agent that raises fails its rollout
at once, so a retry never turns a bad run into a good one."""


@dataclass
class TrainContext:
    """What an algorithm gets from the Trainer. Algorithms talk to the store only through ``client``."""

    client: Client
    server_url: str
    train_tasks: list[Task]
    val_tasks: list[Task]
    run_dir: Path
    console: Console = field(default_factory=Console)
    token: str | None = None


class Algorithm(abc.ABC):
    @abc.abstractmethod
    def run(self, ctx: TrainContext) -> Any:
        """Do the work; return the result ``Trainer.fit`` gives back."""


@dataclass(frozen=True)
class BatchResult:
    rollouts: list[Rollout]
    timed_out: int
    """Rollouts still not final when the wait ended (they were cancelled)."""

    @property
    def succeeded(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.status == RolloutStatus.SUCCEEDED]

    @property
    def failed(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.status != RolloutStatus.SUCCEEDED]

    @property
    def mean_reward(self) -> float | None:
        rewards = [r.reward for r in self.succeeded if r.reward is not None]
        return sum(rewards) / len(rewards) if rewards else None


def run_rollouts(
    client: Client,
    tasks: Sequence[Task],
    *,
    mode: Mode = Mode.TRAIN,
    resources_version: int | None = None,
    repeat: int = 1,
    group_prefix: str | None = None,
    timeout: float = 600.0,
    rollout_timeout: float | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    console: Console | None = None,
    label: str = "rollouts",
    metadata: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> BatchResult:
    """Enqueue each task ``repeat`` times and wait until all are final or ``timeout`` passes.

    With ``group_prefix`` the copies of one task share ``group_id = f"{prefix}:{task.id}"``
    (a GRPO group). Stragglers still running at the deadline are cancelled, so a step can
    never hang on one slow runner. ``Rollout.attempts`` of the result tells which rollouts were
    retried.
    """
    items = [
        RolloutCreate(
            task=task,
            mode=mode,
            resources_version=resources_version,
            timeout_seconds=rollout_timeout,
            max_attempts=max_attempts,
            group_id=f"{group_prefix}:{task.id}" if group_prefix else None,
            metadata=metadata or {},
        )
        for task in tasks
        for _ in range(repeat)
    ]
    ids = [r.id for r in client.enqueue(items)] if items else []
    final = _wait_all(client, ids, timeout, console, label, progress)
    pending = [rid for rid in ids if rid not in final]
    for rid in pending:
        try:
            final[rid] = client.cancel(rid)
        except Exception:  # finished in the meantime
            final[rid] = client.get_rollout(rid)
    return BatchResult(rollouts=[final[rid] for rid in ids], timed_out=len(pending))


def validate(
    ctx: TrainContext,
    version: int | None,
    *,
    timeout: float,
    rollout_timeout: float | None,
    label: str = "validation",
    progress: Progress | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> BatchResult | None:
    """Run every validation task once with resources ``version``; None without validation tasks."""
    if not ctx.val_tasks:
        return None
    return run_rollouts(
        ctx.client,
        ctx.val_tasks,
        mode=Mode.VAL,
        resources_version=version,
        timeout=timeout,
        rollout_timeout=rollout_timeout,
        max_attempts=max_attempts,
        console=ctx.console,
        label=label,
        progress=progress,
    )


def _wait_all(
    client: Client,
    ids: list[str],
    timeout: float,
    console: Console | None,
    label: str,
    shared: Progress | None = None,
) -> dict[str, Rollout]:
    """Wait for ``ids``; shows a bar on ``shared`` (a display the caller runs) or its own."""
    final: dict[str, Rollout] = {}
    deadline = time.monotonic() + timeout
    progress = shared or Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console or Console(),
        transient=True,
        disable=console is None,
    )
    with contextlib.nullcontext() if shared else progress:
        bar = progress.add_task(label, total=len(ids), info="")
        while len(final) < len(ids) and time.monotonic() < deadline:
            waiting = [rid for rid in ids if rid not in final]
            result = client.wait(waiting[:2000], timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            for rollout in result.rollouts:
                if rollout.status.is_final:
                    final[rollout.id] = rollout
            ok = sum(1 for r in final.values() if r.status == RolloutStatus.SUCCEEDED)
            progress.update(bar, completed=len(final), info=f"{ok} ok, {len(final) - ok} failed")
        if shared:
            progress.remove_task(bar)
    return final
