"""Automatic prompt optimization (APO) of a prompt resource, by one of two methods:

- ``method="bootstrap"`` (the default; :mod:`agentbolt.algorithms.apo_bootstrap`): worked
  examples drawn from the agent's own successful runs and a random search over sets of them.
  It needs no model besides the agent's, so it gains with the bundled 135M model offline.
- ``method="rewrite"``: an optimizer model critiques and rewrites the prompt, as a
  textual-gradient beam search or a reflective Pareto variant in the spirit of GEPA (below).
  It needs a capable model: the bundled one cannot rewrite a prompt usefully.

``strategy="beam"`` (after ProTeGi, Pryzant et al. 2023), each round:

1. draw a batch of training tasks and run every prompt of the beam on it (rollouts pinned to
   the prompt's resources version);
2. ``branch_factor`` times per beam prompt: show the optimizer model a sample of those runs,
   mostly the worst (the conversation the gateway recorded, reward, error), ask it for a
   critique - the "textual gradient" - and then for a rewrite inside ``<prompt>...</prompt>``;
3. publish each child, run it on the same training batch and on the fixed validation batch;
4. keep the ``beam_width`` candidates with the best validation score.

``strategy="pareto"`` (after GEPA, Agrawal et al. 2025) keeps per-task validation scores. Parents
are drawn from the Pareto front over validation tasks - every candidate that is best on some
task and not dominated - with odds by the number of tasks it wins, so a prompt that alone
solves one kind of task survives even when its mean is lower. A child that does not beat its
parent on the training batch it was reflected from is not evaluated on validation.

Where this departs from the papers: ProTeGi picks among many children with bandits; here each
child gets one full pass over a fixed validation batch (fewer moving parts, comparable scores).
GEPA draws one parent per iteration and also merges candidates; here ``beam_width`` parents are
drawn per round and there is no merge.

Records. Resources versions are immutable and a score exists only after rollouts ran with the
version, so each candidate is published twice: a *trial* version the rollouts are pinned to
(metadata ``{"algorithm": "apo", "stage": "trial", "round", "parent"}``), then a *scored*
version with the same resources (``"stage": "scored"``, ``"candidate"``: the trial version,
``"scores": {"train", "val"}``). The seed gets a scored version of its own (round 0). Both are
published with ``trial=True``: the server never makes them the latest, so runners outside this
run keep the seed while unvalidated prompts are tried, and a run that crashes leaves the seed
(or a previous run's best) as the latest. At the end the best prompt is published once more as
a normal version, the latest, so whatever runs next uses it.

The optimizer model's auth and configuration errors (HTTP 400, 401, 403, 404 and the like)
stop the run at once with a :class:`~agentbolt.errors.ConfigError`; only transient ones
(timeouts, connection errors, 408, 409, 429, 5xx) are retried.

The result never scores below the seed on validation: the seed stays in the candidate pool all
run long and wins ties (the same validation batch for all; a noisy agent is measured once).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Literal

from rich.live import Live

from agentbolt.algorithms.apo_bootstrap import run_bootstrap
from agentbolt.algorithms.apo_optimizer import APOStats, Optimizer
from agentbolt.algorithms.apo_search import APOResult, Candidate, Search, pareto_front, report, select_beam
from agentbolt.algorithms.base import DEFAULT_MAX_ATTEMPTS, Algorithm, TrainContext
from agentbolt.algorithms.rewards import RewardOptions
from agentbolt.errors import ConfigError
from agentbolt.schemas import LLM, PromptTemplate, Resources

__all__ = ["APO", "APOResult", "APOStats", "Candidate", "pareto_front", "prompt_of", "select_beam"]


@dataclass
class APO(RewardOptions, Algorithm):
    """Optimize one prompt resource from the agent's runs (--method bootstrap or rewrite).

    ``bootstrap`` adds worked examples from the agent's own successful runs (no other model
    needed); ``rewrite`` has an optimizer model rewrite the prompt."""

    prompt_resource: str = "system_prompt"
    """Name of the ``PromptTemplate`` resource to optimize; the other resources are kept."""
    method: Literal["bootstrap", "rewrite"] = "bootstrap"
    """``bootstrap``: worked examples from the agent's successful runs, no other model needed;
    ``rewrite``: an optimizer model rewrites the prompt (needs a capable one)."""
    trials: int = 8
    """bootstrap: candidate prompts scored on validation, besides the seed."""
    max_demos: int = 3
    """bootstrap: worked examples in one candidate prompt at most."""
    bootstrap_tasks: int = 16
    """bootstrap: training tasks run per bootstrap round to find successful runs."""
    bootstrap_rounds: int = 2
    """bootstrap: rounds of bootstrapping; each after the first shows the examples found so far."""
    demo_min_score: float = 1.0
    """bootstrap: the reward a run needs to become a worked example."""
    demos_as: Literal["turns", "text"] = "turns"
    """bootstrap: how worked examples reach the model. ``turns``: as chat turns, the example
    turns of the LLM resource the run was recorded through, which the gateway puts into every
    call (a small model learns from these); ``text``: written into the prompt under a header."""
    instructions: list[str] = field(default_factory=list)
    """bootstrap: more instructions to try in place of the seed's (it is always tried)."""
    strategy: Literal["beam", "pareto"] = "beam"
    """``beam``: textual-gradient beam search; ``pareto``: GEPA-style Pareto front over tasks."""
    rounds: int = 3
    """rewrite: rounds of expansion (0: only score the seed)."""
    beam_width: int = 2
    """Prompts kept (beam), or parents drawn from the front (pareto), per round."""
    branch_factor: int = 2
    """Children asked of the optimizer per parent and round."""
    train_batch_size: int = 4
    """Training tasks per round (cycling through the shuffled training set)."""
    val_batch_size: int | None = None
    """Validation tasks every candidate is scored on (drawn once); None: all of them."""
    rollout_budget: int | None = None
    """Stop once this many rollouts were run (the seed's are always run); None: no limit."""
    optimizer_base_url: str | None = None
    """OpenAI-compatible endpoint of the optimizer; None: the agent's own ``LLM`` resource
    (rewrite), no optimizer (bootstrap: set it or ``optimizer_model`` to add rewrites of the
    seed to the instructions tried)."""
    optimizer_model: str | None = None
    """Model name; None: the ``LLM`` resource's model."""
    optimizer_api_key: str | None = None
    """None: ``$OPENAI_API_KEY``, else ``"none"`` (the server never hands out stored keys)."""
    llm_resource: str | None = None
    """Which ``LLM`` resource is the default optimizer; None: the first one."""
    optimizer_timeout: float = 120.0
    """Seconds one optimizer call may take."""
    optimizer_retries: int = 2
    """Extra tries when a call fails or its answer is unusable."""
    optimizer_backoff: float = 1.0
    """Seconds before the first retry, doubling after each."""
    optimizer_temperature: float = 0.7
    optimizer_max_tokens: int = 1024
    max_prompt_chars: int = 4000
    """Longer rewrites are rejected (and counted) as runaway output."""
    max_examples: int = 4
    """Runs shown to the optimizer per critique."""
    max_example_chars: int = 2000
    """Each run is clipped to this many characters in the critique request."""
    batch_timeout: float = 600.0
    """Seconds to wait for one batch of rollouts; stragglers are cancelled, left out of the
    scores and counted (``APOStats.stragglers``)."""
    rollout_timeout: float | None = None
    """Seconds one attempt may take before the server ends it."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts per rollout: a dead runner's rollouts are retried; an agent that raises is not
    (a candidate is never scored on the best of several tries)."""
    seed: int = 0
    """Seed of the task sampling and example picking."""

    def run(self, ctx: TrainContext) -> APOResult:
        self._check_config(ctx)
        base = ctx.client.latest_resources()
        seed_prompt = prompt_of(base, self.prompt_resource) if base else None
        if base is None or seed_prompt is None:
            raise ConfigError(
                f"APO needs a PromptTemplate resource named {self.prompt_resource!r} to start from"
            )
        rewrite = self.method == "rewrite"
        wanted = rewrite or self.optimizer_model is not None or self.optimizer_base_url is not None
        search = Search(self, ctx, base, self._optimizer(base) if wanted else None)
        try:
            # A log file gets one line per candidate instead of a live table (see Search._row).
            live = ctx.console.is_terminal
            with Live(search.table, console=ctx.console) if live else contextlib.nullcontext():
                if rewrite:
                    search.start(seed_prompt, base.version)
                    for r in range(1, self.rounds + 1):
                        if not search.round(r):
                            break
                else:
                    seed = Candidate(seed_prompt, base.version, round=0, parent=None, order=0, note="seed")
                    search.pool.append(seed)
                    run_bootstrap(search, seed)
            result = search.finish()
        finally:
            if search.optimizer is not None:
                search.optimizer.close()
        report(ctx.console, result, None if live else search.table)
        return result

    def _check_config(self, ctx: TrainContext) -> None:
        sizes = (
            self.rounds >= 0,
            self.beam_width >= 1,
            self.branch_factor >= 1,
            self.train_batch_size >= 1,
            (self.val_batch_size or 1) >= 1,
            self.max_prompt_chars >= 1,
            self.optimizer_retries >= 0,
            self.trials >= 0,
            min(self.max_demos, self.bootstrap_tasks, self.bootstrap_rounds) >= 1,
        )
        if not all(sizes):
            raise ConfigError(
                "APO: rounds, trials and retries must be >= 0; widths, sizes, limits and demos >= 1"
            )
        if self.method not in ("bootstrap", "rewrite"):
            raise ConfigError(f"APO: unknown method {self.method!r} (bootstrap or rewrite)")
        if self.demos_as not in ("turns", "text"):
            raise ConfigError(f"APO: unknown demos_as {self.demos_as!r} (turns or text)")
        if self.strategy not in ("beam", "pareto"):
            raise ConfigError(f"APO: unknown strategy {self.strategy!r} (beam or pareto)")
        if not ctx.train_tasks:
            raise ConfigError(
                "APO needs training tasks (its examples and the optimizer's evidence come from them)"
            )

    def _optimizer(self, base: Resources) -> Optimizer:
        llms = [r for n, r in base.resources.items() if isinstance(r, LLM) and self.llm_resource in (None, n)]
        llm = llms[0] if llms else None
        base_url = self.optimizer_base_url or (llm.base_url if llm else None)
        model = self.optimizer_model or (llm.model if llm else None)
        if not base_url or not model:
            raise ConfigError(
                "APO needs an optimizer: set optimizer_base_url and optimizer_model, or publish an LLM resource"
            )
        key = self.optimizer_api_key or os.environ.get("OPENAI_API_KEY") or "none"
        return Optimizer(
            base_url,
            model,
            key,
            timeout=self.optimizer_timeout,
            retries=self.optimizer_retries,
            backoff=self.optimizer_backoff,
            max_prompt_chars=self.max_prompt_chars,
            temperature=self.optimizer_temperature,
            max_tokens=self.optimizer_max_tokens,
            stats=APOStats(),
        )


# ---------------------------------------------------------------------------- reading results


def prompt_of(resources: Resources, name: str | None = None) -> str | None:
    """The named prompt's text, or (without a name) the only ``PromptTemplate`` in ``resources``."""
    if name is not None:
        res = resources.resources.get(name)
        return res.template if isinstance(res, PromptTemplate) else None
    prompts = [r for r in resources.resources.values() if isinstance(r, PromptTemplate)]
    return prompts[0].template if len(prompts) == 1 else None
