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
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Group
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

from agentbolt.adapters import STATE_EVENT, TrajectoryRow, latest_attempt, to_trajectories
from agentbolt.algorithms import distributed
from agentbolt.algorithms.async_grpo import EngineIdleClock, GroupPool, InFlightGroup, version_lag
from agentbolt.algorithms.base import (
    DEFAULT_MAX_ATTEMPTS,
    Algorithm,
    BatchResult,
    TrainContext,
    run_rollouts,
    validate,
)
from agentbolt.algorithms.credit import ADVANTAGE_MODES, AdvantageMode, compute_advantages
from agentbolt.algorithms.importance import (
    IMPORTANCE_MODES,
    ImportanceMode,
    behaviour_version,
    version_number,
)
from agentbolt.algorithms.losses import (
    Batch,
    LossFn,
    PolicyLoss,
    TrainRow,
    micro_batches,
    pad_batch,
    reference_logprobs,
)
from agentbolt.algorithms.metrics import MetricsLog, plot_history
from agentbolt.algorithms.policy import EnginePolicy, PolicyServer, publish, serve_policy
from agentbolt.algorithms.rewards import RewardOptions, RewardPlan, tally
from agentbolt.algorithms.train_state import (
    TrainConfig,
    TrainState,
    fast_bf16,
    frozen_base_to,
    frozen_embeddings_to,
    load_checkpoint,
    make_train_state,
    optimizer_step,
    save_checkpoint,
)
from agentbolt.console import print_line, task_bars
from agentbolt.engine.forward import FORWARDS
from agentbolt.errors import ConfigError, InvalidTransition
from agentbolt.memory import large_blocks_mapped, release_free_memory
from agentbolt.schemas import Event, Mode, ModelWeights, Rollout, RolloutStatus, Task

__all__ = ["GRPO", "GRPOResult", "success_rate"]


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


def success_rate(batch: BatchResult, threshold: float) -> float:
    """Share of rollouts (failed ones included) whose chosen reward reached ``threshold``; those
    whose reward is pending or could not be given are left out (no outcome yet, not a failure)."""
    counts = tally(batch.rollouts, batch.reward)
    judged = len(batch.rollouts) - counts.pending - counts.errors
    if not judged:
        return 0.0
    ok = sum(1 for v in batch.values if v >= threshold)
    return ok / judged


