"""Model judges: any OpenAI-compatible chat model scores rollouts against a rubric.

- :class:`PointwiseJudge` reads one rollout and answers exactly two lines::

      SCORE: <a number between 0 and 1>
      REASON: <one sentence>

- :class:`GroupJudge` reads the N rollouts of a group (e.g. a GRPO group), numbered, and scores
  each relative to the others, one line per rollout ``<i>: <score between 0 and 1>``, then
  optionally one ``REASON:`` line. Every run's number appears exactly once.

The formats are strict: any other answer is *malformed*. It is asked again ``retries`` times
with a reminder of the format (the bad answer stays in the conversation), then given up on: the
judgement is an error ``malformed judge answer: <its first 200 characters>``, written as a
reward in state error (never a zero). A timeout or an HTTP error gives an error naming it.

Every call is recorded in the judgement's ``data["calls"]`` (request messages, answer, usage,
latency, cost when a price is given, cached or not); ``data["judge"]`` names the model and URL
(never the key) and ``data["cut"]`` the transcript cut (see
:func:`agentbolt.evaluators.record.transcript`).

The model, its cache and the budget shared by the judges of a run are in
:mod:`agentbolt.evaluators.model` (re-exported here).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator, Judgement, checked_name
from agentbolt.evaluators.model import BudgetExhausted, JudgeBudget, JudgeCall, JudgeModel, clear_cache
from agentbolt.evaluators.record import RolloutRecord, transcript
from agentbolt.schemas import RewardScale

__all__ = [
    "GROUP_EXAMPLE",
    "GROUP_SYSTEM",
    "POINTWISE_EXAMPLES",
    "POINTWISE_FORMAT",
    "POINTWISE_SYSTEM",
    "BudgetExhausted",
    "GroupJudge",
    "JudgeBudget",
    "JudgeCall",
    "JudgeModel",
    "Malformed",
    "PointwiseJudge",
    "clear_cache",
    "group_format",
    "parse_group",
    "parse_pointwise",
]

T = TypeVar("T")

POINTWISE_SYSTEM = """You are a strict evaluator of an AI agent's run. Read the rubric and the run, then judge how well \
the run meets the rubric: 0 is the worst, 1 the best.
Answer with exactly two lines and nothing else:
SCORE: <a number between 0 and 1>
REASON: <one sentence>"""

GROUP_SYSTEM = """You are a strict evaluator of an AI agent's runs. You see {n} runs of the agent on the same task. \
Read the rubric and every run, then score each run relative to the others: the best run gets the highest score, \
worse runs lower scores, equal runs equal scores, from 0 (worst) to 1 (best).
Answer with exactly one line per run, in this form, and nothing else:
{example}
You may add one last line: REASON: <one sentence>"""

POINTWISE_FORMAT = "Answer with exactly two lines and nothing else:\nSCORE: <a number between 0 and 1>\nREASON: <one sentence>"
POINTWISE_REMINDER = "Your answer did not follow the format ({why}). " + POINTWISE_FORMAT
GROUP_REMINDER = (
    "Your answer did not follow the format ({why}). Answer again with exactly one line per run "
    "(runs 1 to {n}), each '<run number>: <score between 0 and 1>', then optionally 'REASON: <one sentence>'."
)

# A worked example of the answer format, given as earlier turns of the conversation (few-shot):
# SmolLM2-135M answers the run's question itself when told the format only, and follows it
# when shown it once. Its rubric and runs have nothing to do with any real task.
_EXAMPLE_HEAD = "RUBRIC:\nThe run greets the user by name.\n\n"
_EXAMPLE_RUN = "[user] Hi, I am Ada.\n\nFINAL ANSWER:\n[assistant] {answer}"
_EXAMPLE_TASK = 'TASK:\n{\n "name": "Ada"\n}'
POINTWISE_EXAMPLES: tuple[tuple[str, str], ...] = tuple(
    (
        f"{_EXAMPLE_HEAD}THE RUN:\n{_EXAMPLE_TASK}\n\n{_EXAMPLE_RUN.format(answer=answer)}\n\n{POINTWISE_FORMAT}",
        verdict,
    )
    for answer, verdict in (
        ("Hello Ada!", "SCORE: 1\nREASON: The run greets Ada by her name."),
        ("Hello!", "SCORE: 0\nREASON: The run does not use the user's name."),
    )
)


def group_format(n: int) -> str:
    """The group judge's answer format for ``n`` runs."""
    lines = "\n".join(f"{i}: <score>" for i in range(1, n + 1))
    return f"Answer with exactly one line per run and nothing else:\n{lines}\nthen optionally: REASON: <one sentence>"


