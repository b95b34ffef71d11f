"""Built-in tasks: an agent, its environment, its reward and disjoint train / held-out problems.

``agentbolt demo --task NAME`` trains on one of them; ``benchmarks/credit_assignment.py`` and the
tests use them too. Each task is plain agent code over the OpenAI client, run like any user agent.

- ``calculator`` (the quick default): one tool call, then the answer; two model turns.
- ``chain``: four operations given one at a time, one calculator call each, carrying results;
  six model turns at most, a step reward per correct call. The multi-turn task (see ``docs/training.md`` for the
  measurements that chose it).
- ``guess``: find a hidden number from higher/lower hints; five guesses at most.

Environments other projects wrote are tasks too, named by a spec (:mod:`agentbolt.tasks.external`):
``get_task("reasoning_gym:spell_backward?max_word_len=4")`` (a reasoning-gym dataset, scored by its
own scorer) or ``get_task("gymnasium:FrozenLake-v1?map_size=4")`` (a Gymnasium toy-text environment,
one model turn per step). They need ``pip install 'agentbolt[envs]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentbolt.schemas import Task
from agentbolt.tasks import calculator, chain, guess
from agentbolt.tasks.base import Episode, Split, TextGameAgent, split_of

__all__ = ["TASKS", "BuiltinTask", "Episode", "TextGameAgent", "get_task", "split_of"]


@dataclass(frozen=True)
class BuiltinTask:
    name: str
    summary: str
    system_prompt: str
    worked: list[dict[str, str]]
    episode: Callable[[dict[str, Any]], Episode]
    make_tasks: Callable[[int, int, Split], list[Task]]
    max_tokens: int = 24

    def agent(self) -> TextGameAgent:
        agent = TextGameAgent(self.episode, self.worked, self.system_prompt)
        agent.max_tokens = self.max_tokens
        return agent

    def train_tasks(self, n: int = 256, seed: int = 1) -> list[Task]:
        return self.make_tasks(n, seed, "train")

    def heldout_tasks(self, n: int = 96, seed: int = 2) -> list[Task]:
        return self.make_tasks(n, seed, "heldout")


TASKS: dict[str, BuiltinTask] = {
    "calculator": BuiltinTask(
        "calculator",
        "one calculator call, then the answer, two turns",
        calculator.SYSTEM_PROMPT,
        calculator.WORKED_EPISODE,
        calculator.CalculatorEpisode,
        calculator.make_tasks,
    ),
    "chain": BuiltinTask(
        "chain",
        "four operations, one calculator call each, then the answer, up to six turns",
        chain.SYSTEM_PROMPT,
        chain.WORKED_EPISODE,
        chain.ChainEpisode,
        chain.make_tasks,
    ),
    "guess": BuiltinTask(
        "guess",
        "find a hidden number from higher/lower hints, up to five guesses",
        guess.SYSTEM_PROMPT,
        guess.WORKED_EPISODE,
        guess.GuessEpisode,
        guess.make_tasks,
    ),
}


def get_task(name: str) -> BuiltinTask:
    """The built-in task ``name``, or the external task a spec names (``reasoning_gym:<dataset>?...``,
    ``gymnasium:<env id>?...``); ValueError naming the choices otherwise, MissingExtra when the
    spec's package is not installed."""
    from agentbolt.tasks.external import SPEC_FORMS, external_task, is_spec

    if is_spec(name):
        return external_task(name)
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; choose one of: {', '.join(TASKS)}, or a spec: {SPEC_FORMS}"
        ) from None
