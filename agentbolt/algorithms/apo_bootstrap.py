"""Prompt optimization that needs no capable model: worked examples bootstrapped from the agent's
own successful runs, and a random search over sets of them (``APO(method="bootstrap")``, the
default; after DSPy's BootstrapFewShotWithRandomSearch, Khattab et al. 2023).

1. **Bootstrap.** The seed prompt runs on ``bootstrap_tasks`` training tasks. Each run whose
   chosen reward (``reward``: the runner's, a scorer's, a judge's or a person's) is at least
   ``demo_min_score`` gives a *demonstration*: its conversation as the gateway recorded it
   (``llm_call`` events the system wrote: :func:`agentbolt.adapters.to_chat_rows`), never text
   the agent posted about itself, without the system prompt and without the turns every run
   shares (an agent's own fixed examples). Later rounds (``bootstrap_rounds``) run the seed
   prompt with the demonstrations found so far on new training tasks: a model too weak to
   succeed unaided often succeeds once shown one success. Only training tasks give
   demonstrations; validation tasks never do.
2. **Instructions.** The seed prompt, the ``instructions`` the user gives, and, when an optimizer
   model is configured (``optimizer_model`` or ``optimizer_base_url``), ``branch_factor``
   rewrites of the seed from its bootstrap runs (the ``rewrite`` method's critique and rewrite).
3. **Search.** ``trials`` candidates, each an instruction with up to ``max_demos``
   demonstrations: the first is the seed instruction with the first demonstrations found, the
   others a random instruction with a random number of randomly drawn demonstrations. Each is
   scored on the validation batch through the real runners, pinned to a trial resources
   version. The seed is scored too and wins ties, so the result never scores below it.

How a candidate shows its demonstrations (``demos_as``): by default as chat turns, the example
turns (``LLM.examples``, :mod:`agentbolt.turns`) of the LLM resource each was recorded through,
which the gateway puts into every call after the system prompt; the prompt resource holds the
instruction alone. A small model learns from turns and not from the same text in its prompt
(``docs/training.md``). ``demos_as="text"`` writes them into the prompt under :data:`HEADER`
instead, for an agent whose calls do not go through the gateway.

Records and budget are the ``rewrite`` method's (see :mod:`agentbolt.algorithms.apo`): trials are
trial versions, never the latest, each with a scored version in the dashboard (its score, its
prompt, and which demonstrations it holds); ``rollout_budget`` counts every run, bootstrap
included (a bootstrap round runs only while the seed's validation and one trial still fit in
it); the best prompt is published as the latest at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbolt.adapters import latest_attempt, to_chat_rows
from agentbolt.algorithms.apo_optimizer import pick_examples, run_record, score_of
from agentbolt.algorithms.apo_search import Candidate, Search, candidate_key
from agentbolt.schemas import LLM, MAX_EXAMPLE_TURNS, PromptTemplate
from agentbolt.turns import render_conversation

if TYPE_CHECKING:
    from agentbolt.client import Client
    from agentbolt.schemas import Rollout

__all__ = ["Demo", "compose", "demonstrations", "render_conversation", "run_bootstrap"]

HEADER = "Examples of solved tasks:"
POOL = 4
"""Bootstrapping stops once ``POOL * max_demos`` demonstrations are found."""
DRAWS = 50
"""Random draws tried for a candidate not scored before, before the search stops."""


@dataclass(frozen=True)
class Demo:
    """One successful run, as a worked example."""

    task_id: str
    text: str
    """The conversation as plain text, one ``Role: content`` line per message."""
    resource: str = ""
    """The LLM resource its conversation was recorded through."""
    messages: tuple[dict[str, Any], ...] = ()
    """The conversation as chat messages (user, assistant, tool)."""


def _conversation(client: Client, rollout: Rollout) -> tuple[str, list[dict[str, Any]]]:
    """The longest conversation the system recorded for the rollout's last attempt, and the LLM
    resource it went through, without system (or developer) messages and without the example
    turns the gateway put in; empty when nothing was recorded."""
    events = latest_attempt(client.all_events(rollout.id, type=["llm_call"]))
    found: tuple[str, list[dict[str, Any]]] = ("", [])
    for resource in dict.fromkeys(str(e.data.get("resource") or "") for e in events):
        rows = to_chat_rows(
            [e for e in events if str(e.data.get("resource") or "") == resource], examples=False
        )
        for row in rows:
            if len(row["messages"]) > len(found[1]):
                found = (resource, row["messages"])
    return found[0], [m for m in found[1] if m.get("role") not in ("system", "developer")]


def _shared_prefix(conversations: Sequence[list[dict[str, Any]]]) -> int:
    """How many leading messages every conversation shares (an agent's fixed worked turns), as
    long as each keeps at least two of its own; 0 with fewer than two conversations."""
    if len(conversations) < 2:
        return 0
    n = 0
    shortest = min(len(c) for c in conversations)
    while n < shortest - 2 and all(c[n] == conversations[0][n] for c in conversations):
        n += 1
    return n


def demonstrations(
    client: Client, rollouts: Sequence[Rollout], min_score: float, max_chars: int, choice: Any
) -> list[Demo]:
    """The demonstrations ``rollouts`` give: the runs scored at least ``min_score`` on reward
    ``choice``, as text of at most ``max_chars`` (a longer one is left out, never cut), one per
    distinct conversation, in the order of ``rollouts``. The turns every run of the batch opens
    with (an agent's own fixed example turns) are left out of each."""
    runs = [(r, *_conversation(client, r)) for r in rollouts]
    runs = [(r, name, c) for r, name, c in runs if any(m.get("role") == "assistant" for m in c)]
    skip = _shared_prefix([c for _, _, c in runs])
    demos, seen = list[Demo](), set[str]()
    for rollout, resource, conversation in runs:
        score = score_of(rollout, choice)
        if score is None or score < min_score:
            continue
        text = render_conversation(conversation[skip:])
        if len(text) <= max_chars and text not in seen:
            seen.add(text)
            demos.append(Demo(rollout.task.id, text, resource, tuple(conversation[skip:])))
    return demos


def compose(instruction: str, demos: Sequence[Demo], f_string: bool) -> str:
    """The instruction, then the demonstrations under :data:`HEADER`; braces in them doubled
    when the prompt is an f-string template (they are text, not placeholders)."""
    if not demos:
        return instruction
    body = "\n\n".join(f"Example {i}:\n{d.text}" for i, d in enumerate(demos, 1))
    if f_string:
        body = body.replace("{", "{{").replace("}", "}}")
    return f"{instruction}\n\n{HEADER}\n\n{body}"


def as_turns(demos: Sequence[Demo]) -> dict[str, list[dict[str, Any]]]:
    """The demonstrations as example turns, by the LLM resource each was recorded through."""
    turns: dict[str, list[dict[str, Any]]] = {}
    for demo in demos:
        turns.setdefault(demo.resource, []).extend(demo.messages)
    return turns


class _Bootstrap:
    """One bootstrap run over the rewrite method's search state (pool, records, budget)."""

    def __init__(self, search: Search, f_string: bool) -> None:
        self.s, self.apo, self.f_string = search, search.apo, f_string
        self.demos: list[Demo] = []
        self.next_task = 0
        llms = {n: r for n, r in search.base.resources.items() if isinstance(r, LLM)}
        # room left for example turns in each LLM resource (a resource holds at most 64)
        self.room = {n: MAX_EXAMPLE_TURNS - len(r.examples) for n, r in llms.items()}

    def fits(self, instruction: str, demos: Sequence[Demo]) -> bool:
        """Whether the demonstrations, with the instruction, fit ``max_prompt_chars`` (and, as
        turns, the room their LLM resources have left)."""
        if len(compose(instruction, demos, self.f_string)) > self.apo.max_prompt_chars:
            return False
        turns = as_turns(demos) if self.apo.demos_as == "turns" else {}
        return all(n in self.room and len(m) <= self.room[n] for n, m in turns.items())

    def compose(self, instruction: str, demos: Sequence[Demo]) -> tuple[str, dict[str, list[dict[str, Any]]]]:
        """The candidate's prompt and example turns: the demonstrations as turns of their LLM
        resources (``demos_as="turns"``) or written into the prompt (``"text"``)."""
        if self.apo.demos_as == "turns":
            return instruction, as_turns(demos)
        return compose(instruction, demos, self.f_string), {}

    def candidate(
        self, composed: tuple[str, dict[str, list[dict[str, Any]]]], note: str, extra: dict[str, Any], r: int
    ) -> Candidate:
        """The pool's candidate of ``composed`` (a prompt and its turns), else a new trial of it."""
        prompt, turns = composed
        parent = self.s.pool[0].version
        new = Candidate(prompt, -1, round=r, parent=parent, order=len(self.s.pool), turns=turns)
        for cand in self.s.pool:
            if cand.key() == new.key():
                return cand
        meta = {"stage": "trial", "round": r, "parent": parent, **extra}
        new.version = self.s._publish(prompt, meta, turns=turns)
        new.note, new.extra = note, extra
        self.s.pool.append(new)
        return new

    def bootstrap(self, seed: Candidate) -> list[Rollout]:
        """Bootstrap rounds; the seed's own training runs (for the optimizer's rewrites)."""
        seed_runs: list[Rollout] = []
        tasks = self.s.train_order
        for r in range(self.apo.bootstrap_rounds):
            if len(self.demos) >= POOL * self.apo.max_demos:
                break
            size = min(self.apo.bootstrap_tasks, len(tasks) - self.next_task)
            budget = self.apo.rollout_budget
            reserve = 2 * len(self.s.val_tasks)  # the seed's validation and one trial's
            if size <= 0 or (budget is not None and self.s.stats.rollouts + size + reserve > budget):
                break
            batch = tasks[self.next_task : self.next_task + size]
            self.next_task += size
            shown = self.demos[: self.apo.max_demos] if r > 0 else []
            while shown and not self.fits(seed.prompt, shown):
                shown = shown[:-1]
            extra = {"method": "bootstrap", "demos": [d.task_id for d in shown]}
            cand = self.candidate(self.compose(seed.prompt, shown), "bootstrap", extra, 0) if shown else seed
            runs = self.s._train(cand, batch, force=True) or []
            if cand is seed:
                seed_runs += runs
            else:
                cand.train = _mean_score(runs, self.apo.reward)
                self.s._row(str(cand.version), str(seed.version), cand.train, None, "bootstrap", 0)
            known = {d.text for d in self.demos}
            found = demonstrations(
                self.s.client, runs, self.apo.demo_min_score, self.apo.max_example_chars, self.apo.reward
            )
            self.demos += [d for d in found if d.text not in known]
            self.s.stats.demos = len(self.demos)
        return seed_runs

    def instructions(self, seed: Candidate, runs: Sequence[Rollout]) -> list[str]:
        found = [seed.prompt, *(i for i in self.apo.instructions if i.strip())]
        optimizer = self.s.optimizer
        for _ in range(self.apo.branch_factor if optimizer is not None and runs else 0):
            picked = pick_examples(runs, self.apo.max_examples, self.s.rng, self.apo.reward)
            records = [run_record(self.s.client, rollout, self.apo.reward) for rollout in picked]
            new = optimizer.propose(seed.prompt, records, set(found), self.apo.max_example_chars)  # type: ignore[union-attr]
            if new is None:
                self.s.stats.skipped_candidates += 1
            else:
                found.append(new)
        return list(dict.fromkeys(found))

    def draw(
        self, trial: int, instructions: Sequence[str]
    ) -> tuple[tuple[str, dict[str, list[dict[str, Any]]]], list[Demo], int] | None:
        """A candidate not validated before: (its prompt and turns, its demonstrations, its
        instruction)."""
        rng, most = self.s.rng, min(self.apo.max_demos, len(self.demos))
        scored = {c.key() for c in self.s.pool if c.val is not None}
        for attempt in range(DRAWS):
            if trial == 1 and attempt == 0:
                which, demos = 0, self.demos[:most]
            else:
                which = rng.randrange(len(instructions))
                demos = rng.sample(self.demos, rng.randint(1, most)) if most else []
            while demos and not self.fits(instructions[which], demos):
                demos = demos[:-1]
            composed = self.compose(instructions[which], demos)
            if candidate_key(*composed) not in scored:
                return composed, demos, which
        return None

    def search(self, instructions: Sequence[str]) -> None:
        for trial in range(1, self.apo.trials + 1):
            drawn = self.draw(trial, instructions)
            if drawn is None or not self.s._afford(len(self.s.val_tasks)):
                break
            composed, demos, which = drawn
            extra = {
                "method": "bootstrap",
                "demos": [d.task_id for d in demos],
                "demos_as": self.apo.demos_as,
                "instruction": which,
            }
            note = f"{len(demos)} demos ({', '.join(d.task_id for d in demos) or '-'}), instruction {which}"
            cand = self.candidate(composed, note, extra, trial)
            cand.round, cand.note, cand.extra = trial, note, extra
            self.s._validate(cand)
            self.s._record(cand)


def run_bootstrap(search: Search, seed: Candidate) -> None:
    """The bootstrap method on ``search`` from ``seed`` (already in the pool, not yet scored)."""
    old = search.base.resources.get(search.apo.prompt_resource)
    boot = _Bootstrap(search, f_string=not isinstance(old, PromptTemplate) or old.engine == "f-string")
    runs = boot.bootstrap(seed)
    seed.train = _mean_score(runs, search.apo.reward)
    search._validate(seed)
    search._record(seed)
    if not boot.demos:
        search._row("-", "-", note="no successful training run to learn from: the seed is kept")
    boot.search(boot.instructions(seed, runs))


def _mean_score(runs: Sequence[Rollout], choice: Any) -> float | None:
    scores = [s for r in runs if (s := score_of(r, choice)) is not None]
    return sum(scores) / len(scores) if scores else None
