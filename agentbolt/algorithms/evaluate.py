"""Evaluate: run the agent on tasks with the current resources and summarise. No training."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rich.table import Table

from agentbolt.algorithms.base import (
    DEFAULT_MAX_ATTEMPTS,
    Algorithm,
    BatchResult,
    TrainContext,
    run_sampled_and_greedy,
)
from agentbolt.algorithms.claims import fetch_claim_counts
from agentbolt.algorithms.rewards import RewardOptions
from agentbolt.schemas import Mode

__all__ = ["EvalSummary", "Evaluate", "summary_table"]


@dataclass(frozen=True)
class EvalSummary:
    count: int
    succeeded: int
    failed: int
    mean_reward: float | None
    timed_out: int
    resources_version: int | None
    greedy: EvalSummary | None = None
    """The same tasks at temperature 0 (``Evaluate(greedy=True)``); its ``resources_version`` is
    the trial version that made the LLM greedy."""
    reward_pending: int = 0
    """Succeeded rollouts whose chosen reward was still pending (left out of ``mean_reward``)."""
    reward_errors: int = 0
    """Succeeded rollouts whose chosen reward could not be given (left out too)."""
    claims: int = 0
    """Succeeded rollouts where a program claimed a reward that was not used (a scorer decided)."""
    claims_disputed: int = 0
    """Of those, the ones whose claim disagrees with the reward given: a reward-hacking signal."""

    @staticmethod
    def of(batch: BatchResult, claims: dict[str, int] | None = None) -> EvalSummary:
        versions = {r.resources_version for r in batch.rollouts if r.resources_version is not None}
        return EvalSummary(
            count=len(batch.rollouts),
            succeeded=len(batch.succeeded),
            failed=len(batch.failed),
            mean_reward=batch.mean_reward,
            timed_out=batch.timed_out,
            resources_version=max(versions) if versions else None,
            reward_pending=batch.reward_pending,
            reward_errors=batch.reward_errors,
            claims=(claims or {}).get("claims", 0),
            claims_disputed=(claims or {}).get("claims_disputed", 0),
        )


def summary_table(rows: dict[str, EvalSummary], title: str = "evaluation") -> Table:
    """One row per set (and its greedy twin); pending and error counts when any reward was
    left out."""
    shown: list[tuple[str, EvalSummary]] = []
    for name, s in rows.items():
        shown += [(name, s), *([(f"{name} (greedy)", s.greedy)] if s.greedy else [])]
    unscored = any(s.reward_pending or s.reward_errors for _, s in shown)
    claimed = any(s.claims for _, s in shown)
    counts = ("pending", "errors") if unscored else ()
    columns = ("set", "count", "succeeded", "failed", "mean reward", *counts)
    columns += ("claims disputed",) * claimed + ("resources",)
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "set" else "right")
    for name, s in shown:
        reward = f"{s.mean_reward:.3f}" if s.mean_reward is not None else "-"
        version = str(s.resources_version) if s.resources_version is not None else "-"
        left_out = (str(s.reward_pending), str(s.reward_errors)) if unscored else ()
        disputed = (f"{s.claims_disputed}/{s.claims}",) if claimed else ()
        cells = (str(s.count), str(s.succeeded), str(s.failed), reward, *left_out, *disputed, version)
        table.add_row(name, *cells)
    return table


@dataclass
class Evaluate(RewardOptions, Algorithm):
    """Run every validation task (or, without any, every training task) once and report."""

    timeout: float = 600.0
    """Seconds to wait for the whole batch; stragglers are cancelled and counted."""
    rollout_timeout: float | None = None
    """Seconds one attempt may take before the server ends it."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts per rollout: infrastructure failures are retried, an agent that raises is not."""
    greedy: bool = False
    """Run every task a second time at temperature 0 (a trial resources version, never the
    latest) and report both: sampled success says what training sees, greedy what a
    deterministic deployment gets."""

    def run(self, ctx: TrainContext) -> EvalSummary:
        tasks, mode = (ctx.val_tasks, Mode.VAL) if ctx.val_tasks else (ctx.train_tasks, Mode.TRAIN)
        batch, greedy = run_sampled_and_greedy(
            ctx.client,
            tasks,
            mode=mode,
            resources_version=None,
            greedy=self.greedy,
            timeout=self.timeout,
            rollout_timeout=self.rollout_timeout,
            max_attempts=self.max_attempts,
            console=ctx.console,
            label="evaluating",
            rewards=self.reward_plan(),
        )
        summary = EvalSummary.of(batch, fetch_claim_counts(ctx.client, batch.rollouts))
        if greedy is not None:
            summary = replace(
                summary, greedy=EvalSummary.of(greedy, fetch_claim_counts(ctx.client, greedy.rollouts))
            )
        ctx.console.print(summary_table({mode.value: summary}))
        return summary
