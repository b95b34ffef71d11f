"""Which reward an algorithm trains on, and how it reads one that may not be there yet.

A rollout carries the agent's own reward (``Rollout.reward``, named ``"agent"``) and any number
of named rewards given after its run (``Rollout.rewards``: a judge's, a person's). An algorithm
is told which to use with a :data:`RewardChoice`: ``"agent"`` (the default: what every algorithm
read before named rewards existed), one name (``"judge"``, ``"human"``), or weights
(``{"agent": 0.5, "judge": 0.5}``: the weighted sum of the values, every part scored).

:func:`resolve` reads the choice off one rollout. A reward still pending, one its evaluator
could not give (error) or one the rollout does not have (missing) has no value: the
algorithms leave such rollouts out and count them; none is ever read as a zero.

:class:`RewardPlan` is what an algorithm holds: the choice, the evaluators that give named
rewards (run in this process after each batch when automatic, or by a worker or a reviewer
elsewhere) and how long to wait for the rewards still pending.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rich.console import Console
from rich.progress import Progress

from agentbolt.console import task_bars
from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator
from agentbolt.schemas import (
    REWARD_NAME,
    AwaitedReward,
    RewardSource,
    RewardState,
    Rollout,
    RolloutStatus,
)

if TYPE_CHECKING:
    from agentbolt.client import Client
    from agentbolt.evaluators import EvaluationReport

__all__ = [
    "AGENT",
    "ResolvedReward",
    "RewardChoice",
    "RewardOptions",
    "RewardPlan",
    "RewardTally",
    "awaited_for",
    "check_choice",
    "parse_choice",
    "resolve",
    "reward_names",
    "tally",
    "wait_for_rewards",
]

AGENT = "agent"
"""The name of the rollout's own reward (``Rollout.reward``)."""

RewardChoice = str | Mapping[str, float]
"""``"agent"``, a named reward, or weights over names (``{"agent": 0.5, "judge": 0.5}``)."""

ResolvedState = Literal["ok", "pending", "error", "missing"]

_NAME = re.compile(REWARD_NAME)


@dataclass(frozen=True)
class ResolvedReward:
    """The chosen reward of one rollout: a value only when ``state`` is ``ok``."""

    value: float | None
    state: ResolvedState

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def _one(rollout: Rollout, name: str) -> ResolvedReward:
    if name == AGENT:
        reward = rollout.reward
        return ResolvedReward(float(reward), "ok") if reward is not None else ResolvedReward(None, "missing")
    slot = rollout.rewards.get(name)
    if slot is None:
        return ResolvedReward(None, "missing")
    if slot.state == RewardState.PENDING:
        return ResolvedReward(None, "pending")
    if slot.state == RewardState.ERROR or slot.value is None:
        return ResolvedReward(None, "error")
    return ResolvedReward(slot.value, "ok")


# When parts of a weighted choice disagree, the first state here decides: a part that errored
# or is missing will not come by waiting, so the whole is that, not pending.
_PRECEDENCE: tuple[ResolvedState, ...] = ("error", "missing", "pending")


def resolve(rollout: Rollout, choice: RewardChoice = AGENT) -> ResolvedReward:
    """``choice`` read off ``rollout``: the agent's reward, a slot's 0-1 value, or the weighted
    sum of several (all of them scored, else the first of error, missing, pending)."""
    if isinstance(choice, str):
        return _one(rollout, choice)
    parts = {name: _one(rollout, name) for name in choice}
    for state in _PRECEDENCE:
        if any(p.state == state for p in parts.values()):
            return ResolvedReward(None, state)
    return ResolvedReward(sum(w * (parts[n].value or 0.0) for n, w in choice.items()), "ok")


@dataclass(frozen=True)
class RewardTally:
    """How the chosen reward stands over the succeeded rollouts of a batch."""

    ok: int = 0
    pending: int = 0
    errors: int = 0
    missing: int = 0

    def metrics(self) -> dict[str, int]:
        """The counts every algorithm logs (``metrics.jsonl``, its table)."""
        return {"reward_pending": self.pending, "reward_errors": self.errors}