@dataclass
class GRPO(RewardOptions, Algorithm):
    model: str = "smollm2"
    """The policy: ``"smollm2"`` (the bundled model) or a local Hugging Face model directory."""
    steps: int = 10
    tasks_per_step: int = 4
    group_size: int = 8
    """Rollouts per task per step; advantages are computed within a group."""
    lr: float = 3e-4
    lora: bool = True
    """False: full fine-tuning (with ``kl_coef`` > 0 it keeps a frozen copy of the initial weights
    for the KL term on the training device: twice the weights' memory)."""
    lora_r: int = 16
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial policy (0: off, no reference pass)."""
    max_tokens_per_micro_batch: int = 4096
    """Gradient accumulation: padded tokens per forward/backward pass."""
    activation_checkpointing: bool | None = None
    """Keep only each decoder layer's input through the policy's forward pass and recompute the
    rest in the backward pass (:func:`~agentbolt.algorithms.losses.checkpointed_layers`): the
    activations of a micro-batch shrink to a small fraction (SmolLM2, 4096 tokens: about 3 GB
    less), for about one more forward of the body per update. None: on when a micro-batch holds
    more than 1024 tokens. Updates spread over torchrun ranks are not checkpointed."""
    low_memory: bool = False
    """Give every block of 128 KB or more that an update allocates its own memory map, handed back
    the moment it is freed (:func:`~agentbolt.memory.large_blocks_mapped`): a lower peak while the
    update runs, for page faults on every such block. A SmolLM2 update of 32 rows (2,078 tokens,
    checkpointed) in a fresh process peaked at 1.02 GB resident against 1.41-1.43 GB without, and
    took 9.7-10.1 s against 5.0-6.2 s (3.2 million page faults against 0.37 million;
    ``benchmarks/update_parts.py``); once the process's heap has grown, both take about the same
    time. ``agentbolt demo`` turns it on (its memory target);
    the default favours speed."""
    bf16: bool | None = None
    """Train under bfloat16 autocast (fp32 master weights; with LoRA the frozen base projections
    are stored in bfloat16, which autocast computes them in anyway). None: where bfloat16 is native
    (a GPU that has it, a CPU with AVX512-BF16 or AMX: :func:`~agentbolt.algorithms.train_state.fast_bf16`);
    on an AVX2-only CPU PyTorch emulates it and a linear layer runs 6-8x slower than in float32."""
    engine_forward: str = "auto"
    """Whose forward pass the embedded engine runs (``EngineConfig.forward``): "auto" (the
    engine's own for Llama models, transformers' otherwise), "engine" or "transformers". In
    GRPO's embedded engine (rollouts sampled at temperature 1, 32 at a time, SmolLM2, bfloat16)
    the engine's own made the rollout phase faster in four alternated pairs of 3-step runs on a
    quiet 2-core AVX512-BF16 machine: 3.3-4.1 s against 3.9-5.3 s per step (steps 2-3, median
    about 3.8 against 4.6). ``agentbolt model serve`` runs it by default too
    (``EngineConfig.forward``)."""
    engine_dtype: str = "bfloat16"
    """The embedded engine's weights. On a CPU without native bfloat16 the engine computes
    bfloat16 products in float32 (``EngineConfig.cpu_matmul="auto"``): close to float32's speed
    at half its memory."""
    val_every: int = 5
    """Validate every K steps (and before the first and after the last); 0: only before/after."""
    checkpoint_every: int = 5
    resume: bool = False
    """Continue from ``<run_dir>/checkpoint`` if it exists."""
    success_threshold: float = 1.0
    """A rollout whose reward reaches this counts as a success."""
    val_greedy: bool = True
    """Validate twice: with the published sampling parameters (``val_success``) and at
    temperature 0 (``val_greedy``, through a trial resources version that is never the latest).
    Only agents that pass their LLM resource's sampling parameters on decode greedily then."""
    validate_before: bool = True
    """Validate the untrained policy before the first step; False skips it (a comparison that
    measured the starting point once)."""
    min_group_size: int = 2
    """Groups with fewer finished rollouts than this are dropped from the update."""
    step_timeout: float = 600.0
    """Seconds a step waits for its rollouts; stragglers are cancelled."""
    rollout_timeout: float | None = 300.0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts per rollout. A runner that dies or loses its lease has its rollouts retried, so a
    group keeps its members; an agent that raises fails at once (training only on the runs that
    survived retries would bias the update). Retried samples are counted per step."""
    llm_resource: str = "llm"
    """Name of the LLM resource the agent reads."""
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})
    seed: int = 0
    plot: bool = True
    device: str | None = None
    """Training device, and the embedded engine's; None: ``cuda`` when available, else ``cpu``."""
    serve_url: str | None = None
    """A vLLM-compatible server already serving ``model`` (e.g. vLLM with ``--enable-lora``), or
    several, comma-separated: sampling goes there (one server per attempt, behind the gateway)
    and each update is loaded as a LoRA adapter into every server before it is published.
    None: the embedded engine."""
    serve_model: str | None = None
    """The base model's name on ``serve_url``."""
    advantage: AdvantageMode = "rollout"
    """Credit assignment: ``rollout`` (one advantage per sample, as GRPO), ``turn`` (each turn's
    discounted return against the group's baseline) or ``gigpo`` (the episode advantage plus a
    step advantage among the turns declared in the same state, see ``emit_state``). Formulas in
    :mod:`agentbolt.algorithms.credit`."""
    gamma: float = 1.0
    """Discount of per-turn returns (``turn`` and ``gigpo``), in [0, 1]."""
    step_weight: float = 1.0
    """``gigpo``: weight of the step advantage against the episode advantage."""
    collapse_entropy: float = 0.01
    """Warn when the policy entropy of a step (mean nats per generated token) falls below this
    (0: never). A strict output format alone brings SmolLM2 to 0.02-0.05 on the chain task while
    it still learns, so the default sits below that."""
    collapse_steps: int = 3
    """Warn when more than 75% of the groups had zero reward spread for this many consecutive
    steps (0: never)."""
    asynchronous: bool = True
    """Keep groups in flight while the policy trains (the default): each update takes the first
    ``tasks_per_step`` complete groups, carries the unfinished ones over and tops the pool up,
    so rollouts keep running during the update. Samples are corrected by truncated importance
    sampling and dropped when staler than ``max_staleness`` (docs/training.md). False: each step
    enqueues its groups, waits for them and trains on nothing else (on-policy)."""
    max_staleness: int = 2
    """Asynchronous mode: drop a sample whose behaviour policy (the oldest weights that
    generated any of its tokens) is more than this many policy versions behind the policy being
    updated; counted as ``stale_dropped``. 2: with the default pool (2 x ``tasks_per_step``
    groups) a group may wait through two updates before one takes it, so every group the pool
    carries can be used (``benchmarks/grpo_async.py`` measured this setting)."""
    max_groups_in_flight: int | None = None
    """Asynchronous mode: groups kept enqueued or running; None: 2 x ``tasks_per_step``."""
    importance: ImportanceMode = "token"
    """Asynchronous mode: the importance weight of the proximal policy against the behaviour
    policy, per ``token``, one per ``sequence``, or ``off`` (weight 1)."""
    importance_cap: float = 2.0
    """Asynchronous mode: importance weights are truncated at this value (> 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.advantage not in ADVANTAGE_MODES:
            choices = ", ".join(ADVANTAGE_MODES)
            raise ValueError(f"advantage must be one of {choices}; got {self.advantage!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1]; got {self.gamma}")
        if self.importance not in IMPORTANCE_MODES:
            choices = ", ".join(IMPORTANCE_MODES)
            raise ConfigError(f"importance must be one of {choices}; got {self.importance!r}")
        if (
            isinstance(self.max_staleness, bool)
            or not isinstance(self.max_staleness, int)
            or self.max_staleness < 0
        ):
            raise ConfigError(f"max_staleness must be a whole number >= 0; got {self.max_staleness!r}")
        if not (isinstance(self.importance_cap, int | float) and self.importance_cap > 1.0):
            raise ConfigError(f"importance_cap must be a number > 1; got {self.importance_cap!r}")
        if self.activation_checkpointing is not None and not isinstance(self.activation_checkpointing, bool):
            raise ConfigError(
                f"activation_checkpointing must be True, False or None (automatic); got {self.activation_checkpointing!r}"
            )
        if self.engine_forward not in FORWARDS:
            raise ConfigError(
                f"engine_forward must be one of {', '.join(FORWARDS)}; got {self.engine_forward!r}"
            )
        if self.max_groups_in_flight is not None and self.max_groups_in_flight < self.tasks_per_step:
            raise ConfigError(
                f"max_groups_in_flight must be at least tasks_per_step ({self.tasks_per_step}); "
                f"got {self.max_groups_in_flight}"
            )

    @property
    def checkpointing(self) -> bool:
        """Whether the update checkpoints activations (``activation_checkpointing``, resolved)."""
        if self.activation_checkpointing is None:
            return self.max_tokens_per_micro_batch > 1024
        return self.activation_checkpointing

    @property
    def groups_in_flight(self) -> int:
        """Asynchronous mode: the pool's size (``max_groups_in_flight``, default 2 x ``tasks_per_step``)."""
        return self.max_groups_in_flight or 2 * self.tasks_per_step

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
        with served as policy, distributed.leader(self._device()):
            version = self._publish(ctx, policy, step=0, metrics={})
            state = self._train_state(policy)
            distributed.setup_followers(state, policy.base_model_path)
            start, history = self._maybe_resume(ctx, state, policy)
            # rows past the checkpoint (a crash between checkpoints) are redone, not kept twice
            log = MetricsLog(ctx.run_dir / "metrics.jsonl", resume=bool(start), keep_through=start)
            if start:
                version = self._publish(ctx, policy, step=start, metrics=history[-1] if history else {})
            return self._loop(ctx, policy, state, log, start, history, version)

    # ------------------------------------------------------------------ setup

    def _train_state(self, policy: PolicyServer) -> TrainState:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy.base_model_path, dtype=torch.float32)
        model = model.to(self._device())  # type: ignore[arg-type]
        config = TrainConfig(lora=self.lora, lora_r=self.lora_r, lora_alpha=2 * self.lora_r, lr=self.lr)
        # full fine-tuning with KL keeps a frozen copy of the initial weights beside the trained ones
        state = make_train_state(model, config, reference=bool(self.kl_coef))
        if self._bf16() and not distributed.leading():
            # the update runs under bfloat16 autocast, which casts every frozen projection to
            # bfloat16 anyway: stored so, the same results at half their memory
            frozen_base_to(state.model, torch.bfloat16)
            frozen_embeddings_to(state.model, torch.bfloat16)  # lookups widened back to float32
        return state

    def _bf16(self) -> bool:
        return fast_bf16(self._device()) if self.bf16 is None else self.bf16

    def _device(self) -> torch.device:
        """Where training runs: the GPU when there is one (the engine picks its device the same way)."""
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def _publish(self, ctx: TrainContext, policy: PolicyServer, step: int, metrics: dict[str, Any]) -> int:
        weights = ModelWeights(
            path=policy.weights_uri,
            base_model=self.model,
            format="lora" if self.lora else "full",
            metadata={"step": step},
        )
        meta = {"algorithm": "grpo", "step": step, "metrics": _jsonable(metrics)}
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
        path = ctx.run_dir / "checkpoint"
        if not (self.resume and (path / "state.json").exists()):
            return 0, []
        ckpt = load_checkpoint(path, state.model, state.optimizer)
        state.step = ckpt.step
        distributed.share_state(state)  # a full state: any number of ranks resumes from it
        policy.sync(state.model, ckpt.step)
        ctx.console.print(f"resumed from {path} at step {ckpt.step}")
        training, validation = _cancel_unfinished(ctx.client, ctx.run_dir.name)
        if training or validation:
            ctx.console.print(
                f"cancelled {training} training and {validation} validation rollout(s) the "
                "interrupted run had left queued or running"
            )
        return ckpt.step, list(ckpt.extra.get("history", []))

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
        columns = _columns(self.reward_plan().is_agent_only, self.asynchronous)
        table = _metrics_table(columns)
        for row in history:
            _add_row(table, row, columns)
        progress = task_bars(ctx.console, transient=False)

        collapse = _CollapseWatch(self.collapse_entropy, self.collapse_steps)
        for row in history:  # a resumed run continues the count
            collapse.check(row)

        def record(row: dict[str, Any]) -> None:
            warning = collapse.check(row)
            if warning:
                row["warning"] = warning
                print_line(ctx.console, f"warning: {warning}")
            history.append(row)
            log.write(row)
            _add_row(table, row, columns)
            if not ctx.console.is_terminal:  # a log or CI shows nothing live: one line per step
                print_line(ctx.console, _line(row, columns))

        pool = self._pool(ctx, history, progress) if self.asynchronous else None
        clock = _idle_clock(policy)
        # the policy versions the engine served in this run, in order (GRPO's step numbers)
        synced = [_served_version(policy, start)]
        train_seconds = 0.0
        try:
            with (
                clock or contextlib.nullcontext(),
                Live(Group(table, progress), console=ctx.console, refresh_per_second=4, transient=False),
            ):
                if start == 0 and self.validate_before:
                    record(
                        {"step": 0, **self._validate(ctx, version, progress), "resources_version": version}
                    )
                for step in range(start + 1, self.steps + 1):
                    idle_before = clock.idle_seconds if clock else 0.0
                    if pool is not None:
                        row, version = self._async_step(
                            ctx, policy, state, step, version, progress, pool, synced
                        )
                    else:
                        row, version = self._step(ctx, policy, state, step, version, progress)
                    if clock is not None:
                        row["t_engine_idle"] = clock.idle_seconds - idle_before
                    train_seconds += row["t_step"]
                    row["steps_per_hour"] = 3600.0 * (step - start) / max(train_seconds, 1e-9)
                    if self._validate_now(step):
                        row.update(self._validate(ctx, version, progress))
                    record(row)
                    if self.checkpoint_every and (step % self.checkpoint_every == 0 or step == self.steps):
                        save_checkpoint(
                            ctx.run_dir / "checkpoint",
                            state.model,
                            state.optimizer,
                            step,
                            extra={"history": _jsonable(history)},
                        )
        finally:
            if pool is not None:  # no rollout of this run left queued or running
                pool.cancel_all()
        log.close()
        return self._result(ctx, history, version, log)

    def _result(
        self, ctx: TrainContext, history: list[dict[str, Any]], version: int, log: MetricsLog
    ) -> GRPOResult:
        def before(key: str) -> float | None:
            return next((h[key] for h in history if h.get("step") == 0 and key in h), None)

        def after(key: str) -> float | None:
            return next((h[key] for h in reversed(history) if key in h), None)

        plot = plot_history(history, ctx.run_dir / "grpo.png") if self.plot else None
        return GRPOResult(
            history,
            before("val_success"),
            after("val_success"),
            plot,
            version,
            log.path,
            val_greedy_before=before("val_greedy"),
            val_greedy_after=after("val_greedy"),
        )

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

    def _step(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        state: TrainState,
        step: int,
        version: int,
        progress: Progress,
    ) -> tuple[dict[str, Any], int]:
        t0 = time.perf_counter()
        tasks, batch = self._sample(ctx, step, version, progress)
        t_rollouts = time.perf_counter() - t0
        rows, gen_tokens, data = self._rows(ctx, batch, tasks)
        return self._train_and_publish(
            ctx, policy, state, step, batch, rows, gen_tokens, data, t0, t_rollouts
        )

    def _train_and_publish(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        state: TrainState,
        step: int,
        batch: BatchResult,
        rows: list[TrainRow],
        gen_tokens: int,
        data: dict[str, Any],
        t0: float,
        t_rollouts: float,
        extra: dict[str, Any] | None = None,
        synced: list[int] | None = None,
    ) -> tuple[dict[str, Any], int]:
        """Update on ``rows``, sync the engine when anything trained, publish, and the step's row
        (``synced``, asynchronous mode: the proximal ratio with importance weights, and the step
        recorded among the engine's versions)."""
        t1 = time.perf_counter()
        metrics = self._update(state, rows, proximal=synced is not None)
        t_update = time.perf_counter() - t1
        t2 = time.perf_counter()
        if metrics.get("num_tokens"):
            policy.sync(state.model, step)
            release_free_memory()  # the merged copy of the weights the engine was handed
            if synced is not None:
                synced.append(step)
        version = self._publish(ctx, policy, step, metrics)
        t_sync = time.perf_counter() - t2
        train_tokens = metrics.get("num_tokens", 0.0)
        row = {
            "step": step,
            "resources_version": version,
            **_reward_stats(batch, self.success_threshold),
            **data,
            **{k: v for k, v in metrics.items() if k != "num_tokens"},
            "train_tokens": train_tokens,
            "gen_tokens_per_s": gen_tokens / max(t_rollouts, 1e-9),
            "train_tokens_per_s": train_tokens / max(t_update, 1e-9),
            **(extra or {}),
            "t_rollouts": t_rollouts,
            "t_update": t_update,
            "t_sync": t_sync,
            "t_step": time.perf_counter() - t0,
        }
        return row, version

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

    def _async_step(
        self,
        ctx: TrainContext,
        policy: PolicyServer,
        state: TrainState,
        step: int,
        version: int,
        progress: Progress,
        pool: GroupPool,
        synced: list[int],
    ) -> tuple[dict[str, Any], int]:
        """Take the first ``tasks_per_step`` complete groups, top the pool up (the engine keeps
        generating while this update trains), drop stale samples, update with importance
        weights, sync the engine and publish."""
        t0 = time.perf_counter()
        needed = (self.steps - step + 1) * self.tasks_per_step  # no group enqueued that no update takes
        # groups that can no longer give this update enough fresh samples make way for new ones
        evicted, _ = pool.evict_stale(synced, self.max_staleness, self.min_group_size)
        pool.top_up(min(self.groups_in_flight, needed), version, synced[-1])
        bar = progress.add_task(f"step {step} groups", total=self.tasks_per_step, info="")

        def show() -> None:
            done = min(len(pool.complete), self.tasks_per_step)
            progress.update(bar, completed=done, info=f"{len(pool)} in flight")

        t_wait = pool.wait_for(self.tasks_per_step, show)
        progress.remove_task(bar)
        taken = pool.take(self.tasks_per_step)
        carried = len(pool)
        pool.top_up(min(self.groups_in_flight, needed - len(taken)), version, synced[-1])
        t_rollouts = time.perf_counter() - t0
        batch = _batch_of(taken, self.reward_plan())
        rows, gen_tokens, data = self._async_rows(ctx, batch, taken, synced)
        extra = {
            "carried_groups": carried,
            "evicted_groups": evicted,
            "groups_enqueued": pool.next_index,
            "t_trainer_wait": t_wait,
        }
        return self._train_and_publish(
            ctx, policy, state, step, batch, rows, gen_tokens, data, t0, t_rollouts, extra, synced
        )

    def _async_rows(
        self, ctx: TrainContext, batch: BatchResult, taken: list[InFlightGroup], synced: list[int]
    ) -> tuple[list[TrainRow], int, dict[str, Any]]:
        """Rows of the taken groups without their stale samples. A sample's lag is the number of
        policy versions served after its behaviour version (the oldest that generated any of its
        tokens; the group's version at enqueue time when its calls reported none)."""
        finished = self._groups(batch)
        events = ctx.client.events_of(
            [r.id for rs in finished.values() for r in rs], type=["llm_call", "reward", STATE_EVENT]
        )
        enqueued_at = {g.group_id: g.policy_version for g in taken}
        hist: Counter[int] = Counter()
        stale = 0
        fresh: dict[str, list[Rollout]] = {}
        for group_id, rollouts in finished.items():
            for r in rollouts:
                seen = behaviour_version(latest_attempt(events[r.id]))
                behaviour = seen if seen is not None else enqueued_at.get(group_id, synced[-1])
                lag = version_lag(synced, behaviour)
                hist[lag] += 1
                if lag > self.max_staleness:
                    stale += 1
                else:
                    fresh.setdefault(group_id, []).append(r)
        kept = {g: rs for g, rs in fresh.items() if len(rs) >= self.min_group_size}
        rows, gen_tokens, data = self._rows_of(kept, batch, events)
        data.update(
            dropped_groups=len(taken) - len(kept),
            stale_dropped=stale,
            staleness_hist={str(lag): n for lag, n in sorted(hist.items())},
            staleness_mean=sum(lag * n for lag, n in hist.items()) / max(1, sum(hist.values())),
        )
        return rows, gen_tokens, data

    # ------------------------------------------------------------------ synchronous mode

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

    def _groups(self, batch: BatchResult) -> dict[str, list[Rollout]]:
        """The succeeded rollouts with a chosen reward (none pending or in error) of each group
        that has at least ``min_group_size`` of them."""
        finished: dict[str, list[Rollout]] = defaultdict(list)
        for r in batch.scored:
            if r.group_id:
                finished[r.group_id].append(r)
        return {g: rs for g, rs in finished.items() if len(rs) >= self.min_group_size}

    def _rows(
        self, ctx: TrainContext, batch: BatchResult, tasks: list[Task]
    ) -> tuple[list[TrainRow], int, dict[str, Any]]:
        kept = self._groups(batch)
        events = ctx.client.events_of(
            [r.id for rs in kept.values() for r in rs], type=["llm_call", "reward", STATE_EVENT]
        )
        rows, gen_tokens, data = self._rows_of(kept, batch, events)
        data["dropped_groups"] = len(tasks) - len(kept)
        return rows, gen_tokens, data

    def _rows_of(
        self, kept: dict[str, list[Rollout]], batch: BatchResult, events: dict[str, list[Event]]
    ) -> tuple[list[TrainRow], int, dict[str, Any]]:
        traj_rows: list[TrajectoryRow] = []
        gen_tokens = mismatches = 0
        for rollouts in kept.values():
            for r in rollouts:
                # Only the attempt that finished: a retried rollout's lost attempt may have made
                # model calls too, and its reward is not theirs.
                rows, stats = to_trajectories(
                    latest_attempt(events[r.id]),
                    reward=batch.value(r),
                    group_id=r.group_id,
                    task_id=r.task.id,
                )
                traj_rows += rows
                mismatches += stats.prefix_mismatches
                gen_tokens += sum(row.num_model_tokens for row in rows)
        train_rows, adv = compute_advantages(traj_rows, self.advantage, self.gamma, self.step_weight)
        data = {
            "samples": len({(row.rollout_id, row.attempt_id) for row in traj_rows}),
            "groups": adv.groups,
            "zero_spread_groups": adv.zero_spread_groups,
            "prefix_mismatches": mismatches,
            **adv.metrics(),
        }
        return train_rows, gen_tokens, data

    def _update(self, state: TrainState, rows: list[TrainRow], proximal: bool = False) -> dict[str, float]:
        """One optimizer step; ``proximal`` (asynchronous mode): the ratio against the current
        policy, the recorded logprobs corrected for by truncated importance weights."""
        if not rows:
            return {"num_tokens": 0.0}
        if distributed.leading():
            return self._update_distributed(state, rows, proximal)
        device = self._device()
        batches = [
            _to_device(pad_batch(mb), device)
            for mb in micro_batches(rows, max_tokens=self.max_tokens_per_micro_batch)
        ]
        # checkpointed, the output layer's chunk is what peaks: smaller chunks, the same values
        policy_loss = PolicyLoss(
            self.clip_low,
            self.clip_high,
            self.kl_coef,
            checkpoint=self.checkpointing,
            chunk_tokens=256 if self.checkpointing else 1024,
        )
        if proximal:
            policy_loss = replace(
                policy_loss, proximal=True, importance=self.importance, importance_cap=self.importance_cap
            )
        seen: list[dict[str, float]] = []

        def loss(
            model: torch.nn.Module, batch: Batch, num_tokens: float
        ) -> tuple[torch.Tensor, dict[str, float]]:
            value, metrics = policy_loss(model, batch, num_tokens)
            seen.append(metrics)
            return value, metrics

        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if self._bf16() else contextlib.nullcontext()
        )
        release_free_memory()  # what the rollouts freed into the heap, before the pass adds its own
        # low_memory: the pass's large blocks given back when freed, not kept as heap holes
        mapped = large_blocks_mapped() if self.low_memory else contextlib.nullcontext()
        with autocast, mapped:
            if self.kl_coef:  # under the same autocast as the update: KL is 0 before the first one
                batches = [_with_ref(b, reference_logprobs(state.reference_model, b)) for b in batches]
            out = optimizer_step(state, batches, cast(LossFn, loss))
        del batches
        release_free_memory()  # the pass's activations, not held through the next rollouts
        # the step averages metrics over micro-batches by tokens: extremes are taken over them
        for name, pick in (("is_weight_min", min), ("is_weight_max", max)):
            values = [m[name] for m in seen if name in m]
            if values:
                out[name] = pick(values)
        return out

    def _update_distributed(
        self, state: TrainState, rows: list[TrainRow], proximal: bool
    ) -> dict[str, float]:
        """:meth:`_update` spread over the torchrun ranks: the micro-batches go to the ranks by
        token count, each computes its reference log-probs (KL) and gradients, the gradients are
        summed (:func:`agentbolt.algorithms.distributed.update`)."""
        batches = [pad_batch(mb) for mb in micro_batches(rows, max_tokens=self.max_tokens_per_micro_batch)]
        # not checkpointed across ranks (untested under FSDP2's hooks): as before
        policy_loss = PolicyLoss(self.clip_low, self.clip_high, self.kl_coef)
        if proximal:
            policy_loss = replace(
                policy_loss, proximal=True, importance=self.importance, importance_cap=self.importance_cap
            )
        out = distributed.update(state, batches, policy_loss, bf16=self._bf16(), reference=bool(self.kl_coef))
        del batches
        release_free_memory()
        return out


