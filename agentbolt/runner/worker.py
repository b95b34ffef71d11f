"""The runner: a worker loop that executes an agent on queued rollouts.

``concurrency`` slots each loop dequeue -> run the agent -> upload events -> finish. Sync agents
run in a thread pool of that size, async ones on the loop. A heartbeat keeps each attempt's
lease; events go up in batches while the agent runs. An agent's exception becomes an
``exception`` event with its traceback and fails the attempt. Server outages are ridden out
with backoff. SIGINT/SIGTERM: stop claiming, let running rollouts finish for ``grace``
seconds, then release the rest so another runner takes them at once; a second signal releases
immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentbolt.client import AsyncClient, RetryPolicy
from agentbolt.errors import AgentboltError, ConfigError, LeaseLost, NotFound
from agentbolt.runner.agent import LitAgent, RolloutContext, as_agent, emit_exception
from agentbolt.runner.tracing import Tracer, tracing_enabled
from agentbolt.schemas import AttemptStatus, Claim, EventType, Trajectory

__all__ = ["Runner", "load_agent", "reward_of"]

log = logging.getLogger("agentbolt.runner")


def load_agent(spec: str) -> LitAgent:
    """``module:object`` or ``path/to/file.py:object`` -> an agent."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ConfigError(f"agent {spec!r} must look like 'module:object' or 'file.py:object'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.exists():
            raise ConfigError(f"agent file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec and mod_spec.loader
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"cannot import agent module {module_name!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None
    return as_agent(obj)


def reward_of(result: Any, ctx: RolloutContext) -> float | None:
    """The rollout's reward: a returned number, a Trajectory's total_reward, else the sum of
    the rollout-level rewards the agent emitted (None if it emitted none)."""
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, int | float):
        return float(result)
    if isinstance(result, Trajectory) and result.total_reward is not None:
        return float(result.total_reward)
    return float(sum(ctx.rewards)) if ctx.rewards else None


