"""What a Job that ended amounts to for its attempt: the pod's log and exit recorded as
events, and the outcome to report, read as a program runner reads a program's run: a failure
with its reason (the Job's deadline, the container's exit, an image that cannot be pulled),
else the reward the program posted to its events URL, or the scorer's."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbolt.runner import kube_state
from agentbolt.runner.agent import RolloutContext
from agentbolt.runner.kube_api import KubeApi, KubeError
from agentbolt.runner.outcome import judge, record_failure
from agentbolt.runner.program_io import CappedOutput, ProgramFailed
from agentbolt.runner.program_reward import AttemptAccess, ProgramRun, Scorer, choose_reward
from agentbolt.schemas import AttemptStatus, EventType

__all__ = ["LOG_READ_LIMIT", "JobOutcomes"]

log = logging.getLogger("agentbolt.kubernetes")

LOG_READ_LIMIT = 16 * 1024 * 1024
"""Bytes of a pod's log read back (of which ``output_limit`` are recorded, head and tail)."""

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""The label the Job controller puts on each pod of a Job."""

_NO_RESULT = Path("/nonexistent/agentbolt-result.json")
"""A Job has no result file the launcher can read: its reward comes from events or a scorer."""

Outcome = tuple[AttemptStatus, float | None, str | None]


@dataclass
class JobOutcomes:
    """Reads the outcome of the launcher's Jobs (``container``: the agent's, in each pod)."""

    api: KubeApi
    container: str | None
    access: AttemptAccess
    """How a posted reward is read back (the launcher's client; no attempt key of its own)."""
    scorer: Scorer
    reward_later: bool
    output_limit: int
    sources: tuple[str, ...] = ("program", "result_file")
    """Where the reward is read from (``reward_from``)."""

    async def read(
        self, ctx: RolloutContext, name: str, job: dict[str, Any], pod: dict[str, Any] | None
    ) -> Outcome:
        """Record the pod's log and the Job's exit on the attempt, then its outcome."""
        pod = await self._pod_now(name, pod)
        state = kube_state.container_state(pod, self.container)
        text = await self._log(pod)
        if text is not None and text.total:
            ctx.emit(EventType.MESSAGE, {"role": "log", "content": text.text(), **text.sizes()})
        terminated = state.get("terminated") or {}
        ctx.emit(
            "job_exit",
            {
                "job": name,
                "namespace": self.api.namespace,
                "condition": kube_state.finished(job),
                "exit_code": terminated.get("exitCode"),
                "reason": terminated.get("reason") or (state.get("waiting") or {}).get("reason"),
            },
        )
        failure = kube_state.failure(job, pod, self.container)
        if failure is not None:
            return failed(ctx, *failure)
        return await self._rewarded(ctx, text.text() if text else "", terminated.get("exitCode"))

    async def _rewarded(self, ctx: RolloutContext, output: str, exit_code: int | None) -> Outcome:
        """The outcome of a Job that completed: its reward, as for a program run by a runner."""
        with tempfile.TemporaryDirectory(prefix="agentbolt-job-") as scratch:
            run = ProgramRun(ctx.task, output, "", exit_code, Path(scratch))
            try:
                reward = await choose_reward(
                    ctx, self.access, run, _NO_RESULT, self.scorer, self.reward_later, self.sources
                )
            except ProgramFailed as exc:
                return failed(ctx, exc.kind, str(exc))
        return judge(ctx, reward)

    async def _pod_now(self, job: str, seen: dict[str, Any] | None) -> dict[str, Any] | None:
        """The Job's pod as it is now, read once as the Job ends: the pods' watch is a stream
        of its own, and may not have shown the pod's end yet when the Job's shows the Job's."""
        try:
            pods, _ = await asyncio.to_thread(self.api.listing, "pods", f"{JOB_NAME_LABEL}={job}")
        except KubeError as exc:
            log.warning("could not read the pod of Job %s: %s", job, exc)
            return seen
        return kube_state.pods_by_job(pods).get(job, seen)

    async def _log(self, pod: dict[str, Any] | None) -> CappedOutput | None:
        if pod is None:
            return None
        name = pod["metadata"]["name"]
        try:
            text = await asyncio.to_thread(self.api.pod_log, name, self.container, LOG_READ_LIMIT)
        except KubeError as exc:
            log.warning("could not read the log of pod %s: %s", name, exc)
            return None
        if text is None:
            return None
        out = CappedOutput(self.output_limit)
        out.add(text.encode())
        return out


def failed(ctx: RolloutContext, kind: str, message: str) -> Outcome:
    """A failure the launcher decided, recorded on the attempt with its reason."""
    record_failure(ctx, kind, message)
    return AttemptStatus.FAILED, None, message
