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
3. **Search.** ``trials`` candidates, each an instruction followed by up to ``max_demos``
   demonstrations: the first is the seed instruction with the first demonstrations found, the
   others a random instruction with a random number of randomly drawn demonstrations. Each is
   scored on the validation batch through the real runners, pinned to a trial resources
   version. The seed is scored too and wins ties, so the result never scores below it.

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
from agentbolt.algorithms.apo_search import Candidate, Search
from agentbolt.schemas import PromptTemplate

if TYPE_CHECKING:
    from agentbolt.client import Client
    from agentbolt.schemas import Rollout

__all__ = ["Demo", "compose", "demonstrations", "render_conversation", "run_bootstrap"]

HEADER = "Examples of solved tasks:"
POOL = 4
"""Bootstrapping stops once ``POOL * max_demos`` demonstrations are found."""
DRAWS = 50
"""Random draws tried for a candidate not scored before, before the search stops."""
_ROLES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


@dataclass(frozen=True)
class Demo:
    """One successful run, as a worked example."""

    task_id: str
    text: str
    """The conversation as plain text, one ``Role: content`` line per message."""


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "").strip()
    calls = [
        f"[calls {c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})]"
        for c in message.get("tool_calls") or []
    ]
    return " ".join([text, *calls]).strip()


def render_conversation(messages: Sequence[dict[str, Any]]) -> str:
    """``User: ...`` / ``Assistant: ...`` / ``Tool: ...`` lines, one per message."""
    return "\n".join(f"{_ROLES.get(str(m.get('role')), str(m.get('role')))}: {_content(m)}" for m in messages)


def _conversation(client: Client, rollout: Rollout) -> list[dict[str, Any]]:
    """The longest conversation the system recorded for the rollout's last attempt, without
    system (or developer) messages; empty when nothing was recorded."""
    events = latest_attempt(client.all_events(rollout.id, type=["llm_call"]))
    rows = to_chat_rows(events)
    if not rows:
        return []
    messages = max(rows, key=lambda row: len(row["messages"]))["messages"]
    return [m for m in messages if m.get("role") not in ("system", "developer")]


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
    runs = [(r, _conversation(client, r)) for r in rollouts]
    runs = [(r, c) for r, c in runs if any(m.get("role") == "assistant" for m in c)]
    skip = _shared_prefix([c for _, c in runs])
    demos, seen = list[Demo](), set[str]()
    for rollout, conversation in runs:
        score = score_of(rollout, choice)
        if score is None or score < min_score:
            continue
        text = render_conversation(conversation[skip:])
        if len(text) <= max_chars and text not in seen:
            seen.add(text)
            demos.append(Demo(rollout.task.id, text))
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


class _Bootstrap:
    """One bootstrap run over the rewrite method's search state (pool, records, budget)."""

    def __init__(self, search: Search, f_string: bool) -> None:
        self.s, self.apo, self.f_string = search, search.apo, f_string
        self.demos: list[Demo] = []
        self.next_task = 0

    def compose(self, instruction: str, demos: Sequence[Demo]) -> str:
        return compose(instruction, demos, self.f_string)

    def candidate(self, prompt: str, note: str, extra: dict[str, Any], r: int) -> Candidate:
        """The pool's candidate of ``prompt``, else a new trial version of it."""
        for cand in self.s.pool:
            if cand.prompt == prompt:
                return cand
        meta = {"stage": "trial", "round": r, "parent": self.s.pool[0].version, **extra}
        version = self.s._publish(prompt, meta)
        cand = Candidate(prompt, version, round=r, parent=self.s.pool[0].version, order=len(self.s.pool))
        cand.note, cand.extra = note, extra
        self.s.pool.append(cand)
        return cand

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
            shown = self.demos[: self.apo.max_demos]
            prompt = seed.prompt if r == 0 or not shown else self.compose(seed.prompt, shown)
            extra = {"method": "bootstrap", "demos": [d.task_id for d in shown]}
            cand = seed if prompt == seed.prompt else self.candidate(prompt, "bootstrap", extra, 0)
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

    def draw(self, trial: int, instructions: Sequence[str]) -> tuple[str, list[Demo], int] | None:
        """A candidate not validated before: (prompt, its demonstrations, its instruction)."""
        rng, most = self.s.rng, min(self.apo.max_demos, len(self.demos))
        scored = {c.prompt for c in self.s.pool if c.val is not None}
        for attempt in range(DRAWS):
            if trial == 1 and attempt == 0:
                which, demos = 0, self.demos[:most]
            else:
                which = rng.randrange(len(instructions))
                demos = rng.sample(self.demos, rng.randint(1, most)) if most else []
            prompt = self.compose(instructions[which], demos)
            while len(prompt) > self.apo.max_prompt_chars and demos:
                demos = demos[:-1]
                prompt = self.compose(instructions[which], demos)
            if prompt not in scored:
                return prompt, demos, which
        return None

    def search(self, instructions: Sequence[str]) -> None:
        for trial in range(1, self.apo.trials + 1):
            drawn = self.draw(trial, instructions)
            if drawn is None or not self.s._afford(len(self.s.val_tasks)):
                break
            prompt, demos, which = drawn
            extra = {"method": "bootstrap", "demos": [d.task_id for d in demos], "instruction": which}
            note = f"{len(demos)} demos ({', '.join(d.task_id for d in demos) or '-'}), instruction {which}"
            cand = self.candidate(prompt, note, extra, trial)
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