def _reward_stats(batch: BatchResult, threshold: float) -> dict[str, Any]:
    rewards = batch.values
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
    return {
        "reward_mean": mean,
        "reward_std": std,
        "success": success_rate(batch, threshold),
        "rollouts": len(batch.rollouts),
        "failed": len(batch.failed),
        "timed_out": batch.timed_out,
        "retried": sum(1 for r in batch.rollouts if r.attempts > 1),
        **tally(batch.rollouts, batch.reward).metrics(),
        **batch.evaluation_metrics(),
    }


def _batch_of(groups: list[InFlightGroup], plan: RewardPlan) -> BatchResult:
    """The taken groups' rollouts as one batch, with what the evaluators here did for them."""
    reports = [g.report for g in groups if g.report is not None]
    report = reports[0] if reports else None
    for more in reports[1:]:
        report = report + more if report is not None else more
    rollouts = [r for g in groups for r in g.rollouts]
    return BatchResult(rollouts, sum(g.timed_out for g in groups), plan.choice, report)


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


def _to_device(batch: Batch, device: torch.device) -> Batch:
    tensors = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def _with_ref(batch: Batch, ref_BT: torch.Tensor) -> Batch:
    return replace(batch, ref_logprobs_BT=ref_BT)


_COLUMNS = (
    ("step", "{}"),
    ("success", "{:.0%}"),
    ("reward_mean", "{:.3f}"),
    ("val_success", "{:.0%}"),
    ("val_greedy", "{:.0%}"),
    ("loss", "{:+.4f}"),
    ("clip_fraction", "{:.3f}"),
    ("entropy", "{:.2f}"),
    ("zero_spread_groups", "{}"),
    ("turns_mean", "{:.1f}"),
    ("step_reward_mean", "{:+.3f}"),
    ("retried", "{}"),
    ("reward_pending", "{}"),
    ("reward_errors", "{}"),
    ("carried_groups", "{}"),
    ("evicted_groups", "{}"),
    ("stale_dropped", "{}"),
    ("staleness_mean", "{:.2f}"),
    ("is_weight_mean", "{:.3f}"),
    ("is_weight_min", "{:.3f}"),
    ("is_weight_max", "{:.3f}"),
    ("is_clipped_fraction", "{:.3f}"),
    ("t_trainer_wait", "{:.1f}s"),
    ("t_engine_idle", "{:.1f}s"),
    ("t_rollouts", "{:.1f}s"),
    ("t_update", "{:.1f}s"),
    ("t_sync", "{:.1f}s"),
    ("steps_per_hour", "{:.1f}"),
)
# columns that say nothing while the reward is the agent's own (always 0: nothing is awaited)
_NAMED_REWARD_COLUMNS = ("reward_pending", "reward_errors")
# columns of asynchronous mode only (nothing is carried, stale or weighted in synchronous mode)
_ASYNC_COLUMNS = (
    "carried_groups",
    "evicted_groups",
    "stale_dropped",
    "staleness_mean",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "is_clipped_fraction",
    "t_trainer_wait",
)


