"""What every algorithm shares: the context the Trainer hands it, running a batch of rollouts
to completion with a progress bar and a bound on waiting, a validation pass at a version, and
the line a trainer prints for the model calls it skipped for lack of token ids."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from agentbolt.algorithms.rewards import AGENT, RewardChoice, RewardPlan, resolve, tally
from agentbolt.client import Client
from agentbolt.console import task_bars
from agentbolt.schemas import LLM, Mode, Rollout, RolloutCreate, RolloutStatus, Task

if TYPE_CHECKING:
    from agentbolt.evaluators import EvaluationReport

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "Algorithm",
    "BatchResult",
    "TrainContext",
    "Validation",
    "greedy_version",
    "no_ids_note",
    "run_rollouts",
    "run_sampled_and_greedy",
    "validate",
]

DEFAULT_MAX_ATTEMPTS = 3
"""Attempts per rollout unless the user says otherwise. The store retries only infrastructure
failures (a lost lease, a dead runner, a released attempt); an agent that raises fails its rollout
at once, so a retry never turns a bad run into a good one."""


def no_ids_note(skipped: int) -> str:
    """What GRPO and SFT print when calls had no token ids: nothing of them was trained on."""
    calls = "llm call" if skipped == 1 else "llm calls"
    return (
        f"{skipped} {calls} skipped for lack of token ids (recorded text-only: the model server "
        "returned none; see docs/deployment.md)"
    )


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
    reward: RewardChoice = AGENT
    """The reward the batch is judged by (:mod:`agentbolt.algorithms.rewards`)."""
    evaluation: EvaluationReport | None = None
    """What the evaluators run in this process did (scores, errors, judge calls and tokens);
    None when none ran. Batches enqueued together (sampled and greedy) share one."""

    def evaluation_metrics(self) -> dict[str, float]:
        """``judge_calls``, ``judge_tokens``, ``judge_cached`` and ``t_judge`` when evaluators ran here."""
        e = self.evaluation
        if e is None:
            return {}
        return {
            "judge_calls": e.calls,
            "judge_tokens": e.tokens,
            "judge_cached": e.cached,
            "t_judge": e.seconds,
        }

    @property
    def succeeded(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.status == RolloutStatus.SUCCEEDED]

    @property
    def failed(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.status != RolloutStatus.SUCCEEDED]

    @property
    def scored(self) -> list[Rollout]:
        """Succeeded rollouts whose chosen reward has a value (not pending, not an error)."""
        return [r for r in self.succeeded if resolve(r, self.reward).ok]

    def value(self, rollout: Rollout) -> float | None:
        """``rollout``'s chosen reward; None when it has none (yet)."""
        return resolve(rollout, self.reward).value

    @property
    def values(self) -> list[float]:
        """The chosen reward of every scored rollout, in order."""
        return [v for r in self.succeeded if (v := self.value(r)) is not None]

    @property
    def mean_reward(self) -> float | None:
        values = self.values
        return sum(values) / len(values) if values else None

    @property
    def reward_pending(self) -> int:
        """Succeeded rollouts whose chosen reward is still pending (left out, never a zero)."""
        return tally(self.rollouts, self.reward).pending

    @property
    def reward_errors(self) -> int:
        """Succeeded rollouts whose evaluator could not give the chosen reward (left out)."""
        return tally(self.rollouts, self.reward).errors


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
    rewards: RewardPlan | None = None,
) -> BatchResult:
    """Enqueue each task ``repeat`` times and wait until all are final or ``timeout`` passes.

    With ``group_prefix`` the copies of one task share ``group_id = f"{prefix}:{task.id}"``
    (a GRPO group). Stragglers still running at the deadline are cancelled, so a step can
    never hang on one slow runner. ``Rollout.attempts`` of the result tells which rollouts were
    retried. With ``rewards`` the rollouts await its named rewards, its automatic evaluators
    score them once final, and the result holds them as they stood after its wait.
    """
    plan = rewards or RewardPlan()
    awaited = plan.awaited()
    items = [
        RolloutCreate(
            task=task,
            mode=mode,
            resources_version=resources_version,
            timeout_seconds=rollout_timeout,
            max_attempts=max_attempts,
            group_id=f"{group_prefix}:{task.id}" if group_prefix else None,
            metadata=metadata or {},
            await_rewards=awaited,
        )
        for task in tasks
        for _ in range(repeat)
    ]
    return _run_items(
        client, items, timeout=timeout, console=console, label=label, progress=progress, rewards=plan
    )[0]