GROUP_EXAMPLE = (
    f"{_EXAMPLE_HEAD}THE TASK (the same for every run):\n{_EXAMPLE_TASK[len('TASK:') + 1 :]}\n\n"
    f"=== RUN 1 ===\n{_EXAMPLE_RUN.format(answer='Hello!')}\n\n"
    f"=== RUN 2 ===\n{_EXAMPLE_RUN.format(answer='Hello Ada!')}\n\n{group_format(2)}",
    "1: 0\n2: 1\nREASON: Only run 2 greets Ada by her name.",
)


_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_SCORE_LINE = re.compile(rf"SCORE:[ \t]*{_NUMBER}")
_REASON_LINE = re.compile(r"REASON:[ \t]*(\S.*)")
_GROUP_LINE = re.compile(rf"(\d+):[ \t]*{_NUMBER}")


# ---------------------------------------------------------------------------- strict parsing


class Malformed(ValueError):
    """A judge's answer is not in the format asked for; the message says how."""


def _unit_score(text: str) -> float:
    score = float(text)
    if not 0.0 <= score <= 1.0:
        raise Malformed(f"score {text} is not between 0 and 1")
    return score


def parse_pointwise(answer: str) -> tuple[float, str]:
    """``(score, reason)`` from exactly ``SCORE: <0-1>`` and ``REASON: <text>`` on two lines
    (whitespace around the answer and each line is allowed); Malformed otherwise."""
    lines = [line.strip() for line in answer.strip().splitlines()]
    if len(lines) != 2:
        raise Malformed(f"{len(lines)} lines instead of 2")
    score = _SCORE_LINE.fullmatch(lines[0])
    if score is None:
        raise Malformed(f"the first line is not 'SCORE: <number>': {lines[0][:80]!r}")
    reason = _REASON_LINE.fullmatch(lines[1])
    if reason is None:
        raise Malformed(f"the second line is not 'REASON: <sentence>': {lines[1][:80]!r}")
    return _unit_score(score.group(1)), reason.group(1).strip()


