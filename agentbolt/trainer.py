"""The Trainer wires the parts together for one run.

``Trainer(algorithm=Evaluate(), n_runners=2).fit(agent, train_tasks, val_tasks)``:
without ``server_url`` it starts an embedded server (SQLite file in the run directory) and
``n_runners`` local runner processes; then it publishes the initial resources and hands the
algorithm a :class:`TrainContext`.

Runner processes start *before* the server thread and any model, with ``forkserver`` (or
``spawn``) when the agent can be pickled and a fresh interpreter can import its module: an
agent defined at module level of an importable module. A child forked while another thread
of the parent holds a lock can hang for ever, and users' processes often have threads. An
agent that does not pickle (a closure, a class defined inside a function), one defined in the
``__main__`` script (a fresh interpreter would run the script's top level again) or in a file
loaded by path outside ``sys.path`` falls back to ``fork``. Either way each runner must register
with the server within ``runner_start_timeout`` seconds, or the run stops with an error that
names the runner.

With ``ray=RayRunners(...)`` the runners are Ray actors on a cluster instead
(:mod:`agentbolt.runner.ray_runners`), under the same timeout, with errors that name what Ray
could not place or which actor failed.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import pickle
import pickletools
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from agentbolt.algorithms.base import Algorithm, TrainContext
from agentbolt.algorithms.rewards import RewardChoice, RewardOptions
from agentbolt.client import Client
from agentbolt.console import make_console
from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator
from agentbolt.runner.agent import LitAgent, as_agent
from agentbolt.runner.ray_runners import RayRunners  # imports ray only when actors start
from agentbolt.schemas import Resource, Task
from agentbolt.server.config import ServerConfig
from agentbolt.server.run import ServerThread, free_port, wait_healthy

__all__ = ["Trainer"]

log = logging.getLogger("agentbolt.trainer")


@dataclass(frozen=True)
class _AgentByName:
    """An agent that is a module global (a ``@rollout`` function, which does not pickle
    itself), sent by name and imported in the runner process."""

    module: str
    qualname: str

    def load(self) -> LitAgent:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return as_agent(obj)


RUNNER_PRELOAD = ("openai",)
"""Modules a runner process imports in the background once it has registered (when installed)."""


def _import_quietly(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed or broken: the agent's own import says why
            log.debug("runner preload of %s failed", name, exc_info=True)


def _runner_main(
    agent: LitAgent | _AgentByName,
    url: str,
    token: str | None,
    concurrency: int,
    lease: float | None,
    registered: Any = None,
) -> None:
    """A runner process; ``registered`` (a multiprocessing Event) is set once the runner has
    registered with the server and starts claiming."""
    from agentbolt.runner.worker import Runner

    class _Runner(Runner):
        async def _register(self) -> None:
            await super()._register()
            if registered is not None:
                registered.set()
            # the OpenAI SDK most agents call takes seconds to import (3.5 s measured on a loaded
            # 2-core machine): import it now, while the trainer loads its model, not inside the
            # first rollout, where it held up the first step
            threading.Thread(target=_import_quietly, args=(RUNNER_PRELOAD,), daemon=True).start()

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s runner %(levelname)s %(message)s")
    if isinstance(agent, _AgentByName):
        agent = agent.load()
    _Runner(agent, url, token=token, concurrency=concurrency, lease_seconds=lease).run_sync()


def _by_name(agent: LitAgent) -> _AgentByName | None:
    """``agent`` as a module global's name, when it is one (``@rollout`` at module level)."""
    module, qualname = getattr(agent, "__module__", None), vars(agent).get("__qualname__")
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return _AgentByName(module, qualname) if obj is agent else None


def _how_to_start(agent: LitAgent) -> tuple[str, LitAgent | _AgentByName]:
    """The start method of the runner processes and what they are handed: ``forkserver`` (else
    ``spawn``) when the agent pickles, or is a module global, and a fresh interpreter can import
    what it refers to; ``fork`` otherwise (where the platform has it)."""
    methods = multiprocessing.get_all_start_methods()
    fresh = "forkserver" if "forkserver" in methods else "spawn"
    fallback = "fork" if "fork" in methods else fresh
    payload: LitAgent | _AgentByName | None = _by_name(agent)
    if payload is None:
        try:
            pickle.dumps(agent)
            payload = agent
        except Exception:  # noqa: BLE001 - whatever stops pickling means: fork
            return fallback, agent
    # what a child interpreter must import to rebuild the agent: the __main__ module (a script,
    # python -c, a notebook) or a module loaded from a file path (``--agent path/agent.py:agent``) that
    # is not on sys.path cannot be imported there
    modules = _modules_of(pickle.dumps(payload))
    if isinstance(payload, _AgentByName):
        modules.add(payload.module)  # imported by name in the runner
    if not all(_importable(name) for name in modules):
        return fallback, agent
    return fresh, payload


