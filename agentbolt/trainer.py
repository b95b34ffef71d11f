"""The Trainer wires the parts together for one run.

``Trainer(algorithm=Evaluate(), n_runners=2).fit(agent, train_tasks, val_tasks)``:
without ``server_url`` it starts an embedded server (SQLite file in the run directory) and
``n_runners`` local runner processes; then it publishes the initial resources and hands the
algorithm a :class:`TrainContext`.

Runner processes (:mod:`agentbolt.local_runners`) are fresh interpreters whose main module is
agentbolt's own, sent the agent pickled (cloudpickle; by value when it lives in the user's
``__main__``): ``fit`` works the same from a script with or without an ``if __name__ ==
"__main__":`` guard, a script read from stdin, ``python -c`` and a notebook. An agent that does
not pickle falls back to ``fork``. Each runner must register with the server within
``runner_start_timeout`` seconds, or the run stops with an error that names the runner. Runners
end with the Trainer's process however it ends (:mod:`agentbolt.lifeline`); SIGTERM and SIGHUP
stop them as Ctrl-C does.

The embedded server needs the ``server`` extra; with ``server_url`` the Trainer only talks to
that server, and runs on the light install (``pip install agentbolt``).

With ``ray=RayRunners(...)`` the runners are Ray actors on a cluster instead
(:mod:`agentbolt.runner.ray_runners`), under the same timeout, with errors that name what Ray
could not place or which actor failed.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from agentbolt.algorithms.base import Algorithm, TrainContext
from agentbolt.algorithms.rewards import RewardChoice, RewardOptions
from agentbolt.client import Client
from agentbolt.console import make_console
from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator
from agentbolt.extras import needs_extra
from agentbolt.lifeline import stop_on_signals, stopped_by_signal
from agentbolt.local_runners import LocalRunners
from agentbolt.runner.agent import LitAgent, as_agent
from agentbolt.runner.ray_runners import RayRunners  # imports ray only when actors start
from agentbolt.schemas import Resource, Task

__all__ = ["Trainer"]


def _wait_healthy(url: str, token: str | None, timeout: float = 30.0) -> None:
    """Wait until the server at ``url`` answers its health check."""
    with Client(url, token) as client:
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.health()
                return
            except Exception:  # noqa: BLE001 - not up yet; the timeout says so
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server at {url} not healthy after {timeout:.0f} s") from None
                time.sleep(0.05)


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
        # The embedded server always has one: a program agent's key then holds only an agent's
        # rights, and nothing else on this machine can write to the run.
        embedded = server_url is None and token is None
        self.token = secrets.token_urlsafe(24) if token == "auto" or embedded else token
        self.resources = resources
        self.run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.lease_seconds = lease_seconds
        self.console = console or make_console()
        self.runner_start_timeout = runner_start_timeout
        self.ray = ray
        self.start_method: str | None = None
        """How the runner processes of the last :meth:`fit` were started."""
        self._runners: LocalRunners | None = None

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
        with stop_on_signals():
            return self._fit(agent, train, val)

    def _fit(self, agent: LitAgent, train: list[Task], val: list[Task]) -> Any:
        server: Any = None
        url = self.server_url
        if url is None:
            with needs_extra("the Trainer's embedded server (no server_url given)", "server"):
                from agentbolt.server.config import ServerConfig
                from agentbolt.server.run import ServerThread, free_port
            config = ServerConfig.with_token(
                self.token, db=str(self.run_dir / "agentbolt.db"), port=free_port()
            )
            url = f"http://{config.host}:{config.port}"
        urgent = False
        try:
            self._start_runners(agent, url)
            if self.server_url is None:
                server = ServerThread(replace(config, lease_seconds=self.lease_seconds or 30.0)).start()
            _wait_healthy(url, self.token)
            self._await_runners(url)
            return self._run_algorithm(url, train, val)
        except BaseException as exc:
            urgent = stopped_by_signal(exc)  # Ctrl-C, SIGTERM: the runners release their work at once
            raise
        finally:
            self._stop_runners(urgent=urgent)
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
        """Before the server thread and any model: a runner that falls back to ``fork`` (its
        agent does not pickle) forks a process with as few threads as there can be."""
        if self.ray is not None:
            self.start_method = "ray"
            self.ray.start(agent, url, token=self.token, lease_seconds=self.lease_seconds)
            return
        if not self.n_runners:
            return
        self._runners = LocalRunners(self.n_runners, self.runner_concurrency, self.lease_seconds)
        try:
            self._runners.start(agent, url, self.token)
        finally:  # also when a start failed: the error names the method
            self.start_method = self._runners.start_method

    def _await_runners(self, url: str) -> None:
        """Wait until every runner has registered with the server; a clear error when one
        died or stays silent past ``runner_start_timeout``."""
        if self.ray is not None:  # placed by Ray and registered, or a ConfigError that says why
            self.ray.wait_ready(self.runner_start_timeout)
        elif self._runners is not None:
            self._runners.wait_registered(url, self.runner_start_timeout)

    def _stop_runners(self, grace: float = 15.0, urgent: bool = False) -> None:
        if self.ray is not None:
            self.ray.stop(grace=grace)
        elif self._runners is not None:
            self._runners.stop(grace, urgent=urgent)
