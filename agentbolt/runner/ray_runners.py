"""Runners as Ray actors: N :class:`~agentbolt.runner.worker.Runner` loops spread over a Ray
cluster, each actor with its own resource request (CPUs, memory, custom resources such as a
sandbox slot). Needs the ``ray`` extra (``pip install 'agentbolt[ray]'``).

``RayRunners(address, replicas=4, num_cpus=1, resources={"sandbox": 1}).start(agent, url)``
connects to the cluster (``ray.init(address=...)``; a local one is started when ``address``
is None or ``"local"``), starts ``replicas`` actors and has each run the ordinary runner loop
against the server at ``url``: an in-process agent (``module:object`` spec, or a LitAgent that
pickles) or a :class:`~agentbolt.runner.program.Program` alike. :meth:`RayRunners.wait_ready`
waits until every actor has registered with the server (a clear error when Ray cannot place
one, or when one fails); :meth:`RayRunners.stop` stops each actor's runner as a signal would
(running rollouts get ``grace`` seconds, then are released) and frees the actors.

Ray restarts an actor whose process dies (``max_restarts``) and re-issues its ``run`` call on
the new process (``max_task_retries``), so a restarted actor serves again under a new worker
identity. Nothing here keeps count of attempts: the dead actor's attempts stay leased to it
in the store until their leases run out, and the store retries them exactly as it retries the
attempts of a runner process that was killed.

Each actor is a :class:`~agentbolt.runner.ray_actor.RunnerActor`; ``agentbolt runner --ray``
is :mod:`agentbolt.cli.ray`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentbolt.errors import ConfigError, MissingExtra
from agentbolt.runner.ray_actor import STATS, RunnerActor, payload_of

__all__ = ["RayRunners"]

log = logging.getLogger("agentbolt.runner.ray")

LOCAL = "local"
"""The address that starts a local Ray cluster in this process (as None does)."""

CONNECT_TIMEOUT = 5.0
"""Seconds to reach a cluster's address before Ray is asked to connect to it."""


def _ray() -> Any:
    """The ``ray`` module, or :class:`MissingExtra` naming the extra that brings it."""
    try:
        installed = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        raise MissingExtra("runners on Ray", ("ray",), "ray")
    import ray

    return ray


# ---------------------------------------------------------------------------- the driver