class Runner:
    def __init__(
        self,
        agent: Any,
        server_url: str,
        *,
        token: str | None = None,
        concurrency: int = 1,
        worker_id: str | None = None,
        lease_seconds: float | None = None,
        heartbeat_interval: float | None = None,
        poll_wait: float = 5.0,
        flush_interval: float = 0.5,
        flush_size: int = 64,
        grace: float = 10.0,
        max_rollouts: int | None = None,
        request_timeout: float = 30.0,
        tracing: bool | None = None,
    ) -> None:
        self.agent = as_agent(agent)
        self.concurrency = max(1, concurrency)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_seconds = lease_seconds
        self.heartbeat_interval = heartbeat_interval or (lease_seconds or 30.0) / 3
        self.poll_wait, self.flush_interval, self.flush_size = poll_wait, flush_interval, flush_size
        self.grace, self.max_rollouts = grace, max_rollouts
        # Retry forever while the server is down: a runner outlives server restarts.
        self.client = AsyncClient(
            server_url,
            token,
            timeout=request_timeout,
            retry=RetryPolicy(attempts=0, base_delay=0.2, max_delay=5.0),
        )
        self.completed = 0
        self.failed = 0
        self.abandoned = 0
        """Sync agents cancelled mid-run (stop or lost lease): their threads cannot be interrupted."""
        self.lost = 0
        """Attempts whose lease ended before they could report (they do not count as done)."""
        self._stopping: asyncio.Event | None = None  # created on the loop in run()
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="agentbolt-agent")
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._release_now = False
        # OpenTelemetry export of each rollout's spans (off unless asked: AGENTBOLT_TRACING=1)
        self.tracer = Tracer(server_url, token) if tracing_enabled(tracing) else None

    # ------------------------------------------------------------------ lifecycle

    def run_sync(self, install_signals: bool = True) -> None:
        """Run until stopped (a signal, :meth:`stop`, or ``max_rollouts`` done)."""
        asyncio.run(self.run(install_signals))

    async def run(self, install_signals: bool = False) -> None:
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._on_signal)
        log.info("runner %s: %d slot(s) on %s", self.worker_id, self.concurrency, self.client.url)
        try:
            slots = [asyncio.create_task(self._slot(i)) for i in range(self.concurrency)]
            await asyncio.gather(*slots)
        finally:
            await self.client.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            if self.tracer is not None:
                await asyncio.to_thread(self.tracer.shutdown)

    def stop(self) -> None:
        """Stop claiming; running rollouts get ``grace`` seconds, then are released."""
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def _on_signal(self) -> None:
        assert self._stopping is not None
        if self._stopping.is_set():
            log.warning("second signal: releasing running attempts now")
            self._release_now = True
            for task in self._running.values():
                task.cancel()
        else:
            log.info(
                "stopping: no new rollouts; %d running get %.0f s to finish", len(self._running), self.grace
            )
            self._stopping.set()

    @property
    def _done(self) -> bool:
        assert self._stopping is not None
        if self.max_rollouts is not None and self.completed + self.failed >= self.max_rollouts:
            return True
        return self._stopping.is_set()

    # ------------------------------------------------------------------ the loop

    async def _slot(self, index: int) -> None:
        while not self._done:
            try:
                claim = await self._claim()
                if claim is None:
                    continue  # the dequeue itself waited (long poll)
                await self._execute(claim)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("runner slot %d: unexpected error; continuing", index)
                await self._sleep(1.0)

    async def _claim(self) -> Claim | None:
        assert self._stopping is not None
        dequeue = asyncio.ensure_future(
            self.client.dequeue(self.worker_id, self.lease_seconds, self.poll_wait)
        )
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({dequeue, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if dequeue.done():
            return dequeue.result()
        dequeue.cancel()  # stopping while the server is unreachable
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await dequeue
        return None

    async def _sleep(self, seconds: float) -> None:
        assert self._stopping is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _execute(self, claim: Claim) -> None:
        ctx = RolloutContext(claim.rollout, claim.attempt, claim.resources)
        attempt_id = claim.attempt.id
        lost = asyncio.Event()
        work = asyncio.create_task(self._run_agent(ctx))
        self._running[attempt_id] = work
        keepalive = asyncio.create_task(self._keepalive(ctx, lost, work))
        try:
            status, reward, error = await self._outcome(ctx, work)
        finally:
            self._running.pop(attempt_id, None)
            keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive
        if self.tracer is not None:  # the rollout's spans are in the store before it is finished
            await asyncio.to_thread(self.tracer.flush)
        if lost.is_set():
            log.warning("attempt %s lost its lease; its result is dropped", attempt_id)
            self.lost += 1
            return
        await self._report(ctx, status, reward, error)

    async def _outcome(
        self, ctx: RolloutContext, work: asyncio.Task[Any]
    ) -> tuple[AttemptStatus, float | None, str | None]:
        try:
            result = await self._await_with_grace(work)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this slot itself is being cancelled
            # the agent was cancelled: by stopping (release it) or by a lost lease (dropped later)
            if not self.agent.is_async:
                self.abandoned += 1  # its thread cannot be interrupted and runs on
            return AttemptStatus.RELEASED, None, "runner stopped"
        except Exception as exc:
            ctx_token = ctx.activate()
            try:
                emit_exception(exc)
            finally:
                ctx_token.var.reset(ctx_token)
            return AttemptStatus.FAILED, None, f"{type(exc).__name__}: {exc}"
        reward = reward_of(result, ctx)
        if isinstance(result, Trajectory):
            ctx.emit("trajectory", result.model_dump(mode="json"))
        if reward is not None:
            ctx.emit(EventType.REWARD, {"value": reward, "final": True})
        return AttemptStatus.SUCCEEDED, reward, None

    async def _await_with_grace(self, work: asyncio.Task[Any]) -> Any:
        """Await the agent; once stopping, give it ``grace`` seconds, then release it."""
        assert self._stopping is not None
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                done, _ = await asyncio.wait({work}, timeout=self.grace)
                if not done:
                    work.cancel()
                    raise asyncio.CancelledError
            return work.result()
        finally:
            stop.cancel()

    async def _run_agent(self, ctx: RolloutContext) -> Any:
        token = ctx.activate()
        traced = self.tracer.rollout(ctx) if self.tracer is not None else contextlib.nullcontext()
        try:
            with traced:  # inside the rollout's context: the agent's spans are children of its root
                if self.agent.is_async:
                    return await self.agent.execute_rollout(ctx.task)  # type: ignore[misc]
                import contextvars

                run_ctx = contextvars.copy_context()
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    self._executor, run_ctx.run, self.agent.execute_rollout, ctx.task
                )
        finally:
            token.var.reset(token)

    async def _keepalive(self, ctx: RolloutContext, lost: asyncio.Event, work: asyncio.Task[Any]) -> None:
        """Heartbeat and upload events until cancelled; a lost lease cancels the agent."""
        last_beat = time.monotonic()
        while True:
            await asyncio.sleep(self.flush_interval)
            try:
                if ctx.pending_count:
                    await self._flush(ctx)
                if time.monotonic() - last_beat >= self.heartbeat_interval:
                    await self.client.heartbeat(ctx.attempt.id, self.worker_id, self.lease_seconds)
                    last_beat = time.monotonic()
            except (LeaseLost, NotFound):
                lost.set()
                work.cancel()
                return
            except AgentboltError:
                log.exception("keepalive for %s failed", ctx.attempt.id)

    async def _flush(self, ctx: RolloutContext) -> None:
        pending = ctx.take_pending()
        chunk = self.flush_size * 16
        for start in range(0, len(pending), chunk):
            try:
                await self.client.add_events(ctx.attempt.id, pending[start : start + chunk], self.worker_id)
            except BaseException:
                ctx.put_back(pending[start:])
                raise

    async def _report(
        self, ctx: RolloutContext, status: AttemptStatus, reward: float | None, error: str | None
    ) -> None:
        try:
            await self._flush(ctx)
            await self.client.finish(ctx.attempt.id, status, reward, error, self.worker_id)
        except (LeaseLost, NotFound) as exc:
            log.warning("attempt %s could not be finished: %s", ctx.attempt.id, exc)
            self.lost += 1
            return
        if status == AttemptStatus.SUCCEEDED:
            self.completed += 1
        elif status == AttemptStatus.FAILED:
            self.failed += 1