def parse_group(answer: str, n: int) -> tuple[list[float], str]:
    """``(scores of runs 1..n, reason)`` from one ``<i>: <score>`` line per run, every run
    exactly once, and an optional last ``REASON:`` line; Malformed otherwise."""
    lines = [line.strip() for line in answer.strip().splitlines()]
    reason = ""
    if lines and (found := _REASON_LINE.fullmatch(lines[-1])):
        reason = found.group(1).strip()
        lines.pop()
    scores: dict[int, float] = {}
    for line in lines:
        match = _GROUP_LINE.fullmatch(line)
        if match is None:
            raise Malformed(f"the line {line[:80]!r} is not '<run number>: <score>'")
        index = int(match.group(1))
        if not 1 <= index <= n:
            raise Malformed(f"run {index} does not exist (runs are 1 to {n})")
        if index in scores:
            raise Malformed(f"run {index} is scored twice")
        scores[index] = _unit_score(match.group(2))
    missing = [i for i in range(1, n + 1) if i not in scores]
    if missing:
        raise Malformed(f"no score for run{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    return [scores[i] for i in range(1, n + 1)], reason


# ---------------------------------------------------------------------------- the judges


@dataclass
class _Asked(Generic[T]):
    """What asking a judge gave: the parsed answer, or an error; every call made."""

    parsed: T | None
    calls: list[dict[str, Any]]
    error: str | None


def _parses(parse: Callable[[str], object]) -> Callable[[str], bool]:
    """``parse`` as a test of well-formedness (what the model's cache keeps)."""

    def valid(answer: str) -> bool:
        try:
            parse(answer)
        except Malformed:
            return False
        return True

    return valid


async def _ask(
    model: JudgeModel,
    budget: JudgeBudget | None,
    messages: list[dict[str, Any]],
    parse: Callable[[str], T],
    retries: int,
    reminder: Callable[[str], str],
) -> _Asked[T]:
    """Ask, and ask again ``retries`` times while the answer is malformed."""
    calls: list[dict[str, Any]] = []
    answer = ""
    for _ in range(retries + 1):
        try:
            call = await model.call(messages, budget, valid=_parses(parse))
        except BudgetExhausted as exc:
            return _Asked(None, calls, str(exc))
        calls.append(call.as_dict())
        if call.error is not None or call.answer is None:
            return _Asked(None, calls, call.error or "the judge gave no answer")
        answer = call.answer
        try:
            return _Asked(parse(answer), calls, None)
        except Malformed as exc:
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": reminder(str(exc))},
            ]
    return _Asked(None, calls, f"malformed judge answer: {answer[:200]}")


class _ModelJudge(Evaluator):
    """What both judges share: a rubric, a model, a budget, a transcript limit."""

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str,
        max_transcript_chars: int,
        retries: int,
        budget: JudgeBudget | None,
        examples: bool,
    ) -> None:
        if not rubric or not rubric.strip():
            raise ConfigError("a judge needs a rubric: what a good run does")
        if max_transcript_chars < 500:
            raise ConfigError(f"max_transcript_chars must be at least 500, got {max_transcript_chars}")
        if retries < 0:
            raise ConfigError(f"retries cannot be negative, got {retries}")
        self.rubric, self.model, self.name = rubric.strip(), model, checked_name(name)
        self.scale = RewardScale()
        self.max_transcript_chars, self.retries, self.budget = max_transcript_chars, retries, budget
        self.examples = examples

    def config(self) -> dict[str, Any]:
        prompt = [GROUP_SYSTEM, GROUP_EXAMPLE] if self.group else [POINTWISE_SYSTEM, POINTWISE_EXAMPLES]
        return {
            **super().config(),
            "rubric": self.rubric,
            "model": self.model.config(),
            "max_transcript_chars": self.max_transcript_chars,
            "retries": self.retries,
            "examples": self.examples,
            "prompt": hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:12],
        }

    def _conversation(
        self, system: str, examples: Sequence[tuple[str, str]], user: str
    ) -> list[dict[str, Any]]:
        """The system prompt, the worked examples as earlier turns (unless turned off), the request."""
        messages = [{"role": "system", "content": system}]
        for asked, answered in examples if self.examples else ():
            messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
        return [*messages, {"role": "user", "content": user}]

    def use_server(self, url: str | None, token: str | None) -> None:
        self.model.use_server(url, token)

    def _data(self, asked: _Asked[Any], cut: dict[str, int] | None, reason: str) -> dict[str, Any]:
        return {"reason": reason, "calls": asked.calls, "judge": self.model.describe(), "cut": cut}


