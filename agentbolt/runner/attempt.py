"""The runner's side of one attempt, the same wherever its agent runs: claim it, keep its
lease, upload its events, finish it.

The local :class:`~agentbolt.runner.worker.Runner` (and so each Ray actor, which runs one)
and the Kubernetes :class:`~agentbolt.runner.kubernetes.JobLauncher` differ only in how the
agent runs (in-process, as a process, as a Job); what the server is told, and how its refusals
are handled, is this module's, so that a refused event or outcome is treated alike by all:

* :func:`claim` long-polls for an attempt, and gives up the poll once the holder stops;
* :meth:`AttemptCycle.heartbeats` keeps the lease until the attempt stops being ours;
* :meth:`AttemptCycle.uploads` sends events while the agent runs, apart from the heartbeats;
* events the server refuses are found by halving the refused batch: the rest are sent, the
  refused ones dropped and recorded, and the attempt fails with the reason
  (:meth:`AttemptCycle.report`);
* an outcome the server refuses, or fails on (HTTP 500 at every try), is replaced by a
  failure that says why; only when the server takes no finish at all does the lease run out.

Every upload and finish carries its own idempotency key (the client makes one per request and
sends it again with each retry of it), so a retry after a lost answer stores nothing twice and
gets the first answer; each half of a refused batch is a request of its own, with its own key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from agentbolt.client import AsyncClient
from agentbolt.errors import (
    AgentboltError,
    LeaseLost,
    NotFound,
    ServerFailed,
    WorkerRevoked,
    WorkerTokenExpired,
)
from agentbolt.runner.agent import RolloutContext
from agentbolt.runner.outcome import clip, content_at_fault, record_failure
from agentbolt.schemas import AttemptStatus, Claim, EventCreate

__all__ = ["AttemptCycle", "Holder", "claim"]

log = logging.getLogger("agentbolt.runner")

NOT_OURS = (LeaseLost, NotFound, WorkerRevoked, WorkerTokenExpired)
"""The server's answers that say the attempt is no longer this holder's to report."""


class Holder(Protocol):
    """Who holds attempts: its client, the worker id it holds them under, the lease it asks
    for, and the counts of its reported attempts."""

    client: AsyncClient
    worker_id: str
    lease_seconds: float | None
    completed: int
    failed: int
    lost: int

    def identity_lost(self, exc: WorkerRevoked | WorkerTokenExpired) -> None:
        """The server no longer takes the holder's worker token (its attempts went with it)."""