def tally(rollouts: Sequence[Rollout], choice: RewardChoice = AGENT) -> RewardTally:
    """Count the succeeded rollouts by the state of their chosen reward. Failed rollouts are
    not counted: they have nothing to score, and a pending slot of theirs stays pending."""
    states = Counter(resolve(r, choice).state for r in rollouts if r.status == RolloutStatus.SUCCEEDED)
    return RewardTally(states["ok"], states["pending"], states["error"], states["missing"])


def reward_names(choice: RewardChoice) -> list[str]:
    """The named rewards (slots) ``choice`` reads; ``agent`` is not one."""
    names = [choice] if isinstance(choice, str) else list(choice)
    return [n for n in names if n != AGENT]


def check_choice(choice: RewardChoice) -> RewardChoice:
    """``choice`` if well formed, else a :class:`ConfigError` saying what is wrong with it."""
    if isinstance(choice, str):
        if not _NAME.match(choice):
            raise ConfigError(f"reward: {choice!r} is not a reward name (letters, digits and _ . : -)")
        return choice
    if not isinstance(choice, Mapping) or not choice:
        raise ConfigError(f"reward: expected a name or weights by name, got {choice!r}")
    for name, weight in choice.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"reward: {name!r} is not a reward name (letters, digits and _ . : -)")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ConfigError(f"reward: the weight of {name!r} must be a finite number, got {weight!r}")
    return dict(choice)


def parse_choice(text: str) -> RewardChoice:
    """A choice as a command line gives it: ``judge``, or ``agent=0.5,judge=0.5``."""
    if "=" not in text:
        return check_choice(text.strip())
    weights: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        try:
            weights[name.strip()] = float(weight)
        except ValueError:
            raise ConfigError(f"--reward: {part!r} must look like NAME=WEIGHT, e.g. judge=0.5") from None
    return check_choice(weights)


def awaited_for(choice: RewardChoice, evaluators: Sequence[Evaluator] = ()) -> list[AwaitedReward]:
    """What each rollout is enqueued awaiting (``RolloutCreate.await_rewards``): every
    evaluator's reward, automatic ones too (a worker elsewhere finds them pending), and any name
    ``choice`` reads that no evaluator here gives, awaited from an evaluator outside (an
    ``agentbolt judge`` worker) on the 0-1 scale."""
    awaited = [e.awaited() for e in evaluators]
    names = [a.name for a in awaited]
    if len(set(names)) != len(names):
        raise ConfigError(f"two evaluators give the same reward name: {names}")
    awaited += [
        AwaitedReward(name=n, source=RewardSource.EVALUATOR) for n in reward_names(choice) if n not in names
    ]
    return awaited


def _refresh(client: Client, current: dict[str, Rollout], ids: Sequence[str]) -> None:
    """Reread ``ids`` (final already, so the wait answers at once, with their rewards)."""
    for at in range(0, len(ids), 2000):
        for rollout in client.wait(ids[at : at + 2000], timeout=0.1).rollouts:
            current[rollout.id] = rollout


def _waiting(current: dict[str, Rollout], names: Sequence[str]) -> list[tuple[str, RewardSource]]:
    """(rollout id, source) of each pending slot among ``names`` of a succeeded rollout."""
    return [
        (r.id, r.rewards[n].source)
        for r in current.values()
        if r.status == RolloutStatus.SUCCEEDED
        for n in names
        if n in r.rewards and r.rewards[n].state == RewardState.PENDING
    ]


def _describe(waiting: Sequence[tuple[str, RewardSource]]) -> str:
    by_source = Counter(source for _, source in waiting)
    words = {RewardSource.REVIEWER: "human", RewardSource.EVALUATOR: "judge"}
    return ", ".join(f"{n} {words.get(s, s.value)} score{'s' * (n != 1)}" for s, n in by_source.items())