class PointwiseJudge(_ModelJudge):
    """A model scores each rollout alone against ``rubric``, from 0 to 1, with a reason.

    ``max_transcript_chars``: the longest transcript shown (longer ones are cut, see
    :func:`~agentbolt.evaluators.record.transcript`); ``retries``: how many times a malformed
    answer is asked again; ``budget``: shared by the judges of a run; ``examples``: show a worked
    example of the answer format first (two short turns; small models need it)."""

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str = "judge",
        max_transcript_chars: int = 6000,
        retries: int = 1,
        budget: JudgeBudget | None = None,
        examples: bool = True,
    ) -> None:
        super().__init__(rubric, model, name, max_transcript_chars, retries, budget, examples)

    def messages(self, record: RolloutRecord) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        """The request for ``record``, and the transcript cut made."""
        text, cut = transcript(record, self.max_transcript_chars)
        user = f"RUBRIC:\n{self.rubric}\n\nTHE RUN:\n{text}\n\n{POINTWISE_FORMAT}"
        return self._conversation(POINTWISE_SYSTEM, POINTWISE_EXAMPLES, user), cut

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        return list(await asyncio.gather(*(self._one(r) for r in records)))

    async def _one(self, record: RolloutRecord) -> Judgement:
        messages, cut = self.messages(record)
        asked = await _ask(
            self.model,
            self.budget,
            messages,
            parse_pointwise,
            self.retries,
            lambda why: POINTWISE_REMINDER.format(why=why),
        )
        if asked.parsed is None:
            return Judgement(score=None, error=asked.error, data=self._data(asked, cut, ""))
        score, reason = asked.parsed
        return Judgement(score=score, reason=reason, data=self._data(asked, cut, reason))


class GroupJudge(_ModelJudge):
    """A model sees the N rollouts of a group together, numbered, and scores each relative to
    the others (0-1): a reward for GRPO on an agent that has none. The task is shown once when
    the runs share it; each transcript gets ``max_transcript_chars / N`` characters. Options as
    for :class:`PointwiseJudge`."""

    group = True

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str = "group_judge",
        max_transcript_chars: int = 12000,
        retries: int = 1,
        budget: JudgeBudget | None = None,
        examples: bool = True,
    ) -> None:
        super().__init__(rubric, model, name, max_transcript_chars, retries, budget, examples)

    def messages(
        self, records: Sequence[RolloutRecord]
    ) -> tuple[list[dict[str, Any]], list[dict[str, int] | None]]:
        """The request for a group, and each run's transcript cut."""
        n = len(records)
        shared = all(r.task == records[0].task for r in records)
        per_run = max(300, self.max_transcript_chars // n)
        shown = [transcript(r, per_run, task=not shared) for r in records]
        task = (
            f"THE TASK (the same for every run):\n{json.dumps(records[0].task, ensure_ascii=False, indent=1)}\n\n"
            if shared
            else ""
        )
        runs = "\n\n".join(f"=== RUN {i} ===\n{text}" for i, (text, _) in enumerate(shown, 1))
        example = "\n".join(f"{i}: <score>" for i in range(1, n + 1))
        system = GROUP_SYSTEM.format(n=n, example=example)
        user = f"RUBRIC:\n{self.rubric}\n\n{task}{runs}\n\n{group_format(n)}"
        return self._conversation(system, [GROUP_EXAMPLE], user), [cut for _, cut in shown]

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        if not records:
            return []
        n = len(records)
        messages, cuts = self.messages(records)
        asked = await _ask(
            self.model,
            self.budget,
            messages,
            lambda answer: parse_group(answer, n),
            self.retries,
            lambda why: GROUP_REMINDER.format(why=why, n=n),
        )
        first = records[0].rollout
        group_id = first.group_id or first.id
        judgements = []
        for position, cut in enumerate(cuts, 1):
            reason = asked.parsed[1] if asked.parsed is not None else ""
            data = {
                **self._data(asked, cut, reason),
                "group": {"id": group_id, "size": n, "position": position},
            }
            data["group"]["rollouts"] = [r.rollout.id for r in records]
            if asked.parsed is None:
                judgements.append(Judgement(score=None, error=asked.error, data=data))
            else:
                judgements.append(Judgement(score=asked.parsed[0][position - 1], reason=reason, data=data))
        return judgements
