"""The Trainer wires the parts together for one run.

``Trainer(algorithm=Evaluate(), n_runners=2).fit(agent, train_tasks, val_tasks)``:
without ``server_url`` it starts an embedded server (SQLite file in the run directory) and
``n_runners`` local runner processes; then it publishes the initial resources and hands the
algorithm a :class:`TrainContext`. Runner processes are forked *before* the server thread and
any model are started, so they inherit no threads or model memory, and an agent defined in a
script's ``__main__`` works.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import signal
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
from agentbolt.runner.agent import LitAgent, as_agent
from agentbolt.schemas import Resource, Task
from agentbolt.server.config import ServerConfig
from agentbolt.server.run import ServerThread, free_port, wait_healthy

__all__ = ["Trainer"]

log = logging.getLogger("agentbolt.trainer")


def _runner_main(agent: LitAgent, url: str, token: str | None, concurrency: int, lease: float | None) -> None:
    from agentbolt.runner.worker import Runner

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s runner %(levelname)s %(message)s")
    Runner(agent, url, token=token, concurrency=concurrency, lease_seconds=lease).run_sync()


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
    ) -> None:
        """``reward``, ``evaluators`` and ``reward_wait``, when given, set the algorithm's own
        (:class:`~agentbolt.algorithms.rewards.RewardOptions`): which reward it trains on, what
        gives the named rewards, how long a batch waits for them."""
        if n_runners < 0:
            raise ConfigError("n_runners must be >= 0")
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
        self._procs: list[multiprocessing.process.BaseProcess] = []

    def fit(
        self,
        agent: Any,
        train_tasks: Iterable[Task | dict[str, Any]] | None = None,
        val_tasks: Iterable[Task | dict[str, Any]] | None = None,
    ) -> Any:
        """Run the algorithm; returns what it returns."""
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
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        for _ in range(self.n_runners):
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_runner_main,
                args=(agent, url, self.token, self.runner_concurrency, self.lease_seconds),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)

    def _stop_runners(self, grace: float = 15.0) -> None:
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