def wait_for_rewards(
    client: Client,
    rollouts: Sequence[Rollout],
    names: Sequence[str],
    timeout: float,
    console: Console | None = None,
    *,
    poll: float = 1.0,
    progress: Progress | None = None,
) -> list[Rollout]:
    """``rollouts`` reread, as they stand once none of ``names`` is pending on a succeeded one or
    ``timeout`` seconds passed. They are reread once even with ``timeout`` 0: rewards written
    since they were read (by evaluators run in this process) are then seen. A bar says what is
    awaited ("waiting for 3 human scores"), on ``progress`` (a display the caller runs) or its own."""
    current = {r.id: r for r in rollouts}
    _refresh(client, current, list(current))
    deadline = time.monotonic() + timeout
    waiting = _waiting(current, names)
    if not (waiting and timeout > 0):
        return [current[r.id] for r in rollouts]
    bars = progress or task_bars(console)
    with contextlib.nullcontext() if progress else bars:
        total = len(waiting)
        bar = bars.add_task(f"waiting for {_describe(waiting)}", total=total, info="")
        while waiting and time.monotonic() < deadline:
            time.sleep(max(0.0, min(poll, deadline - time.monotonic())))
            _refresh(client, current, sorted({rid for rid, _ in waiting}))
            waiting = _waiting(current, names)
            description = f"waiting for {_describe(waiting)}" if waiting else "rewards in"
            bars.update(bar, completed=total - len(waiting), description=description)
        if progress:
            bars.remove_task(bar)
    return [current[r.id] for r in rollouts]


@dataclass(frozen=True)
class RewardPlan:
    """What an algorithm trains on (``choice``), who gives the named rewards (``evaluators``)
    and how long a batch waits for those still pending after the automatic evaluators ran
    (``wait`` seconds; 0: use what arrived)."""

    choice: RewardChoice = AGENT
    evaluators: Sequence[Evaluator] = ()
    wait: float = 0.0

    def __post_init__(self) -> None:
        check_choice(self.choice)
        if not (math.isfinite(self.wait) and self.wait >= 0):
            raise ConfigError(f"reward_wait must be >= 0 seconds, got {self.wait}")
        awaited_for(self.choice, self.evaluators)  # distinct names, checked once here

    @property
    def is_agent_only(self) -> bool:
        """The agent's own reward and nothing else: batches need no second look."""
        return self.choice == AGENT and not self.evaluators

    def awaited(self) -> list[AwaitedReward]:
        return awaited_for(self.choice, self.evaluators)

    def settle(
        self,
        client: Client,
        rollouts: Sequence[Rollout],
        console: Console | None,
        progress: Progress | None = None,
    ) -> tuple[list[Rollout], EvaluationReport | None]:
        """Run the automatic evaluators on the finished ``rollouts``, wait up to ``wait`` for the
        chosen rewards still pending, and return the rollouts reread (as given when the plan is
        the agent's reward alone) with what the evaluators did (None when none ran here).
        ``progress``: a display the caller runs, for the wait's bar."""
        if self.is_agent_only:
            return list(rollouts), None
        automatic = [e for e in self.evaluators if e.automatic]
        report = None
        if automatic and rollouts:
            from agentbolt.evaluators import evaluate_rollouts

            report = evaluate_rollouts(client, list(rollouts), automatic, console=console, progress=progress)
        names = reward_names(self.choice)
        return wait_for_rewards(client, rollouts, names, self.wait, console, progress=progress), report


@dataclass
class RewardOptions:
    """The reward settings every algorithm shares (its dataclass inherits them)."""

    reward: RewardChoice = AGENT
    """Which reward to train on: ``agent`` (the rollout's own), a named reward (``judge``,
    ``human``) or weights (``agent=0.5,judge=0.5``: the weighted sum, every part scored). A
    rollout whose reward is pending or could not be given is left out and counted, never read
    as zero."""
    evaluators: Sequence[Evaluator] = ()
    """What gives the named rewards: automatic evaluators (judges, scoring functions) run here
    after each batch; a ``HumanReview`` is awaited from reviewers."""
    reward_wait: float = 0.0
    """Seconds a batch waits for chosen rewards still pending once the evaluators here ran
    (a person's score); 0: use what arrived."""

    def __post_init__(self) -> None:
        if isinstance(self.reward, str):  # a file or a flag may give weights as agent=0.5,judge=0.5
            self.reward = parse_choice(self.reward)
        self.evaluators = tuple(self.evaluators)
        self.reward_plan()  # checked when the algorithm is made, not after its first batch

    def reward_plan(self) -> RewardPlan:
        return RewardPlan(self.reward, self.evaluators, self.reward_wait)
