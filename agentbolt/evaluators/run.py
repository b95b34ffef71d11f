"""Run evaluators over finished rollouts and write their named rewards.

:func:`evaluate_rollouts` is what the algorithms call after each batch and what the evaluator
worker calls on the pending queue. Its rules:

- only automatic evaluators run (a :class:`~agentbolt.evaluators.base.HumanReview` waits for
  a person);
- only *succeeded* rollouts are judged, and only where the evaluator's reward is pending, in
  error, or absent: a scored reward is never judged twice (it is counted as skipped);
- a group evaluator judges each ``group_id``'s succeeded rollouts together (a rollout without a
  group is a group of one) and writes the members whose reward is not scored yet;
- each judgement is written with ``replaces`` = the revision read with the rollout, so a score
  someone gave meanwhile is never overwritten: the server answers 409 and it is counted as a
  conflict, not raised. A rerun on the same rollouts therefore stores nothing new.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from rich.console import Console
from rich.progress import Progress

from agentbolt.console import task_bars
from agentbolt.errors import AgentboltError
from agentbolt.evaluators.base import Evaluator, Judgement
from agentbolt.evaluators.record import RolloutRecord, record_of, usage_tokens
from agentbolt.schemas import Event, RewardCreate, RewardSlot, RewardState, Rollout, RolloutStatus

__all__ = ["EvaluationReport", "RewardWriter", "evaluate_rollouts", "run_sync"]

T = TypeVar("T")

# What a record is built from; other events (spans, states, rewards) are not read.
_RECORD_EVENTS = ["llm_call", "tool_call", "message", "trajectory"]
_MAX_ERROR = 2000


class RewardWriter(Protocol):
    """What evaluation needs of a client (:class:`agentbolt.client.Client` is one)."""

    def events_of(
        self, rollout_ids: Sequence[str], type: Sequence[str] | None = None
    ) -> dict[str, list[Event]]: ...

    def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot: ...


@dataclass
class EvaluationReport:
    """What one evaluation run did (add two with ``+``)."""

    scored: int = 0
    """Rewards written with a score."""
    errors: int = 0
    """Rewards written in state error (malformed answer, timeout, budget, a failing function)."""
    skipped: int = 0
    """(rollout, evaluator) pairs left alone: already scored, or the rollout did not succeed."""
    conflicts: int = 0
    """Writes refused because someone scored meanwhile (409): nothing overwritten."""
    cached: int = 0
    """Judge answers taken from the cache instead of a call."""
    calls: int = 0
    """Judge model calls made."""
    tokens: int = 0
    """Tokens those calls used (as the judge model reported them)."""
    seconds: float = 0.0

    def __add__(self, other: EvaluationReport) -> EvaluationReport:
        a, b = asdict(self), asdict(other)
        return EvaluationReport(**{k: a[k] + b[k] for k in a})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Job:
    """One call of an evaluator's ``judge``: the rollouts it sees, and those whose reward it writes."""

    evaluator: Evaluator
    members: list[Rollout]
    write: set[str] = field(default_factory=set)


def _needs_score(rollout: Rollout, name: str) -> bool:
    slot = rollout.rewards.get(name)
    return slot is None or slot.state in (RewardState.PENDING, RewardState.ERROR)


