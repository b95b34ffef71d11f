"""The state of one APO run, shared by both methods: the candidate pool, the rollouts run for
each candidate (pinned to its trial resources version), the records published for the
dashboard, the rollout budget and the progress table; and the ``rewrite`` method's rounds (beam
or Pareto selection, critique and rewrite). See :mod:`agentbolt.algorithms.apo`."""

from __future__ import annotations

import difflib
import json
import math
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from agentbolt.algorithms.apo_optimizer import APOStats, Optimizer, pick_examples, run_record, score_of
from agentbolt.algorithms.base import TrainContext, run_rollouts
from agentbolt.algorithms.rewards import RewardChoice
from agentbolt.console import print_line
from agentbolt.schemas import LLM, ExampleTurn, Mode, PromptTemplate, Resources, Rollout, Task
from agentbolt.turns import render_conversation

if TYPE_CHECKING:
    from agentbolt.algorithms.apo import APO

__all__ = ["APOResult", "Candidate", "Search", "candidate_key", "pareto_front", "report", "select_beam"]


@dataclass
class Candidate:
    """A prompt and its scores. ``version`` is the resources version its rollouts ran with."""

    prompt: str
    version: int
    round: int
    parent: int | None
    order: int
    train: float | None = None
    val: float | None = None
    val_by_task: dict[str, float] = field(default_factory=dict)
    record_version: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """More of its record's metadata (the bootstrap method's demonstrations)."""
    turns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Example turns it adds to LLM resources, by resource name (the bootstrap method's
    demonstrations as chat turns)."""

    def key(self) -> str:
        return candidate_key(self.prompt, self.turns)

    def rank(self) -> tuple[float, bool, int]:
        """Higher is better: validation score, then the seed, then the earlier candidate."""
        return (self.val if self.val is not None else -math.inf, self.parent is None, -self.order)


def candidate_key(prompt: str, turns: dict[str, list[dict[str, Any]]]) -> str:
    """What tells two candidates apart: the prompt and the example turns."""
    return prompt if not turns else json.dumps([prompt, turns], sort_keys=True)


@dataclass(frozen=True)
class APOResult:
    best_prompt: str
    best_version: int
    """The resources version the best candidate's rollouts ran with (the seed's own if it won)."""
    published_version: int
    """The version published at the end with the best prompt (the latest when the run ended)."""
    seed_prompt: str
    seed_version: int
    seed_val: float | None
    """None when no validation run of the seed was scored (every reward pending or in error)."""
    best_val: float | None
    history: list[Candidate]
    front: list[int]
    """Versions of the final beam, or of the final Pareto front."""
    stats: APOStats
    best_turns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The example turns the best candidate adds to LLM resources, by resource name."""


def _mean(values: Sequence[float]) -> float | None:
    """None when nothing was scored (every run left out)."""
    return sum(values) / len(values) if values else None


def _scores(rollouts: Sequence[Rollout], reward: RewardChoice) -> list[float]:
    """The scores of the runs not left out (stragglers, pending or failed rewards)."""
    return [s for r in rollouts if (s := score_of(r, reward)) is not None]


def select_beam(pool: Sequence[Candidate], width: int) -> list[Candidate]:
    return sorted((c for c in pool if c.val is not None), key=Candidate.rank, reverse=True)[:width]


def _task_wins(pool: Sequence[Candidate]) -> dict[int, int]:
    """candidate order -> number of validation tasks on which it scores best (ties all win).
    A task a candidate has no score on (its run left out) is one it neither wins nor loses."""
    wins = {c.order: 0 for c in pool}
    for task in {t for c in pool for t in c.val_by_task}:
        top = max(c.val_by_task[task] for c in pool if task in c.val_by_task)
        for c in pool:
            wins[c.order] += c.val_by_task.get(task) == top
    return wins


def _dominates(a: Candidate, b: Candidate) -> bool:
    """Better or equal on every task both were scored on, better on one."""
    tasks = a.val_by_task.keys() & b.val_by_task.keys()
    pairs = [(a.val_by_task[t], b.val_by_task[t]) for t in tasks]
    return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)


def pareto_front(pool: Sequence[Candidate]) -> list[Candidate]:
    """Candidates that win at least one validation task and that no other winner dominates."""
    scored = [c for c in pool if c.val is not None]
    wins = _task_wins(scored)
    winners = [c for c in scored if wins[c.order] > 0]
    return [c for c in winners if not any(_dominates(o, c) for o in winners)]


def _sample_front(front: Sequence[Candidate], k: int, rng: random.Random) -> list[Candidate]:
    """Up to ``k`` distinct parents, drawn with odds by the number of tasks each wins."""
    wins = _task_wins(front)
    left, picked = list(front), list[Candidate]()
    while left and len(picked) < k:
        choice = rng.choices(left, weights=[max(wins[c.order], 1) for c in left])[0]
        picked.append(choice)
        left.remove(choice)
    return sorted(picked, key=lambda c: c.order)


