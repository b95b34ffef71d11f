"""GRPO: reinforcement learning on the policy's weights from the agent's own runs.

One synchronous step (``asynchronous=False``): enqueue every sampled training task ``group_size``
times (a group), wait for the group with a bound (stragglers are cancelled; groups with fewer
than ``min_group_size`` finished samples are dropped), turn each rollout's ``llm_call`` events
into token rows with the gateway's exact ids and masks (:mod:`agentbolt.adapters`), compute
group-normalised advantages, take one clipped policy-gradient update on model-generated tokens
only (:mod:`agentbolt.algorithms.losses`), push the new weights into the serving engine in place
and publish them as a new resources version. The default, asynchronous mode, keeps more groups in
flight than one update takes and trains on the first complete ones while the rest keep running
(:mod:`agentbolt.algorithms.async_grpo`, docs/training.md). Validation and checkpoints every K
steps; ``resume`` continues from the last checkpoint exactly (weights, optimizer, RNG, step,
history).

Departures from the paper are listed in :mod:`agentbolt.algorithms.losses`. Here: one update per
batch (synchronous mode is fully on-policy, so the ratio starts at 1 and clipping guards numeric
drift between the engine's bf16 sampling pass and the training pass), and the engine's weights
are the merged LoRA weights (serving never pays for the adapter). Asynchronous mode takes the
ratio against the current policy and corrects for the older behaviour policy with truncated
importance weights (:mod:`agentbolt.algorithms.importance`).

The KL penalty (``kl_coef``) is to the initial weights: with LoRA the same model with its adapter
disabled, with full fine-tuning a frozen copy of the initial model kept on the training device
beside the trained one, so full fine-tuning with KL holds the weights twice (plus the optimizer's
two moments of the trained copy). Validation runs every task sampled (the published sampling
parameters) and greedy (temperature 0, ``val_greedy``).

This module is the loop. Its parts: the settings (:mod:`~agentbolt.algorithms.grpo_config`),
the rows a step trains on (:mod:`~agentbolt.algorithms.grpo_rows`), the update
(:mod:`~agentbolt.algorithms.grpo_update`), checkpoints and resuming
(:mod:`~agentbolt.algorithms.grpo_checkpoint`), the live table
(:mod:`~agentbolt.algorithms.grpo_table`) and the collapse watch
(:mod:`~agentbolt.algorithms.collapse`).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.live import Live
from rich.progress import Progress

from agentbolt.algorithms import distributed, grpo_checkpoint
from agentbolt.algorithms.async_grpo import EngineIdleClock, GroupPool, InFlightGroup, batch_of
from agentbolt.algorithms.base import Algorithm, BatchResult, TrainContext, run_rollouts, validate
from agentbolt.algorithms.batch import TrainRow
from agentbolt.algorithms.collapse import CollapseWatch
from agentbolt.algorithms.grpo_config import GRPOConfig
from agentbolt.algorithms.grpo_rows import StepRows, fresh_rows, reward_stats, step_rows, success_rate
from agentbolt.algorithms.grpo_table import StepRecord, columns
from agentbolt.algorithms.grpo_update import build_train_state, training_device, update
from agentbolt.algorithms.importance import version_number
from agentbolt.algorithms.metrics import MetricsLog, jsonable, plot_history
from agentbolt.algorithms.policy import EnginePolicy, PolicyServer, publish, serve_policy
from agentbolt.algorithms.train_state import TrainState
from agentbolt.console import task_bars
from agentbolt.memory import release_free_memory
from agentbolt.schemas import Mode, ModelWeights, Task

__all__ = ["GRPO", "GRPOConfig", "GRPOResult", "success_rate"]


@dataclass
class GRPOResult:
    history: list[dict[str, Any]]
    val_before: float | None
    val_after: float | None
    plot: Path | None
    resources_version: int | None
    metrics_file: Path
    val_greedy_before: float | None = None
    """Validation success at temperature 0 before training (``val_before`` is sampled)."""
    val_greedy_after: float | None = None


@dataclass
class _Run:
    """The live parts of one run that every step works with."""

    ctx: TrainContext
    policy: PolicyServer
    state: TrainState
    progress: Progress
    version: int
    """The resources version published last."""
    synced: list[int]
    """The policy versions the engine served in this run, in order (GRPO's step numbers)."""
    pool: GroupPool | None = None
    """Asynchronous mode: the groups in flight."""
    clock: EngineIdleClock | None = None


@dataclass
class _Sampled:
    """A step's rollouts and what they give to train on; ``t0``: when the step began."""

    batch: BatchResult
    rows: StepRows
    t0: float
    t_rollouts: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class GRPO(GRPOConfig, Algorithm):
    """GRPO on the policy's weights; its settings are :class:`GRPOConfig`'s."""

    def run(self, ctx: TrainContext) -> GRPOResult:
        torch.manual_seed(self.seed)
        served = serve_policy(
            self.model,
            ctx.run_dir,
            ctx.console,
            serve_url=self.serve_url,
            serve_model=self.serve_model,
            dtype=self.engine_dtype,
            device=self.device,
            forward=self.engine_forward,
        )
        # under torchrun with several ranks this is rank 0: the others join each update
        with served as policy, distributed.leader(training_device(self)):
            version = self._publish(ctx, policy, step=0, metrics={})
            state = build_train_state(self, policy.base_model_path)
            distributed.setup_followers(state, policy.base_model_path)
            start, history = self._maybe_resume(ctx, state, policy)
            # rows past the checkpoint (a crash between checkpoints) are redone, not kept twice
            log = MetricsLog(ctx.run_dir / "metrics.jsonl", resume=bool(start), keep_through=start)
            if start:
                version = self._publish(ctx, policy, step=start, metrics=history[-1] if history else {})
            return self._loop(ctx, policy, state, log, start, history, version)

    def _publish(self, ctx: TrainContext, policy: PolicyServer, step: int, metrics: dict[str, Any]) -> int:
        weights = ModelWeights(
            path=policy.weights_uri,
            base_model=self.model,
            format="lora" if self.lora else "full",
            metadata={"step": step},
        )
        meta = {"algorithm": "grpo", "step": step, "metrics": jsonable(metrics)}
        return publish(
            ctx.client,
            policy,
            meta,
            llm_resource=self.llm_resource,
            sampling=self.sampling,
            weights={"policy_weights": weights},
        )

    def _maybe_resume(
        self, ctx: TrainContext, state: TrainState, policy: PolicyServer
    ) -> tuple[int, list[dict[str, Any]]]:
        """With ``resume``: the step and history of the last checkpoint, if any; else ``(0, [])``."""
        return grpo_checkpoint.resume(ctx, state, policy) if self.resume else (0, [])

    # ------------------------------------------------------------------ the loop

    def _loop(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        state: TrainState,
        log: MetricsLog,
        start: int,
        history: list[dict[str, Any]],
        version: int,
    ) -> GRPOResult:
        shown = columns(self.reward_plan().is_agent_only, self.asynchronous)
        record = StepRecord(
            ctx.console,
            log,
            history,
            shown,
            CollapseWatch(self.collapse_entropy, self.collapse_steps),
            self.llm_resource,
        )
        progress = task_bars(ctx.console, transient=False)
        run = _Run(ctx, policy, state, progress, version, [_served_version(policy, start)])
        run.pool = self._pool(ctx, history, progress) if self.asynchronous else None
        run.clock = _idle_clock(policy)
        # a console that shows nothing live (a log, CI) had each row as a line: no table at the end
        # (printed once there, 30 columns are cut to a few characters each)
        shows = Group(record.table, progress) if ctx.console.is_terminal else progress
        live = Live(shows, console=ctx.console, refresh_per_second=4, transient=False)
        try:
            with run.clock or contextlib.nullcontext(), live:
                if start == 0 and self.validate_before:
                    record.record(
                        {"step": 0, **self._validate(ctx, version, progress), "resources_version": version}
                    )
                self._train(run, record, start)
        finally:
            if run.pool is not None:  # no rollout of this run left queued or running
                run.pool.cancel_all()
        log.close()
        plot = plot_history(history, ctx.run_dir / "grpo.png") if self.plot else None
        return _result(history, run.version, log.path, plot)

    def _train(self, run: _Run, record: StepRecord, start: int) -> None:
        """Steps ``start + 1`` to ``steps``, each recorded, validated and checkpointed when due."""
        train_seconds = 0.0
        for step in range(start + 1, self.steps + 1):
            row = self._timed_step(run, step)
            train_seconds += row["t_step"]
            row["steps_per_hour"] = 3600.0 * (step - start) / max(train_seconds, 1e-9)
            if self._validate_now(step):
                row.update(self._validate(run.ctx, run.version, run.progress))
            record.record(row)
            if self.checkpoint_every and (step % self.checkpoint_every == 0 or step == self.steps):
                grpo_checkpoint.save(run.ctx, run.state, step, record.history)

    def _timed_step(self, run: _Run, step: int) -> dict[str, Any]:
        """One step's row, with the seconds the engine sat idle during it."""
        idle_before = run.clock.idle_seconds if run.clock else 0.0
        row = self._async_step(run, run.pool, step) if run.pool is not None else self._step(run, step)
        if run.clock is not None:
            row["t_engine_idle"] = run.clock.idle_seconds - idle_before
        return row

    def _validate_now(self, step: int) -> bool:
        return step == self.steps or bool(self.val_every and step % self.val_every == 0)

    def _validate(self, ctx: TrainContext, version: int, progress: Progress) -> dict[str, float | None]:
        """``val_success`` (sampled) and, with ``val_greedy``, ``val_greedy`` (temperature 0)."""
        val = validate(
            ctx,
            version,
            timeout=self.step_timeout,
            rollout_timeout=self.rollout_timeout,
            greedy=self.val_greedy,
            progress=progress,
            max_attempts=self.max_attempts,
            rewards=self.reward_plan(),
        )
        out: dict[str, float | None] = {
            "val_success": success_rate(val.sampled, self.success_threshold) if val else None
        }
        if val is not None and val.greedy is not None:
            out["val_greedy"] = success_rate(val.greedy, self.success_threshold)
        return out

    def _train_and_publish(
        self, run: _Run, step: int, sampled: _Sampled, proximal: bool = False
    ) -> dict[str, Any]:
        """Update on the sampled rows, sync the engine when anything trained, publish, and the
        step's row (``proximal``, asynchronous mode: the ratio with importance weights, and the
        step recorded among the engine's versions)."""
        t1 = time.perf_counter()
        metrics = self._update(run.state, sampled.rows.rows, proximal=proximal)
        t_update = time.perf_counter() - t1
        t2 = time.perf_counter()
        if metrics.get("num_tokens"):
            run.policy.sync(run.state.model, step)
            release_free_memory()  # the merged copy of the weights the engine was handed
            if proximal:
                run.synced.append(step)
        run.version = self._publish(run.ctx, run.policy, step, metrics)
        times = {"t_update": t_update, "t_sync": time.perf_counter() - t2}
        return _step_row(step, run.version, sampled, metrics, self.success_threshold, times)

    def _update(self, state: TrainState, rows: list[TrainRow], proximal: bool = False) -> dict[str, float]:
        """One optimizer step (:func:`agentbolt.algorithms.grpo_update.update`)."""
        return update(self, state, rows, proximal)

    # ------------------------------------------------------------------ synchronous mode

    def _step(self, run: _Run, step: int) -> dict[str, Any]:
        """Run this step's groups with the current policy, wait for them, train on them."""
        t0 = time.perf_counter()
        tasks, batch = self._sample(run.ctx, step, run.version, run.progress)
        t_rollouts = time.perf_counter() - t0
        rows = step_rows(self, run.ctx.client, batch, tasks)
        return self._train_and_publish(run, step, _Sampled(batch, rows, t0, t_rollouts))

    def _sample(
        self, ctx: TrainContext, step: int, version: int, progress: Progress
    ) -> tuple[list[Task], BatchResult]:
        """This step's tasks, each run ``group_size`` times with the policy at ``version``."""
        rng = random.Random(self.seed * 100_003 + step)
        tasks = rng.sample(ctx.train_tasks, min(self.tasks_per_step, len(ctx.train_tasks)))
        batch = run_rollouts(
            ctx.client,
            tasks,
            mode=Mode.TRAIN,
            resources_version=version,
            repeat=self.group_size,
            group_prefix=f"{ctx.run_dir.name}:s{step}",
            timeout=self.step_timeout,
            rollout_timeout=self.rollout_timeout,
            max_attempts=self.max_attempts,
            progress=progress,
            label=f"step {step} rollouts",
            rewards=self.reward_plan(),
        )
        return tasks, batch

    # ------------------------------------------------------------------ asynchronous mode

    def _pool(self, ctx: TrainContext, history: list[dict[str, Any]], progress: Progress) -> GroupPool:
        """The pool of groups in flight; a resumed run continues the count of groups enqueued
        (the task order is drawn from it), with none in flight."""
        enqueued = next((h["groups_enqueued"] for h in reversed(history) if "groups_enqueued" in h), 0)
        return GroupPool(
            ctx.client,
            ctx.train_tasks,
            plan=self.reward_plan(),
            group_size=self.group_size,
            group_prefix=ctx.run_dir.name,
            seed=self.seed,
            next_index=int(enqueued),
            group_timeout=self.step_timeout,
            rollout_timeout=self.rollout_timeout,
            max_attempts=self.max_attempts,
            console=ctx.console,
            progress=progress,
        )

    def _async_step(self, run: _Run, pool: GroupPool, step: int) -> dict[str, Any]:
        """Take the first ``tasks_per_step`` complete groups, top the pool up (the engine keeps
        generating while this update trains), drop stale samples, update with importance
        weights, sync the engine and publish."""
        t0 = time.perf_counter()
        needed = (self.steps - step + 1) * self.tasks_per_step  # no group enqueued that no update takes
        # groups that can no longer give this update enough fresh samples make way for new ones
        evicted, _ = pool.evict_stale(run.synced, self.max_staleness, self.min_group_size)
        pool.top_up(min(self.groups_in_flight, needed), run.version, run.synced[-1])
        t_wait = self._wait_for_groups(pool, run.progress, step)
        taken = pool.take(self.tasks_per_step)
        carried = len(pool)
        pool.top_up(min(self.groups_in_flight, needed - len(taken)), run.version, run.synced[-1])
        t_rollouts = time.perf_counter() - t0
        batch = batch_of(taken, self.reward_plan())
        rows = self._async_rows(run.ctx, batch, taken, run.synced)
        extra = {
            "carried_groups": carried,
            "evicted_groups": evicted,
            "groups_enqueued": pool.next_index,
            "t_trainer_wait": t_wait,
        }
        return self._train_and_publish(run, step, _Sampled(batch, rows, t0, t_rollouts, extra), proximal=True)

    def _wait_for_groups(self, pool: GroupPool, progress: Progress, step: int) -> float:
        """Wait, with a bar, until ``tasks_per_step`` groups are complete; the seconds waited."""
        bar = progress.add_task(f"step {step} groups", total=self.tasks_per_step, info="")

        def show() -> None:
            done = min(len(pool.complete), self.tasks_per_step)
            progress.update(bar, completed=done, info=f"{len(pool)} in flight")

        t_wait = pool.wait_for(self.tasks_per_step, show)
        progress.remove_task(bar)
        return t_wait

    def _async_rows(
        self, ctx: TrainContext, batch: BatchResult, taken: list[InFlightGroup], synced: list[int]
    ) -> StepRows:
        """The rows of the taken groups without their stale samples (:func:`grpo_rows.fresh_rows`)."""
        return fresh_rows(self, ctx.client, batch, taken, synced)


def _step_row(
    step: int,
    version: int,
    sampled: _Sampled,
    metrics: dict[str, float],
    threshold: float,
    times: dict[str, float],
) -> dict[str, Any]:
    """A training step's row of the table and the metrics log."""
    train_tokens = metrics.get("num_tokens", 0.0)
    return {
        "step": step,
        "resources_version": version,
        **reward_stats(sampled.batch, threshold),
        **sampled.rows.data,
        **{k: v for k, v in metrics.items() if k != "num_tokens"},
        "train_tokens": train_tokens,
        "gen_tokens_per_s": sampled.rows.gen_tokens / max(sampled.t_rollouts, 1e-9),
        "train_tokens_per_s": train_tokens / max(times["t_update"], 1e-9),
        **sampled.extra,
        "t_rollouts": sampled.t_rollouts,
        **times,
        "t_step": time.perf_counter() - sampled.t0,
    }


def _result(history: list[dict[str, Any]], version: int, metrics_file: Path, plot: Path | None) -> GRPOResult:
    def before(key: str) -> float | None:
        return next((h[key] for h in history if h.get("step") == 0 and key in h), None)

    def after(key: str) -> float | None:
        return next((h[key] for h in reversed(history) if key in h), None)

    return GRPOResult(
        history,
        before("val_success"),
        after("val_success"),
        plot,
        version,
        metrics_file,
        val_greedy_before=before("val_greedy"),
        val_greedy_after=after("val_greedy"),
    )


def _idle_clock(policy: PolicyServer) -> EngineIdleClock | None:
    """The embedded engine's idle clock; None for a remote server (nothing to sample)."""
    if not isinstance(policy, EnginePolicy):
        return None
    engine = policy.engine
    return EngineIdleClock(lambda: int(engine.stats()["running"]))


def _served_version(policy: PolicyServer, step: int) -> int:
    """The policy version the engine serves now: its own when it is a number, else ``step``."""
    if isinstance(policy, EnginePolicy):
        served = version_number(policy.engine.version)
        if served is not None:
            return served
    return step