def _jobs(evaluator: Evaluator, rollouts: Sequence[Rollout]) -> tuple[list[_Job], int]:
    """The jobs of one evaluator over ``rollouts``, and how many rollouts it skips."""
    succeeded = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
    targets = {r.id for r in succeeded if _needs_score(r, evaluator.name)}
    skipped = len(rollouts) - len(targets)
    if not evaluator.group:
        return [_Job(evaluator, [r], {r.id}) for r in succeeded if r.id in targets], skipped
    groups: dict[str, list[Rollout]] = {}
    for r in succeeded:
        groups.setdefault(r.group_id or f"rollout:{r.id}", []).append(r)
    jobs = [_Job(evaluator, members, {r.id for r in members} & targets) for members in groups.values()]
    return [job for job in jobs if job.write], skipped


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from synchronous code, also when this thread already runs an
    event loop (then in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def evaluate_rollouts(
    client: RewardWriter,
    rollouts: Sequence[Rollout],
    evaluators: Sequence[Evaluator],
    *,
    console: Console | None = None,
    concurrency: int = 4,
    progress: Progress | None = None,
) -> EvaluationReport:
    """Judge ``rollouts`` with the automatic ``evaluators`` and write their rewards (see the
    module's rules). ``rollouts`` should be read with their rewards (``client.wait``,
    ``get_rollout``, ``list_rollouts``, ``pending_rewards`` attach them). A progress bar shows
    on ``progress`` (a display the caller runs, e.g. inside its live table: rich before 14
    allows one live display at a time), else on ``console`` (none when it is None)."""
    started = time.monotonic()
    unique = list({r.id: r for r in rollouts}.values())
    report = EvaluationReport()
    jobs: list[_Job] = []
    for evaluator in evaluators:
        if evaluator.automatic:
            evaluator.use_server(getattr(client, "url", None), getattr(client, "token", None))
            found, skipped = _jobs(evaluator, unique)
            jobs += found
            report.skipped += skipped
    if jobs:
        ids = list({r.id: None for job in jobs for r in job.members})
        events = client.events_of(ids, type=_RECORD_EVENTS)
        records = {r.id: record_of(r, events.get(r.id, [])) for job in jobs for r in job.members}
        shown = progress or task_bars(console)
        with contextlib.nullcontext() if progress else shown:
            bar = shown.add_task("judging", total=sum(len(job.write) for job in jobs), info="")
            try:
                run_sync(_run_jobs(client, jobs, records, max(1, concurrency), report, shown, bar))
            finally:
                if progress:
                    progress.remove_task(bar)
    report.seconds = time.monotonic() - started
    return report


async def _run_jobs(
    client: RewardWriter,
    jobs: list[_Job],
    records: dict[str, RolloutRecord],
    concurrency: int,
    report: EvaluationReport,
    progress: Progress,
    bar: Any,
) -> None:
    semaphore = asyncio.Semaphore(concurrency)
    lock = threading.Lock()  # the report is updated from the writing threads

    async def run(job: _Job) -> None:
        async with semaphore:
            judgements = await _judge(job, records)
        await asyncio.to_thread(_write_job, client, job, judgements, report, lock)
        info = f"{report.scored} scored, {report.errors} errors, {report.calls} calls"
        progress.update(bar, advance=len(job.write), info=info)

    await asyncio.gather(*(run(job) for job in jobs))


async def _judge(job: _Job, records: dict[str, RolloutRecord]) -> list[Judgement]:
    """The evaluator's judgements of the job; a bug in it fails the job's judgements, not the run."""
    evaluator = job.evaluator
    try:
        judgements = await evaluator.judge([records[r.id] for r in job.members])
    except Exception as exc:
        return [Judgement.failed(f"evaluator {evaluator.name!r} raised {type(exc).__name__}: {exc}")] * len(
            job.members
        )
    if len(judgements) != len(job.members):
        error = (
            f"evaluator {evaluator.name!r} gave {len(judgements)} judgements for {len(job.members)} rollouts"
        )
        return [Judgement.failed(error)] * len(job.members)
    return judgements


def _write_job(
    client: RewardWriter,
    job: _Job,
    judgements: list[Judgement],
    report: EvaluationReport,
    lock: threading.Lock,
) -> None:
    # a group's calls are recorded with every member: count them once
    counted = judgements[:1] if job.evaluator.group else judgements
    for judgement in counted:
        _count_calls(judgement, report, lock)
    for rollout, judgement in zip(job.members, judgements, strict=True):
        if rollout.id in job.write:
            _write(client, job.evaluator, rollout, judgement, report, lock)


def _count_calls(judgement: Judgement, report: EvaluationReport, lock: threading.Lock) -> None:
    with lock:
        for call in judgement.data.get("calls") or []:
            if call.get("cached"):
                report.cached += 1
                continue
            report.calls += 1
            report.tokens += usage_tokens(call.get("usage") or {}) or 0


def reward_of(evaluator: Evaluator, rollout: Rollout, judgement: Judgement) -> RewardCreate:
    """The write for ``judgement``: a score checked against the evaluator's scale, or an error."""
    slot = rollout.rewards.get(evaluator.name)
    common: dict[str, Any] = {
        "name": evaluator.name,
        "replaces": slot.revision if slot is not None else None,
        "author": evaluator.name,
        "scale": evaluator.scale,
    }
    data = {"reason": judgement.reason, **judgement.data} if judgement.reason else dict(judgement.data)
    data.setdefault("fingerprint", evaluator.fingerprint())  # which configuration gave it
    error = judgement.error
    if error is None and judgement.score is None:
        error = f"evaluator {evaluator.name!r} gave no score"
    if error is None and judgement.score is not None:
        try:
            evaluator.scale.check(judgement.score)
            return RewardCreate(score=judgement.score, data=data, **common)
        except ValueError as exc:  # off the scale, or data JSON cannot store
            error = f"evaluator {evaluator.name!r}: {exc}"
    try:
        return RewardCreate(state=RewardState.ERROR, error=_clip(error), data=data, **common)
    except ValueError as exc:
        return RewardCreate(state=RewardState.ERROR, error=_clip(f"{error}; its data: {exc}"), **common)


def _clip(text: str | None) -> str:
    text = text or "no reason given"
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " [...]"


def _write(
    client: RewardWriter,
    evaluator: Evaluator,
    rollout: Rollout,
    judgement: Judgement,
    report: EvaluationReport,
    lock: threading.Lock,
) -> None:
    create = reward_of(evaluator, rollout, judgement)
    try:
        client.add_reward(rollout.id, create)
    except AgentboltError as exc:
        if exc.status_code != 409:
            raise
        with lock:
            report.conflicts += 1
        return
    with lock:
        if create.state == RewardState.SCORED:
            report.scored += 1
        else:
            report.errors += 1