def _columns(agent_only: bool, asynchronous: bool = False) -> tuple[tuple[str, str], ...]:
    """The live table's columns: the named-reward counts only when a named reward is in play,
    the staleness and importance-weight columns only in asynchronous mode."""
    return tuple(
        c
        for c in _COLUMNS
        if not (agent_only and c[0] in _NAMED_REWARD_COLUMNS)
        and not (not asynchronous and c[0] in _ASYNC_COLUMNS)
    )


@dataclass
class _CollapseWatch:
    """Signs that learning stalled: the policy entropy below ``min_entropy``, or more than 75% of
    groups without a reward spread for ``steps`` steps in a row. Warns once per such stretch."""

    min_entropy: float
    steps: int
    zero_spread_run: int = 0
    warned: bool = False

    def check(self, row: dict[str, Any]) -> str | None:
        if "reward_mean" not in row:  # a validation-only row
            return None
        groups, entropy = row.get("groups") or 0, row.get("entropy")
        mostly_flat = bool(groups) and row.get("zero_spread_groups", 0) / groups > 0.75
        self.zero_spread_run = self.zero_spread_run + 1 if mostly_flat else 0
        reasons = []
        if self.min_entropy and entropy is not None and entropy < self.min_entropy:
            reasons.append(f"policy entropy {entropy:.3f} is below {self.min_entropy:g}")
        if self.steps and self.zero_spread_run >= self.steps:
            reasons.append(
                f"more than 75% of groups had zero reward spread for {self.zero_spread_run} steps in a row"
            )
        if not reasons:
            self.warned = False
            return None
        if self.warned:
            return None
        self.warned = True
        return "possible collapse: " + "; ".join(reasons)