def _run_items(
    client: Client,
    *batches: list[RolloutCreate],
    timeout: float,
    console: Console | None,
    label: str,
    progress: Progress | None,
    rewards: RewardPlan,
) -> list[BatchResult]:
    """Enqueue every batch at once, wait for all with one bar, cancel the stragglers, settle
    their rewards (:meth:`RewardPlan.settle`); one result per batch, in order."""
    items = [item for batch in batches for item in batch]
    ids = [r.id for r in client.enqueue(items)] if items else []
    final = _wait_all(client, ids, timeout, console, label, progress)
    pending = [rid for rid in ids if rid not in final]
    for rid in pending:
        try:
            final[rid] = client.cancel(rid)
        except Exception:  # finished in the meantime
            final[rid] = client.get_rollout(rid)
    settled, report = rewards.settle(client, [final[rid] for rid in ids], console, progress)
    final = {r.id: r for r in settled}
    out, at = [], 0
    for batch in batches:
        batch_ids = ids[at : at + len(batch)]
        at += len(batch)
        timed_out = sum(1 for rid in batch_ids if rid in pending)
        out.append(BatchResult([final[rid] for rid in batch_ids], timed_out, rewards.choice, report))
    return out


def greedy_version(client: Client, version: int | None, metadata: dict[str, Any] | None = None) -> int | None:
    """A trial resources version (never the latest) with ``version``'s resources (the latest
    when None) and every LLM resource's sampling temperature 0: greedy decoding. None when there
    are no resources or no LLM resource among them.

    Only agents that pass their LLM resource's ``sampling_parameters`` to the model (as the
    built-in tasks do) decode greedily under it; one that sets its own temperature does not."""
    base = client.get_resources(version) if version is not None else client.latest_resources()
    if base is None or not any(isinstance(r, LLM) for r in base.resources.values()):
        return None
    resources = {
        name: r.model_copy(update={"sampling_parameters": {**r.sampling_parameters, "temperature": 0.0}})
        if isinstance(r, LLM)
        else r
        for name, r in base.resources.items()
    }
    # not the base's metadata: its step and metrics would show up twice on the training page
    meta = {"stage": "greedy", "of": base.version, **(metadata or {})}
    return client.publish_resources(resources, meta, trial=True).version


def run_sampled_and_greedy(
    client: Client,
    tasks: Sequence[Task],
    *,
    mode: Mode,
    resources_version: int | None,
    greedy: bool = True,
    timeout: float = 600.0,
    rollout_timeout: float | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    console: Console | None = None,
    label: str = "rollouts",
    progress: Progress | None = None,
    rewards: RewardPlan | None = None,
    metadata: dict[str, Any] | None = None,
) -> tuple[BatchResult, BatchResult | None]:
    """Every task once with ``resources_version`` as published (sampled) and, with ``greedy``,
    once more at temperature 0 (:func:`greedy_version`), both enqueued together. The greedy
    result is None when not asked for or when there is no LLM resource to make greedy.
    ``rewards`` as for :func:`run_rollouts`; ``metadata`` goes on every rollout, beside
    ``decoding`` (sampled or greedy)."""
    plan = rewards or RewardPlan()
    awaited = plan.awaited()
    greedy_at = greedy_version(client, resources_version) if greedy and tasks else None

    def items(version: int | None, kind: str) -> list[RolloutCreate]:
        return [
            RolloutCreate(
                task=task,
                mode=mode,
                resources_version=version,
                timeout_seconds=rollout_timeout,
                max_attempts=max_attempts,
                metadata={**(metadata or {}), "decoding": kind},
                await_rewards=awaited,
            )
            for task in tasks
        ]

    batches = [items(resources_version, "sampled")]
    if greedy_at is not None:
        batches.append(items(greedy_at, "greedy"))
    results = _run_items(
        client, *batches, timeout=timeout, console=console, label=label, progress=progress, rewards=plan
    )
    return results[0], (results[1] if greedy_at is not None else None)


@dataclass(frozen=True)
class Validation:
    sampled: BatchResult
    """The validation tasks with the published sampling parameters."""
    greedy: BatchResult | None
    """The same tasks at temperature 0; None when not asked for (or no LLM resource)."""


def validate(
    ctx: TrainContext,
    version: int | None,
    *,
    timeout: float,
    rollout_timeout: float | None,
    greedy: bool = True,
    label: str = "validation",
    progress: Progress | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    rewards: RewardPlan | None = None,
) -> Validation | None:
    """Run every validation task once with resources ``version`` and, with ``greedy``, once more at
    temperature 0 (both at once); None without validation tasks. ``rewards``: the reward the
    runs are judged by, as in training. Each rollout's metadata names the run
    (``{"run": <run folder name>}``), so a resumed run can cancel those it left unfinished."""
    if not ctx.val_tasks:
        return None
    sampled, greedy_batch = run_sampled_and_greedy(
        ctx.client,
        ctx.val_tasks,
        mode=Mode.VAL,
        resources_version=version,
        greedy=greedy,
        timeout=timeout,
        rollout_timeout=rollout_timeout,
        max_attempts=max_attempts,
        console=ctx.console,
        label=label,
        progress=progress,
        rewards=rewards,
        metadata={"run": ctx.run_dir.name},
    )
    return Validation(sampled, greedy_batch)


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
    progress = shared or task_bars(console)
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