def _modules_of(data: bytes) -> set[str]:
    """The modules a pickle refers to (its GLOBAL and STACK_GLOBAL opcodes)."""
    modules: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            modules.add(str(arg).split(" ", 1)[0])
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            modules.add(strings[-2])
        elif isinstance(arg, str):
            strings.append(arg)
    return modules


def _importable(module: str) -> bool:
    """Whether a fresh interpreter with this process's sys.path finds ``module``'s top package
    (the finders are asked directly: ``importlib.util.find_spec`` would answer from sys.modules)."""
    top = module.split(".", 1)[0]
    if top == "__main__":
        # a fresh interpreter would run the script's top level again (multiprocessing imports it
        # as __mp_main__): a script without an ``if __name__ == "__main__":`` guard, as in the
        # README's quick start, would start a second training there; such agents fork
        return False
    if top in sys.builtin_module_names:
        return True
    return any(
        getattr(finder, "find_spec", None) and finder.find_spec(top, None) is not None  # type: ignore[union-attr]
        for finder in sys.meta_path
    )


def _with_rewards(
    algorithm: Algorithm,
    reward: RewardChoice | None,
    evaluators: Sequence[Evaluator] | None,
    reward_wait: float | None,
) -> Algorithm:
    """``algorithm`` with the reward settings given to the Trainer (a copy; checked)."""
    values: dict[str, Any] = {"reward": reward, "evaluators": evaluators, "reward_wait": reward_wait}
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return algorithm
    if not isinstance(algorithm, RewardOptions):
        raise ConfigError(f"{type(algorithm).__name__} takes no reward settings ({', '.join(given)})")
    return replace(algorithm, **given)