@dataclass
class RayRunners:
    """``replicas`` runner actors on a Ray cluster.

    * ``address``: the cluster (``"host:6379"``, ``"ray://host:10001"``, ``"auto"`` for one
      started on this machine by ``ray start``); None or ``"local"``: start a local one (with
      ``init_options``, e.g. ``{"num_cpus": 8}``). A process already connected to Ray
      (``ray.is_initialized()``) uses that connection.
    * ``num_cpus``, ``memory`` (bytes), ``resources`` (custom, e.g. ``{"sandbox": 1}``): each
      actor's request; Ray places an actor only on a node that has them free.
    * ``concurrency``: rollouts at a time per actor; ``lease_seconds``: the lease its runner
      asks for (None: the server's, or the Trainer's); ``max_rollouts``: per actor.
    * ``max_restarts``: how often Ray restarts a dead actor (-1: always).
    * ``ready_timeout``: seconds within which every actor must be placed and registered.
    * ``grace``: seconds running rollouts get to finish on :meth:`stop` before release.
    * ``runtime_env``: Ray's runtime environment of the actors (``working_dir``,
      ``env_vars``, ``pip``...), e.g. to make the agent's module importable on every node.
    """

    address: str | None = None
    replicas: int = 1
    num_cpus: float = 1.0
    memory: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    concurrency: int = 1
    lease_seconds: float | None = None
    max_rollouts: int | None = None
    max_restarts: int = -1
    ready_timeout: float = 120.0
    grace: float = 10.0
    runtime_env: dict[str, Any] | None = None
    init_options: dict[str, Any] = field(default_factory=dict)
    tracing: bool | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1 (got {self.replicas})")
        if self.num_cpus < 0:
            raise ConfigError(f"num_cpus must be >= 0 (got {self.num_cpus:g})")
        if self.memory is not None and self.memory <= 0:
            raise ConfigError(f"memory must be > 0 bytes (got {self.memory})")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1 (got {self.concurrency})")
        if self.ready_timeout <= 0:
            raise ConfigError(f"ready_timeout must be > 0 (got {self.ready_timeout:g})")
        if self.max_restarts < -1:
            raise ConfigError("max_restarts must be >= 0, or -1 for always")
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory"):
                raise ConfigError(f"resource {name!r} is set with num_cpus / memory, not resources")
            if not isinstance(amount, int | float) or amount < 0:
                raise ConfigError(f"resource {name!r} must be a number >= 0 (got {amount!r})")
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self._owns_connection = False

    # -------------------------------------------------------------- what each actor asks for

    @property
    def request(self) -> dict[str, float]:
        """Each actor's resource request, as Ray names it."""
        wanted: dict[str, float] = {"CPU": self.num_cpus}
        if self.memory is not None:
            wanted["memory"] = float(self.memory)
        return {**wanted, **{k: float(v) for k, v in self.resources.items()}}

    def describe_request(self) -> str:
        """Each actor's request as Ray shows it (``CPU=1, memory=2.00GiB, sandbox=1``)."""

        def show(name: str, amount: float) -> str:
            return f"{name}={_gib(amount)}" if name == "memory" else f"{name}={amount:g}"

        return ", ".join(show(k, v) for k, v in self.request.items())

    # -------------------------------------------------------------- lifecycle

    def start(
        self, agent: Any, server_url: str, *, token: str | None = None, lease_seconds: float | None = None
    ) -> RayRunners:
        """Connect to the cluster and start the actors (without waiting for them: see
        :meth:`wait_ready`). ``agent``: a ``module:object`` / ``file.py:object`` spec, or an
        agent object (a module global is sent by name, anything else pickled with cloudpickle);
        ``lease_seconds`` applies when this object sets none."""
        if self.actors:
            raise ConfigError("these Ray runners are already started")
        payload = payload_of(agent)
        ray = _ray()
        self._connect(ray)
        settings = {
            "concurrency": self.concurrency,
            "lease_seconds": self.lease_seconds if self.lease_seconds is not None else lease_seconds,
            "max_rollouts": self.max_rollouts,
            "grace": self.grace,
            "tracing": self.tracing,
        }
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "resources": dict(self.resources),
            "max_restarts": self.max_restarts,
            "max_task_retries": -1,  # run() is re-issued on the restarted actor
            "max_concurrency": 16,
        }
        if self.memory is not None:
            options["memory"] = self.memory
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        remote = ray.remote(RunnerActor)
        try:
            for index in range(self.replicas):
                actor = remote.options(name=None, **options).remote(index, server_url, token, settings)
                self.actors.append(actor)
                self.runs.append(actor.run.remote(payload))
        except (ValueError, TypeError) as exc:  # Ray refuses the options themselves
            self._kill_all()
            raise ConfigError(
                f"Ray refused the runner actors' options ({self.describe_request()}): {exc}"
            ) from None
        log.info("started %d runner actor(s), each asking for %s", self.replicas, self.describe_request())
        return self

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        address = self.address
        options = {"log_to_driver": True, **self.init_options}
        if address in (None, "", LOCAL):
            try:
                ray.init(**options)
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; each is one message
                raise ConfigError(
                    f"could not start a local Ray cluster: {type(exc).__name__}: {exc}"
                ) from None
        else:
            _check_reachable(address)
            try:
                ray.init(address=address, **options)
            except Exception as exc:  # noqa: BLE001
                with contextlib.suppress(Exception):
                    ray.shutdown()
                raise ConfigError(
                    f"could not connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}"
                ) from None
        self._owns_connection = True

    def wait_ready(
        self, timeout: float | None = None, stop_event: threading.Event | None = None
    ) -> list[dict[str, Any]]:
        """Wait until every actor is placed and its runner registered with the server
        (``timeout``, default ``ready_timeout``); returns what each says of itself (pid,
        host, worker id). Raises ConfigError naming the request when Ray cannot place an
        actor in time, or with the reason when an actor fails (its agent does not load, the
        server refuses it). Returns early (what is known so far) once ``stop_event`` is set."""
        ray = _ray()
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        readies = {actor.ready.remote(): i for i, actor in enumerate(self.actors)}
        runs = set(self.runs)
        infos: dict[int, dict[str, Any]] = {}
        while readies:
            if stop_event is not None and stop_event.is_set():
                return [infos[i] for i in sorted(infos)]
            left = deadline - time.monotonic()
            done, _ = ray.wait([*readies, *runs], num_returns=1, timeout=max(0.0, min(left, 1.0)))
            for ref in done:
                if ref in readies:
                    index = readies.pop(ref)
                    infos[index] = self._get(ray, ref, index)
                else:  # a run ended before every actor was ready: its error, or it was done
                    runs.discard(ref)
                    self._get(ray, ref, self.runs.index(ref))
            if readies and time.monotonic() >= deadline:
                self._fail_unready(ray, sorted(readies.values()), limit)
        self.infos = [infos[i] for i in range(len(self.actors))]
        return self.infos

    def _fail_unready(self, ray: Any, waiting: list[int], limit: float) -> None:
        placed = self._placed(ray)
        names = ", ".join(str(i + 1) for i in waiting)
        if placed is not None and set(waiting) - placed:
            unplaced = len(set(waiting) - placed)
            total, free = _resources(ray)
            if _room_for(ray, self.request):  # resources are free: the worker was slow to start
                why = (
                    f"Ray had not started {unplaced} of {len(self.actors)} runner actor(s) within "
                    f"{limit:g} s though the cluster has room for them (each asks for "
                    f"{self.describe_request()}; {free} free): a busy node can be slow to start a "
                    "worker process. Give a longer ready timeout"
                )
            else:
                why = (
                    f"Ray could not place {unplaced} of {len(self.actors)} runner actor(s) within "
                    f"{limit:g} s: each asks for {self.describe_request()}; the cluster has {total} in "
                    f"all, {free} free. Ask for less, or add nodes that have these resources"
                )
        elif placed is None:  # Ray's actor table could not be read: say both
            total, free = _resources(ray)
            why = (
                f"runner actor(s) {names} of {len(self.actors)} were not placed or did not register with "
                f"the server within {limit:g} s: each asks for {self.describe_request()}; the cluster has "
                f"{total} in all, {free} free; the server's URL must be reachable from the Ray nodes"
            )
        else:
            why = (
                f"runner actor(s) {names} of {len(self.actors)} did not register with the server within "
                f"{limit:g} s (is the server's URL reachable from the Ray nodes?)"
            )
        self.stop(grace=0.0, wait=False)
        raise ConfigError(why)

    def _placed(self, ray: Any) -> set[int] | None:
        """Indexes of the actors Ray has placed (alive or restarting), from its GCS; None when
        that cannot be asked."""
        try:
            from ray._private.state import actors as actor_table

            placed = set()
            for index, actor in enumerate(self.actors):
                state = actor_table(actor_id=actor._actor_id.hex()).get("State")
                if state not in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", 0, 1):
                    placed.add(index)
            return placed
        except Exception:  # noqa: BLE001 - a private API: only an aid to the message
            return None

    def _get(self, ray: Any, ref: Any, index: int) -> Any:
        """``ray.get(ref)``, a failure turned into a one-line ConfigError naming the actor."""
        try:
            return ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - Ray wraps the actor's error
            self.stop(grace=0.0, wait=False)
            raise ConfigError(
                f"Ray runner actor {index + 1} of {len(self.actors)} failed: {_reason(exc)}"
            ) from None

    def wait(self, timeout: float | None = None, stop_event: threading.Event | None = None) -> bool:
        """Block until every actor's run has ended (each did ``max_rollouts``), ``timeout``
        passes or ``stop_event`` is set; True when all ended. An actor that failed (or that
        Ray gave up restarting) raises ConfigError."""
        ray = _ray()
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(self.runs)
        while pending:
            if stop_event is not None and stop_event.is_set():
                return False
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                return False
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                self._get(ray, ref, self.runs.index(ref))
        return True

    def stop(
        self, grace: float | None = None, wait: bool = True, release: threading.Event | None = None
    ) -> dict[str, int]:
        """Stop every actor's runner (running rollouts get ``grace`` seconds, default
        ``self.grace``, then are released; at once when ``release`` is set meanwhile), then
        free the actors (and the Ray connection this object made). Returns the counts summed
        over the actors' last lives."""
        totals = dict.fromkeys(STATS, 0)
        if not self.actors:
            self._disconnect()
            return totals
        ray = _ray()
        grace = self.grace if grace is None else grace
        if wait:
            stops = [actor.stop.remote(grace) for actor in self.actors]
            deadline = time.monotonic() + grace + 30.0
            released = False
            pending = list(stops)
            while pending and time.monotonic() < deadline:
                if release is not None and release.is_set() and not released:
                    released = True
                    for actor in self.actors:
                        actor.release.remote()
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            for ref in stops:
                if ref in pending:
                    continue
                with contextlib.suppress(Exception):  # a dead actor has nothing to say
                    counts = ray.get(ref)
                    for name in STATS:
                        totals[name] += int(counts[name])
        self._kill_all()
        self._disconnect()
        return totals

    def _kill_all(self) -> None:
        if self.actors:
            ray = _ray()
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.runs.clear()

    def _disconnect(self) -> None:
        if self._owns_connection:
            self._owns_connection = False
            with contextlib.suppress(Exception):
                _ray().shutdown()

    def __enter__(self) -> RayRunners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_reachable(address: str) -> None:
    """A clear error, within CONNECT_TIMEOUT, when the cluster's address does not answer
    (``auto`` is left to Ray: it reads the address of a cluster started on this machine)."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, sep, port_text = target.rpartition(":")
    if not sep:
        host, port_text = target, "6379"
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"Ray address {address!r} must look like host:port or ray://host:port") from None
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} "
            "(start one with `ray start --head`, or give its address)"
        ) from None


def _resources(ray: Any) -> tuple[str, str]:
    def show(res: Mapping[str, float]) -> str:
        items = sorted(
            (k, v) for k, v in res.items() if not k.startswith("node:") and k != "object_store_memory"
        )
        return "{" + ", ".join(f"{k}={_gib(v) if k == 'memory' else f'{v:g}'}" for k, v in items) + "}"

    try:
        return show(ray.cluster_resources()), show(ray.available_resources())
    except Exception:  # noqa: BLE001
        return "?", "?"


def _room_for(ray: Any, request: Mapping[str, float]) -> bool:
    """Whether the cluster's free resources, summed over its nodes, cover one actor's request
    (a hint for the message only: one node must hold all of it)."""
    try:
        free = ray.available_resources()
    except Exception:  # noqa: BLE001
        return False
    return all(free.get(name, 0.0) >= amount for name, amount in request.items())


def _gib(amount: float) -> str:
    """Bytes as Ray's request shows them: GiB, or MiB below one GiB."""
    if amount >= 1024**3:
        return f"{amount / 1024**3:.2f}GiB"
    return f"{amount / 1024**2:.4g}MiB"


def _reason(exc: BaseException) -> str:
    """The actor's own error from what Ray raised (its ``cause``), in one line."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    line = text[-1] if text else type(exc).__name__
    return line if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {line}"
