"""SFT: rejection-sampling fine-tuning on the agent's own best runs.

One round: run every training task ``rollouts_per_task`` times with the current weights, keep
the runs that pass the filter (reward at least ``min_reward``, and at most the best
``top_fraction`` of each task's runs), turn their ``llm_call`` events into token rows with the
gateway's exact ids (:func:`agentbolt.adapters.to_trajectories`: loss on model-generated tokens
only; prompts, tool outputs and user turns are masked), fine-tune on them (LoRA by default),
swap the new weights into the serving engine, publish them as a new resources version, and
validate on the validation tasks. Then the next round samples from the improved policy.

Where this departs from the papers (STaR, Zelikman et al. 2022; ReST-EM, Singh et al. 2023):

- Both restart fine-tuning from the base model every iteration. By default we keep training
  the same adapter across rounds (each round is a few steps on CPU; restarting would throw them
  away); ``reset_each_round=True`` gives the papers' behaviour.
- Selection is per rollout by its final reward; per-call rewards do not select calls.
- Runs that produced the very same token sequence are trained on once per round (a solved easy
  task would otherwise dominate the batch with identical copies).

The model: the engine serves the policy from its own thread. Wrapping that very module in LoRA
would change what it serves mid-request and race its forward passes, so SFT trains a separate
float32 copy (loaded from the served model's folder, or ``policy_model``) and hands the policy
server the saved adapter (:meth:`~agentbolt.algorithms.policy.PolicyServer.sync`), which the
engine merges into its base weights in place.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from agentbolt.adapters import AdapterStats, TrajectoryRow, latest_attempt, to_trajectories
from agentbolt.algorithms import distributed
from agentbolt.algorithms.base import (
    DEFAULT_MAX_ATTEMPTS,
    Algorithm,
    BatchResult,
    TrainContext,
    no_ids_note,
    run_rollouts,
    validate,
)
from agentbolt.algorithms.batch import TrainRow
from agentbolt.algorithms.evaluate import EvalSummary
from agentbolt.algorithms.policy import PolicyServer, publish, serve_policy
from agentbolt.algorithms.rewards import RewardOptions, resolve, reward_names, wait_for_rewards
from agentbolt.algorithms.roles import other_roles_note, role_calls
from agentbolt.algorithms.sft_train import TrainStats, eval_loss, select_rollouts, sft_rows, train_rows
from agentbolt.algorithms.train_state import TrainConfig, TrainState, export_weights, make_train_state
from agentbolt.console import print_line
from agentbolt.schemas import EventType, Mode, ModelWeights, Rollout

__all__ = [
    "SFT",
    "RoundResult",
    "SFTResult",
    "TrainStats",
    "eval_loss",
    "select_rollouts",
    "sft_rows",
    "train_rows",
]


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RoundResult:
    round: int
    rollouts: int
    succeeded: int
    train_reward: float | None
    """Mean reward of this round's training rollouts (the policy before this round's update)."""
    kept: int
    """Rollouts that passed the filter."""
    rows: int
    duplicates: int
    adapter: AdapterStats
    train: TrainStats | None
    """None when no row passed the filter (nothing trained or published)."""
    weights_path: Path | None
    resources_version: int | None
    val: EvalSummary | None
    reward_pending: int = 0
    """This round's succeeded rollouts whose chosen reward was still pending at selection: they
    join a later round's selection if it arrives by then."""
    reward_errors: int = 0
    """This round's succeeded rollouts whose chosen reward could not be given (left out)."""
    arrived: int = 0
    """Rollouts of earlier rounds whose reward arrived since and joined this round's selection."""
    evaluation: dict[str, float] = field(default_factory=dict)
    """What the evaluators run here did for this round's batch: judge calls, tokens, seconds."""


@dataclass(frozen=True)
class SFTResult:
    rounds: list[RoundResult]
    val_before: EvalSummary | None
    weights_path: Path | None
    """The last published adapter (or full model) folder, in Hugging Face format."""
    resources_version: int | None

    @property
    def val_after(self) -> EvalSummary | None:
        return next((r.val for r in reversed(self.rounds) if r.val is not None), None)


# ---------------------------------------------------------------------------- the algorithm