class Trainer:
    def __init__(
        self,
        algorithm: Algorithm,
        *,
        n_runners: int = 1,
        runner_concurrency: int = 1,
        server_url: str | None = None,
        token: str | None = None,
        resources: dict[str, Resource] | None = None,
        run_dir: str | Path | None = None,
        lease_seconds: float | None = 30.0,
        console: Console | None = None,
        reward: RewardChoice | None = None,
        evaluators: Sequence[Evaluator] | None = None,
        reward_wait: float | None = None,
        runner_start_timeout: float | None = 120.0,
        ray: RayRunners | None = None,
    ) -> None:
        """``reward``, ``evaluators`` and ``reward_wait``, when given, set the algorithm's own
        (:class:`~agentbolt.algorithms.rewards.RewardOptions`): which reward it trains on, what
        gives the named rewards, how long a batch waits for them.

        ``runner_start_timeout``: seconds, from the moment the server answers, within which
        every runner process must have registered with it, or :meth:`fit` raises (None: no
        check).

        ``ray``: run the runners as Ray actors (:class:`~agentbolt.runner.ray_runners.RayRunners`:
        the cluster, the number of actors and what each asks for) instead of local processes;
        ``n_runners`` and ``runner_concurrency`` are then not used. The actors must reach the
        server: on a cluster of several machines, give ``server_url`` of a server they reach
        (the embedded one listens on 127.0.0.1). ``runner_start_timeout`` bounds the wait for
        every actor to be placed and registered (None: the RayRunners' ``ready_timeout``)."""
        if n_runners < 0:
            raise ConfigError("n_runners must be >= 0")
        if runner_start_timeout is not None and runner_start_timeout <= 0:
            raise ConfigError("runner_start_timeout must be > 0 (or None)")
        if ray is not None and n_runners > 1:
            raise ConfigError(
                "with ray=RayRunners(...), give the number of runners as RayRunners(replicas=...), not n_runners"
            )
        algorithm = _with_rewards(algorithm, reward, evaluators, reward_wait)
        if token == "auto" and server_url is not None:
            raise ConfigError(
                'token="auto" makes a token for the embedded server; with server_url, pass that server\'s token'
            )
        self.algorithm = algorithm
        self.n_runners, self.runner_concurrency = n_runners, runner_concurrency
        self.server_url = server_url
        # Resolved here, once: the server, the runners and the algorithm's client must all hold
        # the same random token (runners that sent the literal "auto" got 401 on every call).
        self.token = secrets.token_urlsafe(24) if token == "auto" else token
        self.resources = resources
        self.run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.lease_seconds = lease_seconds
        self.console = console or make_console()
        self.runner_start_timeout = runner_start_timeout
        self.ray = ray
        self.start_method: str | None = None
        """How the runner processes of the last :meth:`fit` were started."""
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._registered: list[Any] = []

    def fit(
        self,
        agent: Any,
        train_tasks: Iterable[Task | dict[str, Any]] | None = None,
        val_tasks: Iterable[Task | dict[str, Any]] | None = None,
    ) -> Any:
        """Run the algorithm; returns what it returns. Under ``torchrun`` with several ranks,
        rank 0 runs everything and the others only join the updates (they return None)."""
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            from agentbolt.algorithms import distributed

            distributed.check_launch(self.algorithm)
            if distributed.rank() > 0:
                distributed.follow()
                return None
        agent = as_agent(agent)
        train = [Task.of(t) for t in train_tasks or []]
        val = [Task.of(t) for t in val_tasks or []]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        server: ServerThread | None = None
        url = self.server_url
        if url is None:
            config = ServerConfig.with_token(
                self.token, db=str(self.run_dir / "agentbolt.db"), port=free_port()
            )
            url = f"http://{config.host}:{config.port}"
        try:
            self._start_runners(agent, url)
            if self.server_url is None:
                server = ServerThread(replace(config, lease_seconds=self.lease_seconds or 30.0)).start()
            wait_healthy(url, token=self.token)
            self._await_runners(url)
            return self._run_algorithm(url, train, val)
        finally:
            self._stop_runners()
            if server is not None:
                server.stop()

    def _run_algorithm(self, url: str, train: list[Task], val: list[Task]) -> Any:
        """Publish the initial resources, then hand the algorithm its context."""
        with Client(url, self.token) as client:
            if self.resources:
                client.publish_resources(self.resources, {"source": "trainer", "initial": True})
            ctx = TrainContext(
                client=client,
                server_url=url,
                train_tasks=train,
                val_tasks=val,
                run_dir=self.run_dir,
                console=self.console,
                token=self.token,
            )
            return self.algorithm.run(ctx)

    def _start_runners(self, agent: LitAgent, url: str) -> None:
        if self.ray is not None:
            self.start_method = "ray"
            self.ray.start(agent, url, token=self.token, lease_seconds=self.lease_seconds)
            return
        if not self.n_runners:
            return
        self.start_method, payload = _how_to_start(agent)
        ctx: Any = multiprocessing.get_context(self.start_method)
        for _ in range(self.n_runners):
            registered = ctx.Event()
            proc = ctx.Process(
                target=_runner_main,
                args=(payload, url, self.token, self.runner_concurrency, self.lease_seconds, registered),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._registered.append(registered)

    def _await_runners(self, url: str) -> None:
        """Wait until every runner has registered with the server; a clear error when one
        died or stays silent past ``runner_start_timeout``."""
        if self.ray is not None:  # placed by Ray and registered, or a ConfigError that says why
            self.ray.wait_ready(self.runner_start_timeout)
            return
        if self.runner_start_timeout is None:
            return
        deadline = time.monotonic() + self.runner_start_timeout
        waiting = list(enumerate(zip(self._procs, self._registered, strict=True), 1))
        while waiting:
            for entry in list(waiting):
                index, (proc, registered) = entry
                name = (
                    f"runner {index} of {len(self._procs)} (pid {proc.pid}, started with {self.start_method})"
                )
                if registered.is_set():
                    waiting.remove(entry)
                elif not proc.is_alive():
                    raise ConfigError(
                        f"{name} exited with code {proc.exitcode} before it registered with the "
                        f"server at {url}; its error is printed above"
                    )
            if not waiting:
                return
            if time.monotonic() > deadline:
                index, (proc, _) = waiting[0]
                hint = (
                    "A process forked while another of its threads holds a lock can hang: define the "
                    "agent at module level (so it pickles and runners start with forkserver) or start "
                    "no threads before Trainer.fit"
                    if self.start_method == "fork"
                    else "Its agent's imports may be slow or stuck"
                )
                raise ConfigError(
                    f"runner {index} of {len(self._procs)} (pid {proc.pid}, started with {self.start_method}) "
                    f"did not register with the server at {url} within {self.runner_start_timeout:g} s "
                    f"(runner_start_timeout). {hint}; or raise runner_start_timeout."
                )
            waiting[0][1][1].wait(0.05)

    def _stop_runners(self, grace: float = 15.0) -> None:
        if self.ray is not None:
            self.ray.stop(grace=grace)
            return
        for proc in self._procs:
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self._procs.clear()
        self._registered.clear()
