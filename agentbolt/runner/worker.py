"""The runner: a worker loop that executes an agent on queued rollouts.

``concurrency`` slots each loop dequeue -> run the agent -> upload events -> finish. Sync agents
run in a thread pool, async ones on the loop. A heartbeat keeps each attempt's lease, every
third of the lease the server granted; events go up in batches while the agent runs. An agent's
exception becomes an ``exception`` event with its traceback and fails the attempt; so do a
reward that is not a finite number and events the server refuses (those are dropped, and the
reason recorded). Server outages are ridden out with backoff.

When the server says the attempt is no longer ours (cancelled, finished, lease lost), the agent
is cancelled at once and the slot claims new work. An async agent stops at its next ``await``;
a sync agent's thread cannot be interrupted: it runs on in the background, its result dropped
(counted in ``abandoned``), while spare threads keep the slots supplied.

SIGINT/SIGTERM: stop claiming, let running rollouts finish for ``grace`` seconds, then release
the rest so another runner takes them at once; a second signal releases immediately. A
:class:`~agentbolt.runner.program.Program`'s children are stopped with their rollouts (their
process groups get SIGTERM, then SIGKILL).

At start the runner registers itself: the server issues a worker id and a worker token bound to
it, used for every later call (an older server issues none: the runner goes on with its own
token and id).

What the server is told about each attempt (heartbeats, uploads, the finish) and how its
refusals are handled is :mod:`agentbolt.runner.attempt`'s, shared with the Kubernetes launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from agentbolt.client import AsyncClient, RequestError, RetryPolicy
from agentbolt.errors import AgentboltError, ConfigError, WorkerRevoked, WorkerTokenExpired
from agentbolt.runner.agent import LitAgent, RolloutContext, as_agent, emit_exception
from agentbolt.runner.attempt import AttemptCycle, claim
from agentbolt.runner.credentials import forget_tokens, make_undumpable, unprotected_warning
from agentbolt.runner.outcome import judge, record_failure
from agentbolt.runner.program import AttemptAccess, Program, ProgramFailed
from agentbolt.runner.tracing import Tracer, tracing_enabled
from agentbolt.schemas import AttemptStatus, Claim

__all__ = ["Runner", "load_agent", "load_object"]

log = logging.getLogger("agentbolt.runner")

_CANCEL_WAIT = 1.0
"""Seconds a cancelled async agent gets to unwind before its slot moves on without it."""


def load_agent(spec: str) -> LitAgent:
    """``module:object`` or ``path/to/file.py:object`` -> an agent."""
    return as_agent(load_object(spec, "agent"))


def load_object(spec: str, what: str = "object") -> Any:
    """The object named by ``module:object`` or ``path/to/file.py:object``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ConfigError(f"{what} {spec!r} must look like 'module:object' or 'file.py:object'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.exists():
            raise ConfigError(f"{what} file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec and mod_spec.loader
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"cannot import {what} module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None


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
        spare_threads: int | None = None,
    ) -> None:
        self.agent = as_agent(agent)
        self.concurrency = max(1, concurrency)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._name = self.worker_id  # the hint every registration sends
        self.lease_seconds = lease_seconds
        """The lease this runner asks for; the server decides (``Claim.lease_seconds``)."""
        self._asked_interval = heartbeat_interval
        self._token_ttl: float | None = None  # the worker token's time to live, from registration
        self.heartbeat_interval = heartbeat_interval or (lease_seconds or 30.0) / 3
        """Used only with a server that does not say which lease it granted."""
        self.poll_wait, self.flush_interval, self.flush_size = poll_wait, flush_interval, flush_size
        self.grace, self.max_rollouts = grace, max_rollouts
        # Retry forever while the server is down: a runner outlives server restarts. A slot has
        # at most three calls in flight (a long-poll, or a heartbeat, an upload and a finish),
        # so a heartbeat never waits for a free connection.
        self._secrets: tuple[str, ...] = (token,) if token else ()
        """The runner's tokens, which a program agent's environment never holds."""
        self.client = AsyncClient(
            server_url,
            token,
            timeout=request_timeout,
            retry=RetryPolicy(attempts=0, base_delay=0.2, max_delay=5.0),
            max_connections=max(100, 3 * self.concurrency),
        )
        self.completed = 0
        self.failed = 0
        self.abandoned = 0
        """Sync agents cancelled mid-run (stop, cancel or lost lease): their threads cannot be
        interrupted and finish in the background, their results dropped."""
        self.lost = 0
        """Attempts that stopped being ours before they could report: cancelled, or their lease
        ended (they do not count as done)."""
        self.spare_threads = spare_threads if spare_threads is not None else max(self.concurrency, 8)
        """Threads beyond one per slot, for abandoned sync agents still running: while they are
        all taken, slots wait instead of claiming work that could not start."""
        self._stopping: asyncio.Event | None = None  # created on the loop in run()
        self._executor = ThreadPoolExecutor(
            self.concurrency + self.spare_threads, thread_name_prefix="agentbolt-agent"
        )
        self._adrift: set[Future[Any]] = set()  # abandoned sync agents' threads, until they end
        self._told_taken = False  # warned that they hold every thread (once, not every poll)
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._release_now = False
        # OpenTelemetry export of each rollout's spans (off unless asked: AGENTBOLT_TRACING=1),
        # set up once registered, so that it sends the worker token the server issues
        self._tracing = tracing_enabled(tracing)
        self.tracer: Tracer | None = None
        self.failure: AgentboltError | None = None
        """Why the runner stopped on the server's word (its worker revoked, or its expired token
        could not be renewed); ``run`` raises it once the slots are done."""
        self._reregister: asyncio.Future[None] | None = None  # registering again (token expired)

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
        owned = install_signals and isinstance(self.agent, Program)
        undo_watcher = _pidfd_watcher(self._loop) if owned else None
        try:
            if isinstance(self.agent, Program):
                self.agent.preflight()  # its sandbox and limits, before any work is claimed
            self._keep_tokens_from_agents()
            await self._register()
            if self._tracing and self.tracer is None:
                # the worker token when the server issued one, else the runner's own
                self.tracer = Tracer(self.client.url, self.client.token)
            log.info("runner %s: %d slot(s) on %s", self.worker_id, self.concurrency, self.client.url)
            slots = [asyncio.create_task(self._slot(i)) for i in range(self.concurrency)]
            await asyncio.gather(*slots)
            if self.failure is not None:
                raise self.failure
        finally:
            if undo_watcher is not None:
                undo_watcher()
            await self.client.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            if self.tracer is not None:
                await asyncio.to_thread(self.tracer.shutdown)

    def _keep_tokens_from_agents(self) -> None:
        """The client holds the token now: it leaves the environment (and the blocks that
        ``/proc`` shows); a runner of program agents turns away same-user ptrace, and warns
        once when its programs run as root (:mod:`agentbolt.runner.credentials`)."""
        forget_tokens(self._secrets)
        if isinstance(self.agent, Program):
            make_undumpable()
            warning = unprotected_warning(self.agent.run_as, getattr(self.agent, "sandbox", False))
            if warning is not None:
                log.warning("runner %s: %s", self.worker_id, warning)

    async def _register(self) -> None:
        """Take the worker identity the server issues (this runner's id is the name hint);
        an older server issues none (404), and a token not allowed to register (403) goes on
        as it is. Any other refusal (an unknown token) stops the runner with the reason."""
        assert self._stopping is not None
        asked = asyncio.ensure_future(self.client.register_worker(self._name))
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({asked, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not asked.done():  # stopped while the server was unreachable
            asked.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asked
            return
        try:
            registration = asked.result()
        except RequestError as exc:
            if exc.status_code != 403:
                raise ConfigError(f"the server refused to register this runner: {exc}") from None
            log.warning("this token may not register a worker (%s); going on with it", exc)
            return
        if registration is not None:
            self.worker_id = registration.worker_id
            self._secrets += (registration.worker_token,)
            self._token_ttl = registration.token_ttl_seconds

    def identity_lost(self, exc: WorkerRevoked | WorkerTokenExpired) -> None:
        """The server no longer takes this runner's worker token. Revoked: stop (``run`` then
        raises the error). Expired: register again, once for all slots (``_reregister``)."""
        if isinstance(exc, WorkerRevoked):
            self._fail(exc)
        elif not self._done and (self._reregister is None or self._reregister.done()):
            log.warning("runner %s: %s; registering again", self.worker_id, exc)
            self._reregister = asyncio.ensure_future(self._register_again(exc))

    def _fail(self, exc: AgentboltError) -> None:
        """Stop on a reason of the server's (the first one is kept; ``run`` raises it)."""
        assert self._stopping is not None
        if self.failure is None:
            log.error("runner %s: %s; stopping", self.worker_id, exc)
            self.failure = exc
        self._stopping.set()

    async def _register_again(self, expired: WorkerTokenExpired) -> None:
        """A new worker identity after the old token expired; span export moves to its token.
        A runner that cannot get one (its own token refused, or not one that may register)
        stops with the reason."""
        old = self.worker_id
        try:
            if isinstance(self.agent, Program):
                self.agent.preflight()  # its sandbox and limits, before any work is claimed
            await self._register()
        except ConfigError as exc:
            self._fail(exc)
            return
        if self.worker_id == old:
            if not self._done:  # not stopped meanwhile: the server issued no new identity
                self._fail(ConfigError(f"{expired}; and this runner could not register again (see above)"))
            return
        log.info("runner %s registered again as %s", old, self.worker_id)
        if self.tracer is not None:
            stale, self.tracer = self.tracer, Tracer(self.client.url, self.client.token)
            await asyncio.to_thread(stale.shutdown)

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
                if self._threads_taken():
                    await self._sleep(0.2)
                    continue
                claim = await self._claim()
                if claim is None:
                    continue  # the dequeue itself waited (long poll)
                await self._execute(claim)
            except asyncio.CancelledError:
                raise
            except (WorkerRevoked, WorkerTokenExpired) as exc:
                self.identity_lost(exc)
                if self._reregister is not None:
                    await self._reregister
            except Exception:
                log.exception("runner slot %d: unexpected error; continuing", index)
                await self._sleep(1.0)

    def _threads_taken(self) -> bool:
        """True while abandoned sync agents hold the threads a new claim would need."""
        if self.agent.is_async or not self._adrift:
            return False
        self._adrift = {f for f in self._adrift if not f.done()}
        taken = len(self._adrift) + len(self._running) >= self.concurrency + self.spare_threads
        if taken and not self._told_taken:
            log.warning("%d abandoned agent thread(s) still run: waiting for one to end", len(self._adrift))
        self._told_taken = taken
        return taken

    async def _claim(self) -> Claim | None:
        assert self._stopping is not None
        return await claim(self, self.poll_wait, self._stopping)

    async def _sleep(self, seconds: float) -> None:
        assert self._stopping is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _beat_interval(self, claim: Claim) -> float:
        """A third of the lease the server granted, whatever this runner asked for (a shorter
        ``heartbeat_interval`` given explicitly is kept); the runner's own setting only when
        the server did not say. Never more than a third of the worker token's time to live
        (``token_ttl_seconds`` at registration): the heartbeats keep the worker seen, so its
        token cannot expire while it holds an attempt, and the attempt's finish is taken."""
        if not claim.lease_seconds:
            interval = self.heartbeat_interval
        else:
            granted = claim.lease_seconds / 3
            interval = min(granted, self._asked_interval) if self._asked_interval else granted
        return min(interval, self._token_ttl / 3) if self._token_ttl else interval

    async def _execute(self, claim: Claim) -> None:
        """Run the agent on the claimed attempt while the attempt's cycle keeps its lease and
        uploads its events; then report the outcome, unless the attempt is no longer ours."""
        ctx = RolloutContext(claim.rollout, claim.attempt, claim.resources)
        cycle = AttemptCycle(self, ctx, flush_interval=self.flush_interval, flush_size=self.flush_size)
        work = asyncio.create_task(self._run_agent(ctx, claim))
        self._running[ctx.attempt.id] = work
        try:
            async with cycle.kept(self._beat_interval(claim)):
                status, reward, error = await self._outcome(ctx, work, cycle.ended)
        finally:
            self._running.pop(ctx.attempt.id, None)
        if self.tracer is not None:  # the rollout's spans are in the store before it is finished
            await asyncio.to_thread(self.tracer.flush)
        if cycle.ended.is_set():
            log.warning("attempt %s is no longer ours (%s); its result is dropped", ctx.attempt.id, cycle.why)
            self.lost += 1
            return
        await cycle.report(status, reward, error)

    async def _outcome(
        self, ctx: RolloutContext, work: asyncio.Task[Any], ended: asyncio.Event
    ) -> tuple[AttemptStatus, float | None, str | None]:
        try:
            result = await self._await_agent(work, ended)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this slot itself is being cancelled
            # the agent was cancelled: by stopping (release it) or because the attempt is no
            # longer ours (dropped by the caller)
            return AttemptStatus.RELEASED, None, "runner stopped"
        except ProgramFailed as exc:  # the reason is the runner's own: no traceback to record
            record_failure(ctx, exc.kind, str(exc))
            return AttemptStatus.FAILED, None, str(exc)
        except Exception as exc:
            ctx_token = ctx.activate()
            try:
                emit_exception(exc)
            finally:
                ctx_token.var.reset(ctx_token)
            return AttemptStatus.FAILED, None, f"{type(exc).__name__}: {exc}"
        return judge(ctx, result)

    async def _await_agent(self, work: asyncio.Task[Any], ended: asyncio.Event) -> Any:
        """Await the agent. Once stopping, give it ``grace`` seconds, then release it; once
        the attempt is no longer ours, cancel it at once."""
        assert self._stopping is not None
        stop = asyncio.ensure_future(self._stopping.wait())
        lost = asyncio.ensure_future(ended.wait())
        try:
            await asyncio.wait({work, stop, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and not lost.done():
                await asyncio.wait({work, lost}, timeout=self.grace, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                await self._cancel(work)
                raise asyncio.CancelledError
            return work.result()
        finally:
            stop.cancel()
            lost.cancel()

    async def _cancel(self, work: asyncio.Task[Any]) -> None:
        """Cancel the agent and give it a moment to unwind; one that ignores the cancellation
        is left to run on the loop, its result dropped."""
        work.cancel()
        done, _ = await asyncio.wait({work}, timeout=_CANCEL_WAIT)
        if not done:
            log.warning("agent ignored its cancellation for %.0f s; abandoned", _CANCEL_WAIT)
            self.abandoned += 1

    async def _run_agent(self, ctx: RolloutContext, claim: Claim) -> Any:
        token = ctx.activate()
        traced = self.tracer.rollout(ctx) if self.tracer is not None else contextlib.nullcontext()
        try:
            with traced:  # inside the rollout's context: the agent's spans are children of its root
                if isinstance(self.agent, Program):
                    return await self.agent.run_attempt(ctx, self._access(claim))
                if self.agent.is_async:
                    with ctx.running():
                        # an async agent's execute_rollout returns a coroutine
                        return await cast(Awaitable[Any], self.agent.execute_rollout(ctx.task))
                return await self._run_in_thread(ctx)
        finally:
            token.var.reset(token)

    def _access(self, claim: Claim) -> AttemptAccess:
        return AttemptAccess(claim.agent_key, self.client.url, self.client, self._secrets)

    async def _run_in_thread(self, ctx: RolloutContext) -> Any:
        future = self._executor.submit(contextvars.copy_context().run, self._call_agent, ctx)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel() and not future.done():  # already running: cannot be stopped
                self.abandoned += 1
                self._adrift.add(future)
            raise

    def _call_agent(self, ctx: RolloutContext) -> Any:
        with ctx.running():  # until the thread returns, even after its result was dropped
            return self.agent.execute_rollout(ctx.task)


def _pidfd_watcher(loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
    """On Python 3.11 asyncio waits for each child process in a thread of its own; a pidfd
    needs none (from 3.12 asyncio uses pidfds by itself). The watcher is process-wide and
    bound to one loop, so it is installed only by a runner that owns its process (the CLI's,
    Trainer's); elsewhere (a runner inside tests or a notebook) the default stays. Returns
    what puts the previous watcher back, or None when nothing was installed."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return None
    previous = asyncio.get_child_watcher()
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(loop)
    asyncio.set_child_watcher(watcher)

    def undo() -> None:
        watcher.close()
        asyncio.set_child_watcher(previous)

    return undo
