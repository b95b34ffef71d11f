"""What GRPO is told: its settings (:class:`GRPOConfig`, the fields of
:class:`~agentbolt.algorithms.grpo.GRPO`, each documented where it is declared, which is what
``agentbolt train grpo --help`` and config files show), checked when they are made, so a bad
value fails before a model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentbolt.algorithms.base import DEFAULT_MAX_ATTEMPTS
from agentbolt.algorithms.credit import ADVANTAGE_MODES, AdvantageMode
from agentbolt.algorithms.importance import IMPORTANCE_MODES, ImportanceMode
from agentbolt.algorithms.rewards import RewardOptions
from agentbolt.engine.forward import FORWARDS
from agentbolt.errors import ConfigError

__all__ = ["GRPOConfig"]


@dataclass
class GRPOConfig(RewardOptions):
    """The settings of a GRPO run; :class:`~agentbolt.algorithms.grpo.GRPO` adds the loop."""

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
    """Name of the LLM resource the agent reads (the policy's role): only the calls it served
    train the policy (:mod:`agentbolt.algorithms.roles`)."""
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
        _check_credit(self)
        _check_importance(self)
        _check_update(self)
        _check_pool(self)

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


def _check_credit(config: GRPOConfig) -> None:
    if config.advantage not in ADVANTAGE_MODES:
        choices = ", ".join(ADVANTAGE_MODES)
        raise ValueError(f"advantage must be one of {choices}; got {config.advantage!r}")
    if not 0.0 <= config.gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1]; got {config.gamma}")


def _check_importance(config: GRPOConfig) -> None:
    if config.importance not in IMPORTANCE_MODES:
        choices = ", ".join(IMPORTANCE_MODES)
        raise ConfigError(f"importance must be one of {choices}; got {config.importance!r}")
    staleness = config.max_staleness
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ConfigError(f"max_staleness must be a whole number >= 0; got {staleness!r}")
    if not (isinstance(config.importance_cap, int | float) and config.importance_cap > 1.0):
        raise ConfigError(f"importance_cap must be a number > 1; got {config.importance_cap!r}")


def _check_update(config: GRPOConfig) -> None:
    checkpointing = config.activation_checkpointing
    if checkpointing is not None and not isinstance(checkpointing, bool):
        raise ConfigError(
            f"activation_checkpointing must be True, False or None (automatic); got {checkpointing!r}"
        )
    if config.engine_forward not in FORWARDS:
        raise ConfigError(
            f"engine_forward must be one of {', '.join(FORWARDS)}; got {config.engine_forward!r}"
        )


def _check_pool(config: GRPOConfig) -> None:
    if config.max_groups_in_flight is not None and config.max_groups_in_flight < config.tasks_per_step:
        raise ConfigError(
            f"max_groups_in_flight must be at least tasks_per_step ({config.tasks_per_step}); "
            f"got {config.max_groups_in_flight}"
        )