@dataclass
class SFT(RewardOptions, Algorithm):
    """Rejection-sampling fine-tuning (see the module docstring)."""

    model: str = "smollm2"
    """The policy to serve when ``policy`` is not given: ``"smollm2"`` (the bundled model) or a
    local Hugging Face folder."""
    policy: PolicyServer | None = None
    """A policy server already serving the model (e.g. an ``EnginePolicy`` over an engine the
    caller started); None: the embedded engine is started for the run."""
    policy_model: nn.Module | str | None = None
    """What to fine-tune: a module (trained as a float32 copy) or a Hugging Face folder; None: the
    base weights the policy server serves."""
    rounds: int = 3
    rollouts_per_task: int = 4
    """Runs of each training task per round (the candidates the filter picks from)."""
    min_reward: float | None = 1.0
    """Keep runs whose reward is at least this (None: no threshold). Suits 0/1 success rewards."""
    top_fraction: float = 1.0
    """Keep at most the best ``ceil(top_fraction * rollouts_per_task)`` runs of each task."""
    epochs: int = 2
    """Passes over each round's rows."""
    batch_size: int = 8
    """Rows per optimizer step."""
    max_tokens_per_micro_batch: int = 4096
    """Padded tokens per forward/backward pass (gradient accumulation beyond)."""
    max_len: int | None = 2048
    """Rows are cut to this many tokens (the start is kept)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=2e-4))
    """LoRA (``lora=False``: full fine-tuning), rank, learning rate, gradient clipping."""
    bf16: bool = False
    """Train under bfloat16 autocast (float32 master weights). Off: on our AVX512-BF16 CPU a LoRA
    step of SmolLM2 took 1.6-1.75x more CPU time under autocast than in float32 (GPUs differ)."""
    reset_each_round: bool = False
    """Fine-tune from the base model each round (ReST-EM) instead of continuing the adapter."""
    validate_before: bool = True
    """Validate the starting policy before the first round."""
    val_greedy: bool = True
    """Validate twice: with the published sampling parameters and at temperature 0 (a trial
    resources version, never the latest); the greedy summary is the validation's ``greedy``."""
    round_timeout: float = 900.0
    """Seconds a round waits for its rollouts (and validation for its own); stragglers are cancelled."""
    rollout_timeout: float | None = 300.0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts per rollout: a dead runner's rollouts are retried; an agent that raises is not."""
    llm_resource: str = "llm"
    """Name of the LLM resource the agent reads (pointed at the policy server): only the calls
    it served train the policy (:mod:`agentbolt.algorithms.roles`)."""
    weights_resource: str = "policy_weights"
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})
    """Sampling parameters of the LLM resource SFT publishes (diverse runs to pick from)."""
    seed: int = 0

    def run(self, ctx: TrainContext) -> SFTResult:
        torch.manual_seed(self.seed)
        served = (
            contextlib.nullcontext(self.policy)
            if self.policy is not None
            else serve_policy(self.model, ctx.run_dir, ctx.console)
        )
        # under torchrun with several ranks this is rank 0: the others join each update
        with served as policy, distributed.leader(torch.device("cpu")):
            version = self._publish(ctx, policy, {"algorithm": "sft", "round": 0})
            base = self._load_policy(policy)
            source = self._follower_source(policy)
            state = make_train_state(copy.deepcopy(base) if self.reset_each_round else base, self.train)
            distributed.setup_followers(state, source)
            val_before = self._validate(ctx, version, "validation (before)") if self.validate_before else None
            results: list[RoundResult] = []
            late: list[Rollout] = []  # rollouts whose chosen reward had not arrived at selection
            for r in range(1, self.rounds + 1):
                if self.reset_each_round and r > 1:
                    state = make_train_state(copy.deepcopy(base), self.train)
                    distributed.setup_followers(state, source)
                result, late = self._round(ctx, policy, state, r, version, late)
                results.append(result)
                version = results[-1].resources_version or version
                _log_round(ctx, results[-1], val_before)
        weights = next((x.weights_path for x in reversed(results) if x.weights_path), None)
        return SFTResult(results, val_before, weights, version)

    # ------------------------------------------------------------------ setup

    def _load_policy(self, policy: PolicyServer) -> nn.Module:
        """A float32 training copy of the policy (never the module the engine serves)."""
        from transformers import AutoModelForCausalLM

        from agentbolt.engine import ensure_model

        if isinstance(self.policy_model, nn.Module):
            return copy.deepcopy(self.policy_model).float()
        path = self.policy_model or policy.base_model_path
        return AutoModelForCausalLM.from_pretrained(ensure_model(path), dtype=torch.float32)

    def _follower_source(self, policy: PolicyServer) -> str | nn.Module:
        """What the other torchrun ranks build their replica from: the module itself (pickled
        to them) or the Hugging Face folder (each rank reads it at the same path)."""
        if not distributed.launched():
            return ""
        if isinstance(self.policy_model, nn.Module):
            return self.policy_model
        from agentbolt.engine import ensure_model

        return str(ensure_model(self.policy_model or policy.base_model_path))

    def _publish(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        meta: dict[str, Any],
        weights: ModelWeights | None = None,
    ) -> int:
        named = {self.weights_resource: weights} if weights is not None else None
        return publish(
            ctx.client, policy, meta, llm_resource=self.llm_resource, sampling=self.sampling, weights=named
        )

    # ------------------------------------------------------------------ one round

    def _round(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        state: TrainState,
        r: int,
        version: int,
        late: list[Rollout],
    ) -> tuple[RoundResult, list[Rollout]]:
        """One round; also returns the rollouts (this round's and earlier ones) whose chosen
        reward is still pending, for the next round's selection."""
        batch = self._sample(ctx, r, version)
        arrived, late = self._arrived(ctx, late)
        pool = [*batch.rollouts, *arrived]
        kept = select_rollouts(pool, self.min_reward, self.top_fraction, self.reward)
        late += [x for x in batch.succeeded if resolve(x, self.reward).state == "pending"]
        rows, duplicates, adapter = self._rows(ctx, kept, r)
        result = RoundResult(
            round=r,
            rollouts=len(batch.rollouts),
            succeeded=len(batch.succeeded),
            train_reward=batch.mean_reward,
            kept=len(kept),
            rows=len(rows),
            duplicates=duplicates,
            adapter=adapter,
            train=None,
            weights_path=None,
            resources_version=version,
            val=None,
            reward_pending=batch.reward_pending,
            reward_errors=batch.reward_errors,
            arrived=len(arrived),
            evaluation=batch.evaluation_metrics(),
        )
        if not rows:
            ctx.console.print(f"[yellow]round {r}: no run passed the filter; nothing to train on[/]")
            return result, late
        stats = self._train(ctx, state, rows, r)
        path, version = self._ship(ctx, policy, state, r, stats)
        val = self._validate(ctx, version, f"round {r} validation")
        return replace(result, train=stats, weights_path=path, resources_version=version, val=val), late

    def _arrived(self, ctx: TrainContext, late: list[Rollout]) -> tuple[list[Rollout], list[Rollout]]:
        """Of ``late`` (reread), those whose chosen reward has a value now, and those still pending
        (an error is final: dropped)."""
        if not late:
            return [], []
        reread = wait_for_rewards(ctx.client, late, reward_names(self.reward), 0.0)
        states = [(x, resolve(x, self.reward).state) for x in reread]
        return [x for x, s in states if s == "ok"], [x for x, s in states if s == "pending"]

    def _sample(self, ctx: TrainContext, r: int, version: int) -> BatchResult:
        """Every training task, ``rollouts_per_task`` times, with the policy at ``version``."""
        return run_rollouts(
            ctx.client,
            ctx.train_tasks,
            mode=Mode.TRAIN,
            resources_version=version,
            repeat=self.rollouts_per_task,
            group_prefix=f"{ctx.run_dir.name}:sft{r}",
            timeout=self.round_timeout,
            rollout_timeout=self.rollout_timeout,
            max_attempts=self.max_attempts,
            console=ctx.console,
            label=f"round {r} rollouts",
            rewards=self.reward_plan(),
        )

    def _rows(
        self, ctx: TrainContext, kept: Sequence[Rollout], r: int
    ) -> tuple[list[TrainRow], int, AdapterStats]:
        """Round ``r``'s rows from the kept rollouts' calls; says how many calls it skipped for
        lack of token ids, when any."""
        trajectories: list[TrajectoryRow] = []
        adapter = AdapterStats()
        by_rollout = ctx.client.events_of([x.id for x in kept], type=[EventType.LLM_CALL.value])
        other_roles = 0
        for x in kept:
            events, left_out = role_calls(latest_attempt(by_rollout[x.id]), self.llm_resource)
            other_roles += left_out
            reward = resolve(x, self.reward).value
            found, stats = to_trajectories(events, reward=reward, group_id=x.group_id, task_id=x.task.id)
            trajectories += found
            adapter += stats
        rows, duplicates = sft_rows(trajectories)
        if adapter.skipped_no_ids:
            print_line(ctx.console, f"SFT round {r}: {no_ids_note(adapter.skipped_no_ids)}")
        if other_roles:
            print_line(ctx.console, f"SFT round {r}: {other_roles_note(other_roles, self.llm_resource)}")
        return rows, duplicates, adapter

    def _train(self, ctx: TrainContext, state: TrainState, rows: list[TrainRow], r: int) -> TrainStats:
        total = self.epochs * math.ceil(len(rows) / self.batch_size)
        with _training_bar(ctx.console, r) as progress:
            return train_rows(
                state,
                rows,
                epochs=self.epochs,
                batch_size=self.batch_size,
                max_tokens=self.max_tokens_per_micro_batch,
                max_len=self.max_len,
                pad_id=_pad_id(state.model),
                seed=self.seed * 1000 + r,
                bf16=self.bf16,
                on_step=_step_reporter(ctx.console, progress, r, total),
            )

    def _ship(
        self, ctx: TrainContext, policy: PolicyServer, state: TrainState, r: int, stats: TrainStats
    ) -> tuple[Path, int]:
        """Save the weights (Hugging Face format), serve them, publish a version."""
        path = (ctx.run_dir / "sft" / f"round-{r}").resolve()
        fmt = export_weights(state.model, path)
        policy.sync(state.model, f"sft-r{r}", saved=path)
        meta = {"algorithm": "sft", "round": r, "metrics": _metrics(stats)}
        base = getattr(state.model, "name_or_path", None) or str(
            getattr(state.model.config, "_name_or_path", "")
        )
        weights = ModelWeights(path=str(path), base_model=base or None, format=fmt, metadata=meta)
        return path, self._publish(ctx, policy, meta, weights)

    def _validate(self, ctx: TrainContext, version: int, label: str) -> EvalSummary | None:
        val = validate(
            ctx,
            version,
            timeout=self.round_timeout,
            rollout_timeout=self.rollout_timeout,
            greedy=self.val_greedy,
            label=label,
            max_attempts=self.max_attempts,
            rewards=self.reward_plan(),
        )
        if val is None:
            return None
        greedy = EvalSummary.of(val.greedy) if val.greedy is not None else None
        return replace(EvalSummary.of(val.sampled), greedy=greedy)


