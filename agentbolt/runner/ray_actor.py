"""One runner as a Ray actor, and what it is sent to rebuild its agent.

:class:`RunnerActor` runs the ordinary :class:`~agentbolt.runner.worker.Runner` loop in a Ray
actor's event loop (the driver, :class:`~agentbolt.runner.ray_runners.RayRunners`, starts and
stops them). The agent crosses to the actor's process as :func:`payload_of` makes it: a
``module:object`` spec, or the agent as :mod:`agentbolt.runner.travel` sends it to any other
interpreter (by name when it is a module global, else by value).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.agent import LitAgent, as_agent
from agentbolt.runner.travel import pickled, unpickled
from agentbolt.runner.worker import Runner, load_object

__all__ = ["STATS", "RunnerActor", "payload_of"]

log = logging.getLogger("agentbolt.runner.ray")

STATS = ("completed", "failed", "lost", "abandoned")
"""The counts each actor's runner reports."""


def _load_payload(payload: tuple[str, Any]) -> LitAgent:
    """The agent an actor runs: ``("spec", "module:object")`` or ``("pickle", bytes)`` (as
    :func:`~agentbolt.runner.travel.pickled` sends it: by name, or by value)."""
    kind, value = payload
    if kind == "spec":
        return as_agent(load_object(value, "agent"))
    return unpickled(value)


class _ActorRunner(Runner):
    """A Runner that says when it has registered with the server."""

    def __init__(self, *args: Any, on_registered: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_registered = on_registered

    async def _register(self) -> None:
        await super()._register()
        self._on_registered()


class RunnerActor:
    """One Ray actor (an async actor: its methods share one event loop) running one Runner.

    ``run`` is the long call Ray re-issues after a restart; ``ready`` answers once the runner
    has registered; ``stop`` stops it as a signal would and returns its counts."""

    def __init__(self, index: int, url: str, token: str | None, settings: dict[str, Any]) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.index, self.url, self.token, self.settings = index, url, token, settings
        self.runner: _ActorRunner | None = None
        self.started = time.time()
        self._registered: asyncio.Event | None = None
        self._stopped = False
        self._finished: asyncio.Event | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._registered is None or self._finished is None:
            self._registered, self._finished = asyncio.Event(), asyncio.Event()
        return self._registered, self._finished

    async def run(self, payload: tuple[str, Any]) -> dict[str, Any]:
        registered, finished = self._events()
        try:
            try:
                agent = _load_payload(payload)
            except Exception as exc:
                raise ConfigError(
                    f"the agent could not be loaded in the Ray actor on {socket.gethostname()}: "
                    f"{type(exc).__name__}: {exc} (its module must be importable on every node: "
                    "install it there, or pass runtime_env={'working_dir': ...} or PYTHONPATH)"
                ) from None
            hint = f"ray{self.index}-{socket.gethostname()}-{os.getpid()}"
            self.runner = _ActorRunner(
                agent,
                self.url,
                token=self.token,
                worker_id=hint,
                on_registered=registered.set,
                **self.settings,
            )
            if self._stopped:  # stopped before the runner existed
                return self._counts()
            await self.runner.run(install_signals=False)
            if self.runner.abandoned:
                log.warning("%d released agent thread(s) abandoned", self.runner.abandoned)
            return self._counts()
        finally:
            finished.set()

    async def ready(self) -> dict[str, Any]:
        registered, _ = self._events()
        await registered.wait()
        return self.info()

    def info(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "worker_id": self.runner.worker_id if self.runner is not None else None,
            "started": self.started,
            **self._counts(),
        }

    async def stop(self, grace: float | None = None) -> dict[str, Any]:
        """Stop claiming; running rollouts get ``grace`` seconds, then are released."""
        self._stopped = True
        _, finished = self._events()
        if self.runner is not None:
            if grace is not None:
                self.runner.grace = grace
            self.runner.stop()
            if self.runner._stopping is not None:  # its loop runs: wait for it to end
                await finished.wait()
        return self.info()

    async def release(self) -> None:
        """Release running attempts now (as a second signal does)."""
        runner = self.runner
        if runner is not None and runner._stopping is not None:
            runner._stopping.set()
            runner._on_signal()  # with the stop already set: cancels the running rollouts

    def _counts(self) -> dict[str, int]:
        if self.runner is None:
            return dict.fromkeys(STATS, 0)
        return {name: int(getattr(self.runner, name)) for name in STATS}


def payload_of(agent: Any) -> tuple[str, Any]:
    """What an actor is sent to rebuild ``agent``: a spec (a file path made absolute), a
    module global's name, or the object pickled with cloudpickle."""
    if isinstance(agent, str):
        module, sep, attr = agent.partition(":")
        if not sep or not attr:
            raise ConfigError(f"agent {agent!r} must look like 'module:object' or 'file.py:object'")
        if module.endswith(".py"):
            path = Path(module).resolve()
            if not path.exists():
                raise ConfigError(f"agent file {module} does not exist")
            return "spec", f"{path}:{attr}"
        return "spec", agent
    as_agent(agent)  # a clear error now for what is no agent at all
    data = pickled(agent)
    if data is None:
        raise ConfigError(
            "the agent cannot be sent to Ray actors: it does not pickle (with cloudpickle); build "
            "what it holds (a client, a lock) inside execute_rollout, or give it as 'module:object'"
        )
    return "pickle", data