class Search:
    """The state of one APO run: the candidate pool, cached training runs, the progress table."""

    def __init__(self, apo: APO, ctx: TrainContext, base: Resources, optimizer: Optimizer | None) -> None:
        self.apo, self.ctx, self.client, self.optimizer = apo, ctx, ctx.client, optimizer
        # Every candidate is the starting resources with another prompt (never the latest's
        # resources: a version published meanwhile by someone else is not this run's base).
        self.base = base
        self.stats = optimizer.stats if optimizer is not None else APOStats()
        self.rng = random.Random(apo.seed)
        self.run_id = uuid.uuid4().hex[:12]
        self.pool: list[Candidate] = []
        self.train_runs: dict[tuple[int, str], Rollout] = {}
        self.train_order = self.rng.sample(ctx.train_tasks, len(ctx.train_tasks))
        val = ctx.val_tasks or ctx.train_tasks
        size = min(apo.val_batch_size or len(val), len(val))
        self.val_tasks = self.rng.sample(val, size) if size < len(val) else list(val)
        self.table = _table(apo.strategy)

    def start(self, prompt: str, version: int) -> None:
        seed = Candidate(prompt, version, round=0, parent=None, order=0, note="seed")
        self.pool.append(seed)
        seed.train = _mean(_scores(self._train(seed, self._batch(1), force=True) or [], self.apo.reward))
        self._validate(seed)
        self._record(seed)

    def round(self, r: int) -> bool:
        """One round of expansion; False when the budget ran out."""
        batch = self._batch(r)
        parents = (
            select_beam(self.pool, self.apo.beam_width)
            if self.apo.strategy == "beam"
            else _sample_front(pareto_front(self.pool), self.apo.beam_width, self.rng)
        )
        return all(self._expand(parent, batch, r) for parent in parents)

    def _expand(self, parent: Candidate, batch: list[Task], r: int) -> bool:
        runs = self._train(parent, batch)
        if runs is None:
            return False
        parent_train = _mean(_scores(runs, self.apo.reward))
        for _ in range(self.apo.branch_factor):
            if not self._afford(len(batch)):
                return False
            picked = pick_examples(runs, self.apo.max_examples, self.rng, self.apo.reward)
            records = [run_record(self.client, rollout, self.apo.reward) for rollout in picked]
            seen = {c.prompt for c in self.pool}
            assert self.optimizer is not None  # the rewrite method always has one
            prompt = self.optimizer.propose(parent.prompt, records, seen, self.apo.max_example_chars)
            if prompt is None:
                self.stats.skipped_candidates += 1
                self._row("-", str(parent.version), note="skipped: no usable rewrite", r=r)
            elif not self._child(prompt, parent, batch, parent_train, r):
                return False
        return True

    def _child(
        self, prompt: str, parent: Candidate, batch: list[Task], parent_train: float | None, r: int
    ) -> bool:
        version = self._publish(prompt, {"stage": "trial", "round": r, "parent": parent.version})
        child = Candidate(prompt, version, round=r, parent=parent.version, order=len(self.pool))
        self.pool.append(child)
        child.train = _mean(_scores(self._train(child, batch, force=True) or [], self.apo.reward))
        # gated only when both were scored: a batch whose runs were all left out proves nothing
        no_better = child.train is not None and parent_train is not None and child.train <= parent_train
        if self.apo.strategy == "pareto" and no_better:
            child.note = "gated: no better than its parent on the batch"
        elif self._afford(len(self.val_tasks)):
            self._validate(child)
        else:
            child.note = "budget spent before validation"
        self._record(child)
        return not self.stats.budget_exhausted

    def _afford(self, n: int) -> bool:
        budget = self.apo.rollout_budget
        if budget is not None and self.stats.rollouts + n > budget:
            self.stats.budget_exhausted = True
        return not self.stats.budget_exhausted

    def _batch(self, r: int) -> list[Task]:
        tasks, size = self.train_order, min(self.apo.train_batch_size, len(self.train_order))
        start = (r - 1) * size
        return [tasks[(start + i) % len(tasks)] for i in range(size)]

    def _rollouts(self, cand: Candidate, tasks: list[Task], mode: Mode) -> list[Rollout]:
        self.stats.rollouts += len(tasks)
        console = self.ctx.console if self.ctx.console.is_terminal else None  # no bars in a log file
        batch = run_rollouts(
            self.client,
            tasks,
            mode=mode,
            resources_version=cand.version,
            timeout=self.apo.batch_timeout,
            rollout_timeout=self.apo.rollout_timeout,
            max_attempts=self.apo.max_attempts,
            console=console,
            label=f"v{cand.version} {mode.value}",
            metadata={"algorithm": "apo", "run": self.run_id, "round": cand.round},
            rewards=self.apo.reward_plan(),
        )
        self.stats.stragglers += batch.timed_out
        self.stats.reward_pending += batch.reward_pending
        self.stats.reward_errors += batch.reward_errors
        if batch.evaluation is not None:
            self.stats.judge_calls += batch.evaluation.calls
            self.stats.judge_tokens += batch.evaluation.tokens
        return batch.rollouts

    def _train(self, cand: Candidate, batch: list[Task], force: bool = False) -> list[Rollout] | None:
        """The candidate's runs on ``batch``, run once per task (None: over budget)."""
        missing = [t for t in batch if (cand.version, t.id) not in self.train_runs]
        if missing and not force and not self._afford(len(missing)):
            return None
        for rollout in self._rollouts(cand, missing, Mode.TRAIN) if missing else []:
            self.train_runs[(cand.version, rollout.task.id)] = rollout
        return [self.train_runs[(cand.version, t.id)] for t in batch]

    def _validate(self, cand: Candidate) -> None:
        rollouts = self._rollouts(cand, self.val_tasks, Mode.VAL)
        scores = {r.task.id: score_of(r, self.apo.reward) for r in rollouts}
        cand.val_by_task = {task: s for task, s in scores.items() if s is not None}
        cand.val = _mean(list(cand.val_by_task.values()))
        if cand.val is None:
            cand.note = "; ".join(filter(None, [cand.note, "no validation run scored"]))

    def _publish(
        self,
        prompt: str,
        metadata: dict[str, Any],
        trial: bool = True,
        turns: dict[str, list[dict[str, Any]]] | None = None,
    ) -> int:
        """A version of the base resources with ``prompt`` (and ``turns`` after each named LLM
        resource's own example turns); a trial unless it is the final best."""
        resources = dict(self.base.resources)
        old = resources.get(self.apo.prompt_resource)
        engine = old.engine if isinstance(old, PromptTemplate) else "f-string"
        resources[self.apo.prompt_resource] = PromptTemplate(template=prompt, engine=engine)
        for name, messages in (turns or {}).items():
            llm = resources[name]
            assert isinstance(llm, LLM)
            added = [ExampleTurn.model_validate(m) for m in messages]
            resources[name] = llm.model_copy(update={"examples": [*llm.examples, *added]})
        meta = {
            "algorithm": "apo",
            "run": self.run_id,
            "prompt_resource": self.apo.prompt_resource,
            **metadata,
        }
        return self.client.publish_resources(resources, meta, trial=trial).version

    def _scores_meta(self, cand: Candidate, stage: str) -> dict[str, Any]:
        return {
            "stage": stage,
            "round": cand.round,
            "parent": cand.parent,
            "candidate": cand.version,
            "scores": {"train": cand.train, "val": cand.val},
            **cand.extra,
        }

    def _record(self, cand: Candidate) -> None:
        cand.record_version = self._publish(cand.prompt, self._scores_meta(cand, "scored"), turns=cand.turns)
        self._row(str(cand.version), str(cand.parent or "-"), cand.train, cand.val, cand.note, cand.round)

    def _row(
        self,
        version: str,
        parent: str,
        train: float | None = None,
        val: float | None = None,
        note: str = "",
        r: int = 0,
    ) -> None:
        best = max(self.pool, key=Candidate.rank)
        cells = (str(r), version, parent, _fmt(train), _fmt(val), f"{_fmt(best.val)} (v{best.version})", note)
        self.table.add_row(*cells)
        if not self.ctx.console.is_terminal:
            print_line(self.ctx.console, "APO " + " | ".join(cells))

    def finish(self) -> APOResult:
        best, seed = max(self.pool, key=Candidate.rank), self.pool[0]
        published = self._publish(best.prompt, self._scores_meta(best, "best"), trial=False, turns=best.turns)
        beam = self.apo.strategy == "beam"
        front = select_beam(self.pool, self.apo.beam_width) if beam else pareto_front(self.pool)
        return APOResult(
            best_prompt=best.prompt,
            best_version=best.version,
            published_version=published,
            seed_prompt=seed.prompt,
            seed_version=seed.version,
            seed_val=seed.val,
            best_val=best.val,
            history=list(self.pool),
            front=[c.version for c in front],
            stats=self.stats,
            best_turns=best.turns,
        )


def _fmt(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _table(strategy: str) -> Table:
    table = Table(title=f"APO ({strategy})")
    for column in ("round", "candidate", "parent", "train", "val", "best so far", "note"):
        table.add_column(column, justify="left" if column == "note" else "right")
    return table


def report(console: Console, result: APOResult, table: Table | None) -> None:
    if table is not None:
        console.print(table)
    title = f"best prompt: version {result.best_version}, val {_fmt(result.best_val)} (seed {_fmt(result.seed_val)})"
    console.print(Panel(result.best_prompt, title=title))
    seed, best = result.seed_prompt.splitlines(), result.best_prompt.splitlines()
    diff = "\n".join(difflib.unified_diff(seed, best, "seed", "best", lineterm=""))
    for name, turns in result.best_turns.items():
        console.print(
            Panel(render_conversation(turns), title=f"example turns added to LLM resource {name!r}")
        )
    if not diff:
        console.print(
            "(the seed's prompt, with example turns)"
            if result.best_turns
            else "(the seed prompt won: no change)"
        )
    else:
        console.print(Syntax(diff, "diff"))
    console.print(f"APO stats: {result.stats.as_dict()}")