# ---------------------------------------------------------------------------- helpers


def _training_bar(console: Console, r: int) -> Progress:
    return Progress(
        TextColumn(f"[bold]round {r} training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _step_reporter(
    console: Console, progress: Progress, r: int, total: int
) -> Callable[[dict[str, float]], None]:
    """Advances the bar after each optimizer step; off a terminal, where the bar shows nothing,
    prints one plain line per step with the same figures."""
    bar = progress.add_task("train", total=total, loss="-")
    done = 0

    def on_step(m: dict[str, float]) -> None:
        nonlocal done
        done += 1
        loss = f"{m.get('loss', float('nan')):.4f}"
        progress.update(bar, completed=done, loss=loss)
        if not console.is_terminal:
            print_line(console, f"SFT round {r} training {done}/{total} | loss {loss}")

    return on_step


def _pad_id(model: nn.Module) -> int:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def _metrics(stats: TrainStats) -> dict[str, Any]:
    return {
        "steps": stats.steps,
        "model_tokens": stats.model_tokens,
        "loss_first": stats.loss_first,
        "loss_last": stats.loss_last,
        "tokens_per_s": round(stats.tokens_per_s, 1),
    }


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return format(value, spec) if value is not None else "-"


_ROUND_COLUMNS = (
    "rollouts",
    "train reward",
    "pending",
    "kept",
    "rows",
    "dupes",
    "loss",
    "tokens/s",
    "version",
    "val reward",
)


def _log_round(ctx: TrainContext, r: RoundResult, val_before: EvalSummary | None) -> None:
    """Print the round's summary and append it to ``<run_dir>/sft/rounds.jsonl``."""
    table = Table(title=f"SFT round {r.round}")
    for column in _ROUND_COLUMNS:
        table.add_column(column, justify="right")
    table.add_row(*_round_cells(r, val_before))
    ctx.console.print(table)
    log = ctx.run_dir / "sft" / "rounds.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(json.dumps(asdict(r), default=str) + "\n")


def _round_cells(r: RoundResult, val_before: EvalSummary | None) -> list[str]:
    loss = f"{_fmt(r.train.loss_first)} → {_fmt(r.train.loss_last)}" if r.train else "-"
    val = _fmt(r.val.mean_reward if r.val else None)
    if val_before is not None:
        val += f" (start {_fmt(val_before.mean_reward)})"
    if r.val is not None and r.val.greedy is not None:
        start = val_before.greedy if val_before is not None else None
        val += f", greedy {_fmt(r.val.greedy.mean_reward)}"
        val += f" (start {_fmt(start.mean_reward)})" if start is not None else ""
    tokens_per_s = _fmt(r.train.tokens_per_s if r.train else None, ".0f")
    return [
        f"{r.succeeded}/{r.rollouts}",
        _fmt(r.train_reward),
        f"{r.reward_pending} (+{r.arrived} in)" if r.arrived else str(r.reward_pending),
        str(r.kept),
        str(r.rows),
        str(r.duplicates),
        loss,
        tokens_per_s,
        str(r.resources_version or "-"),
        val,
    ]
