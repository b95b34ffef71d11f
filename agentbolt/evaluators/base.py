"""Evaluators: what scores a finished rollout from outside the agent.

An :class:`Evaluator` has a name (the reward it writes, e.g. ``"judge"``), a scale and one
method, :meth:`Evaluator.judge`, that turns records into :class:`Judgement` values. Three kinds
ship with agentbolt:

- :class:`FunctionEvaluator`: a scoring function (plain or async) that reads the record;
- :class:`~agentbolt.evaluators.judge.PointwiseJudge` and
  :class:`~agentbolt.evaluators.judge.GroupJudge`: a model judges with a rubric;
- :class:`HumanReview`: a person scores in the dashboard or with ``agentbolt review``. It is
  not automatic: nothing runs it, it only declares the reward a rollout waits for.

A judgement that could not be made (a malformed answer, a timeout, an exhausted budget, a
scoring function that raised) is a value with ``error`` set, never an exception: it is written
as a reward in state ``error``, which algorithms count and exclude, never read as zero.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.evaluators.record import RolloutRecord
from agentbolt.schemas import REWARD_NAME, AwaitedReward, RewardScale, RewardSource

__all__ = ["Evaluator", "FunctionEvaluator", "HumanReview", "Judgement", "checked_name"]


@dataclass(frozen=True)
class Judgement:
    """One evaluator's verdict on one rollout."""

    score: float | None
    """On the evaluator's scale; None when ``error`` is set."""
    reason: str = ""
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    """What the score rests on, stored with it: a judge's calls, its reason, the transcript cut."""

    @classmethod
    def failed(cls, error: str, **data: Any) -> Judgement:
        return cls(score=None, error=error, data=data)


class Evaluator(ABC):
    """Scores finished rollouts; writes the named reward ``name`` on ``scale``.

    A *group* evaluator (``group = True``) gets the records of one group (e.g. a GRPO group)
    at once and scores them relative to each other; others get any batch of records. Either way
    :meth:`judge` returns one judgement per record, in order."""

    name: str
    scale: RewardScale
    group: bool = False
    automatic: bool = True
    """False for a reward a person gives: evaluation runs skip it, rollouts still await it."""

    def awaited(self) -> AwaitedReward:
        """The slot a rollout should be enqueued with (``RolloutCreate.await_rewards``)."""
        if self.automatic:
            return AwaitedReward(name=self.name, source=RewardSource.EVALUATOR, scale=self.scale)
        return AwaitedReward(name=self.name, source=RewardSource.REVIEWER, scale=self.scale)

    def config(self) -> dict[str, Any]:
        """What makes this evaluator's scores what they are (never a secret): the fingerprint's input."""
        return {"type": type(self).__name__, "name": self.name, "scale": self.scale.model_dump()}

    def fingerprint(self) -> str:
        """A hash of :meth:`config`: equal configurations judge alike (cache and idempotency keys)."""
        text = json.dumps(self.config(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def use_server(self, url: str | None, token: str | None) -> None:
        """Told the server an evaluation run writes to (a judge reaching its model through the
        server's judge proxy needs it); nothing by default."""
        return None

    @abstractmethod
    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        """One judgement per record, in order."""


def checked_name(name: str) -> str:
    """``name`` if it can name a reward; a ConfigError saying why not otherwise (refused when
    the evaluator is made, not at its first write)."""
    if name == "agent":
        raise ConfigError("'agent' names the rollout's own reward; give the evaluator another name")
    if not isinstance(name, str) or not re.fullmatch(REWARD_NAME, name):
        raise ConfigError(
            f"reward name {name!r} is not valid: 1-64 letters, digits and _ . : - (starting with a letter or digit)"
        )
    return name


ScoreFn = Callable[[RolloutRecord], float | Awaitable[float]]


class FunctionEvaluator(Evaluator):
    """A scoring function outside the agent: ``fn(record) -> float`` (plain or async), on
    ``scale``. An exception or a score off the scale becomes an error judgement naming it.

    A plain function runs on the event loop's thread: keep it quick, or make it async."""

    def __init__(self, fn: ScoreFn, name: str = "score", scale: RewardScale | None = None) -> None:
        if not callable(fn):
            raise ConfigError(f"FunctionEvaluator needs a function of a record, got {fn!r}")
        self.fn, self.name, self.scale = fn, checked_name(name), scale or RewardScale()

    def config(self) -> dict[str, Any]:
        code = getattr(self.fn, "__code__", None)
        return {
            **super().config(),
            "fn": f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}",
            "code": hashlib.sha256(code.co_code).hexdigest()[:16] if code is not None else None,
        }

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        return [await self._one(record) for record in records]

    async def _one(self, record: RolloutRecord) -> Judgement:
        try:
            score = self.fn(record)
            if inspect.isawaitable(score):
                score = await score
            value = float(score)
            self.scale.check(value)
        except Exception as exc:
            return Judgement.failed(
                f"scoring function {self.config()['fn']} failed: {type(exc).__name__}: {exc}"
            )
        return Judgement(score=value)


class HumanReview(Evaluator):
    """A reward a person gives (``agentbolt review`` or the dashboard's review page): rollouts
    await it, a reviewer token writes it. ``instructions`` tell the reviewer what to score."""

    automatic = False

    def __init__(self, name: str = "human", scale: RewardScale | None = None, instructions: str = "") -> None:
        self.name = checked_name(name)
        self.scale = scale or RewardScale(low=1, high=5, step=1)
        self.instructions = instructions

    def config(self) -> dict[str, Any]:
        return {**super().config(), "instructions": self.instructions}

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        raise TypeError(
            f"reward {self.name!r} is given by people (agentbolt review, or the dashboard's review page);"
            " no code runs it"
        )
