"""The evaluator worker: scores rollouts as they finish, beside the runners.

It reconciles against the store, which is the source of truth: each pass reads the pending
queue (succeeded rollouts whose evaluator reward is still pending, ``client.pending_rewards``)
and judges what it finds with :func:`~agentbolt.evaluators.run.evaluate_rollouts`. Nothing is
remembered between passes, so a restart, a second worker or a pass that failed needs no
special case: a reward scored meanwhile is a 409, counted and left alone.

A group evaluator waits until every rollout of a group is final (``list_rollouts(group_id=)``)
and then judges the group's succeeded rollouts together; a rollout without a group is judged
alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from rich.console import Console

from agentbolt.client import Client
from agentbolt.console import print_line
from agentbolt.errors import AgentboltError
from agentbolt.evaluators.base import Evaluator
from agentbolt.evaluators.model import JudgeBudget
from agentbolt.evaluators.run import EvaluationReport, evaluate_rollouts
from agentbolt.schemas import RewardSource, Rollout

__all__ = ["EvaluatorWorker"]

log = logging.getLogger(__name__)


class EvaluatorWorker:
    """Judges the pending rewards of ``evaluators`` (the automatic ones) until stopped.

    ``batch``: rollouts read per page of the queue; ``concurrency``: judgements at a time;
    ``console``: progress bars and one line per batch (None: quiet); ``budget``: the judges'
    budget, whose exhaustion stops the worker after the pass that ran out (the rollouts it
    could not judge then hold an error reward saying so)."""

    def __init__(
        self,
        client: Client,
        evaluators: Sequence[Evaluator],
        *,
        console: Console | None = None,
        concurrency: int = 4,
        batch: int = 100,
        budget: JudgeBudget | None = None,
    ) -> None:
        self.client, self.console = client, console
        self.evaluators = [e for e in evaluators if e.automatic]
        self.concurrency, self.batch, self.budget = concurrency, batch, budget
        self.total = EvaluationReport()
        self._stop = threading.Event()

    def stop(self) -> None:
        """Finish the batch in hand, then return from :meth:`run` (safe from a signal handler)."""
        self._stop.set()

    def run(self, poll: float = 2.0, once: bool = False) -> EvaluationReport:
        """Pass over the queue every ``poll`` seconds while nothing is pending, until
        :meth:`stop`; a failed pass is logged and tried again. ``once``: one pass, whose
        errors are raised. Returns what all passes did."""
        if once:
            self.step()
            return self.total
        while not self._stop.is_set():
            try:
                did = self.step()
            except AgentboltError as exc:  # the server is away, a refused write: said in one line
                log.warning("evaluation pass failed (%s); trying again in %.1f s", exc, poll)
                did = EvaluationReport()
            except Exception:
                log.exception("evaluation pass failed; trying again in %.1f s", poll)
                did = EvaluationReport()
            if self.budget is not None and self.budget.refused:
                log.warning("%s: stopping", self.budget.exhausted())
                break
            if did.scored + did.errors + did.conflicts == 0:
                self._stop.wait(poll)
        return self.total

    def step(self) -> EvaluationReport:
        """One pass over the pending queue of every evaluator."""
        done = EvaluationReport()
        for evaluator in self.evaluators:
            if self._stop.is_set():
                break
            pending = self.client.pages(
                self.client.pending_rewards,
                name=evaluator.name,
                source=RewardSource.EVALUATOR,
                limit=self.batch,
            )
            if evaluator.group:  # whole groups at once: a group is never split between batches
                done += self._evaluate(self._ready_groups(pending), evaluator)
                continue
            ready = list(pending)
            for start in range(0, len(ready), self.batch):
                done += self._evaluate(ready[start : start + self.batch], evaluator)
        return done

    def _ready_groups(self, pending: Iterable[Rollout]) -> list[Rollout]:
        """The members of every group with a pending rollout whose rollouts are all final
        (a group still running waits for the next pass); a rollout without a group as itself."""
        out: list[Rollout] = []
        seen: set[str] = set()
        for rollout in pending:
            if rollout.group_id is None:
                out.append(rollout)
                continue
            if rollout.group_id in seen:
                continue
            seen.add(rollout.group_id)
            members = list(
                self.client.pages(self.client.list_rollouts, group_id=rollout.group_id, limit=1000)
            )
            if all(m.status.is_final for m in members):
                out += members
        return out

    def _evaluate(self, rollouts: list[Rollout], evaluator: Evaluator) -> EvaluationReport:
        if not rollouts:
            return EvaluationReport()
        report = evaluate_rollouts(
            self.client, rollouts, [evaluator], console=self.console, concurrency=self.concurrency
        )
        self.total += report
        if self.console is not None and (report.scored or report.errors or report.conflicts):
            print_line(
                self.console,
                f"{evaluator.name}: {report.scored} scored, {report.errors} errors, "
                f"{report.conflicts} scored meanwhile, {report.calls} calls ({report.cached} cached), "
                f"{report.tokens} tokens in {report.seconds:.1f} s",
            )
        return report