async def claim(holder: Holder, poll_wait: float, stopping: asyncio.Event) -> Claim | None:
    """The next attempt (the dequeue waits up to ``poll_wait`` for one); None when there is
    none, or when ``stopping`` is set first (while the server is unreachable, say)."""
    dequeue = asyncio.ensure_future(holder.client.dequeue(holder.worker_id, holder.lease_seconds, poll_wait))
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({dequeue, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if dequeue.done():
        return dequeue.result()
    dequeue.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await dequeue
    return None


class AttemptCycle:
    """One attempt's talk with the server, on behalf of ``holder``.

    ``ended`` is set once the server says the attempt is no longer ours (``why`` holds its
    word); ``refused`` lists why events were refused (they were dropped). Events are sent in
    requests of at most ``flush_size * 16``, every ``flush_interval`` seconds while uploading.
    """

    def __init__(
        self, holder: Holder, ctx: RolloutContext, *, flush_interval: float = 0.5, flush_size: int = 64
    ) -> None:
        self.holder, self.ctx = holder, ctx
        self.flush_interval, self.flush_size = flush_interval, flush_size
        self.ended = asyncio.Event()
        self.why = ""
        self.refused: list[str] = []

    @property
    def attempt_id(self) -> str:
        return self.ctx.attempt.id

    def _end(self, exc: Exception) -> None:
        if isinstance(exc, WorkerRevoked | WorkerTokenExpired):  # the attempt went with the identity
            self.holder.identity_lost(exc)
        self.why = str(exc)
        self.ended.set()

    # ------------------------------------------------------------------ while the agent runs

    async def heartbeats(self, interval: float) -> None:
        """Keep the lease until cancelled; return once the attempt is no longer ours. A failed
        heartbeat is tried again soon, not a whole interval later."""
        holder, delay = self.holder, interval
        while True:
            await asyncio.sleep(delay)
            try:
                await holder.client.heartbeat(self.attempt_id, holder.worker_id, holder.lease_seconds)
                delay = interval
            except NOT_OURS as exc:
                self._end(exc)
                return
            except AgentboltError:
                log.exception("heartbeat for %s failed; trying again", self.attempt_id)
                delay = min(interval, self.flush_interval)

    async def uploads(self) -> None:
        """Upload events while the agent runs (apart from heartbeats: a slow or failing upload
        never delays one); return once the attempt is no longer ours."""
        while True:
            await asyncio.sleep(self.flush_interval)
            if not self.ctx.pending_count:
                continue
            try:
                await self.flush()
            except NOT_OURS as exc:
                self._end(exc)
                return
            except AgentboltError:
                log.exception("uploading events of %s failed; they go with the next batch", self.attempt_id)

    @contextlib.asynccontextmanager
    async def kept(self, interval: float) -> AsyncIterator[None]:
        """Heartbeats and uploads for the duration of the block."""
        tasks = [asyncio.create_task(self.heartbeats(interval)), asyncio.create_task(self.uploads())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ events

    async def flush(self) -> None:
        """Send the pending events; what could not be sent is put back (sequence numbers make
        sending it again harmless)."""
        pending = self.ctx.take_pending()
        chunk = self.flush_size * 16
        for start in range(0, len(pending), chunk):
            try:
                await self._upload(pending[start : start + chunk])
            except BaseException:
                self.ctx.put_back(pending[start:])
                raise

    async def _upload(self, events: list[EventCreate]) -> None:
        """Send events; of a batch the server refuses, halve until the refused ones are found,
        send the rest, and drop those (recording why: the attempt will fail with it)."""
        holder = self.holder
        try:
            await holder.client.add_events(self.attempt_id, events, holder.worker_id)
        except Exception as exc:
            if not content_at_fault(exc):
                raise
            if len(events) > 1:
                half = len(events) // 2
                await self._upload(events[:half])
                await self._upload(events[half:])
                return
            who = "the server refused" if isinstance(exc, AgentboltError) else "could not encode"
            reason = f"{who} event {events[0].sequence} ({events[0].type}): {exc}"
            log.warning("attempt %s: %s", self.attempt_id, reason)
            self.refused.append(reason)
            record_failure(self.ctx, "EventRefused", reason)

    # ------------------------------------------------------------------ the end

    async def report(
        self, status: AttemptStatus, reward: float | None, error: str | None
    ) -> AttemptStatus | None:
        """Upload the remaining events, then finish the attempt, and count it on the holder.
        Returns the status it ended with (failed, when the server took no word from us: its
        lease runs out); None when it is no longer ours (counted as lost)."""
        ended = await self._report(status, reward, error)
        holder = self.holder
        if ended is None:
            holder.lost += 1
        elif ended == AttemptStatus.SUCCEEDED:
            holder.completed += 1
        elif ended == AttemptStatus.FAILED:
            holder.failed += 1
        return ended

    async def _report(
        self, status: AttemptStatus, reward: float | None, error: str | None
    ) -> AttemptStatus | None:
        try:
            status, reward, error = await self._last_upload(status, reward, error)
            return await self.finish(status, reward, error)
        except NOT_OURS as exc:
            log.warning("attempt %s could not be finished: %s", self.attempt_id, exc)
            if isinstance(exc, WorkerRevoked | WorkerTokenExpired):
                self.holder.identity_lost(exc)
            return None
        except AgentboltError as exc:
            # Nothing more can be said (e.g. the token is refused): the lease runs out.
            log.error("attempt %s could not be finished: %s", self.attempt_id, exc)
            return AttemptStatus.FAILED

    async def _last_upload(
        self, status: AttemptStatus, reward: float | None, error: str | None
    ) -> tuple[AttemptStatus, float | None, str | None]:
        """Flush the remaining events; an attempt whose events were refused, or could not be
        sent, fails with the reason."""
        try:
            await self.flush()
            if self.refused:
                await self.flush()  # the records of what was refused
        except NOT_OURS:
            raise
        except AgentboltError as exc:
            return AttemptStatus.FAILED, None, f"events could not be uploaded: {exc}"
        if not self.refused or status == AttemptStatus.RELEASED:
            return status, reward, error
        reasons = "; ".join(self.refused)
        return AttemptStatus.FAILED, None, f"{error}; {reasons}" if error else reasons

    async def finish(self, status: AttemptStatus, reward: float | None, error: str | None) -> AttemptStatus:
        """Finish the attempt; if the server refuses that outcome, or fails on it (HTTP 500 at
        every try), fail it with the reason: the attempt's record says what the server
        answered, not that its lease expired."""
        holder = self.holder
        try:
            await holder.client.finish(self.attempt_id, status, reward, clip(error), holder.worker_id)
            return status
        except ServerFailed as exc:
            reason = f"the server failed on the attempt's finish ({status.value}): {exc}"
            reason += f"; the outcome's error: {error}" if error else ""
            log.error("attempt %s: %s; failing it with that error", self.attempt_id, reason)
        except AgentboltError as exc:
            if not content_at_fault(exc) or status == AttemptStatus.FAILED:
                raise
            reason = f"the server refused the attempt's outcome ({status.value}): {exc}"
        await holder.client.finish(
            self.attempt_id, AttemptStatus.FAILED, None, clip(reason), holder.worker_id
        )
        return AttemptStatus.FAILED