def _metrics_table(columns: tuple[tuple[str, str], ...] = _COLUMNS) -> Table:
    table = Table(title="GRPO", expand=False)
    for name, _ in columns:
        table.add_column(name.replace("_", " "), justify="right")
    return table


def _cells(row: dict[str, Any], columns: tuple[tuple[str, str], ...]) -> list[str]:
    return [fmt.format(row[name]) if row.get(name) is not None else "-" for name, fmt in columns]


def _add_row(table: Table, row: dict[str, Any], columns: tuple[tuple[str, str], ...] = _COLUMNS) -> None:
    table.add_row(*_cells(row, columns))


def _line(row: dict[str, Any], columns: tuple[tuple[str, str], ...] = _COLUMNS) -> str:
    """The table's row as one plain line: ``GRPO step 3 | success 50% | reward mean 0.412 | ...``."""
    pairs = [
        f"{name.replace('_', ' ')} {cell}"
        for (name, _), cell in zip(columns, _cells(row, columns), strict=True)
    ]
    return "GRPO " + " | ".join(pairs)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


def _cancel_unfinished(client: Any, run: str) -> tuple[int, int]:
    """Cancel the queued and running rollouts the run named ``run`` (its folder's name) enqueued
    before it was interrupted: training rollouts whose group id starts with ``run:`` and
    validation rollouts whose metadata names the run (:func:`~agentbolt.algorithms.base.validate`).
    Nothing would read them once it resumes (it enqueues its groups and validation afresh), but
    runners would still claim and run them, ahead of the new ones. Rollouts of other runs on a
    shared server, and validation rollouts that name no run (enqueued by a release before it
    named them), are left alone. Returns how many of each were cancelled; one that ends
    meanwhile is skipped."""
    live = [RolloutStatus.QUEUED, RolloutStatus.RUNNING]
    training = [
        r.id
        for r in client.pages(client.list_rollouts, status=live, mode=Mode.TRAIN, limit=1000)
        if (r.group_id or "").startswith(f"{run}:")
    ]
    validation = [
        r.id
        for r in client.pages(client.list_rollouts, status=live, mode=Mode.VAL, limit=1000)
        if r.metadata.get("run") == run
    ]

    def cancel(ids: list[str]) -> int:
        cancelled = 0
        for rollout_id in ids:
            with contextlib.suppress(InvalidTransition):  # it succeeded or failed since the listing
                client.cancel(rollout_id)
                cancelled += 1
        return cancelled

    return cancel(training), cancel(validation)
