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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError, MissingExtra
from agentbolt.runner.agent import LitAgent, as_agent
from agentbolt.runner.worker import Runner, load_object

__all__ = ["RayRunners", "parse_memory", "serve_on_ray"]

log = logging.getLogger("agentbolt.runner.ray")

LOCAL = "local"
"""The address that starts a local Ray cluster in this process (as None does)."""

CONNECT_TIMEOUT = 5.0
"""Seconds to reach a cluster's address before Ray is asked to connect to it."""

STATS = ("completed", "failed", "lost", "abandoned")


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


def parse_memory(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a number of bytes -> bytes (Ray's ``memory``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b?)\s*", text.lower())
    value = 0
    if match:
        number, unit, binary = match.groups()
        power = "kmgt".index(unit) + 1 if unit else 0
        value = int(float(number) * (1024 if binary else 1000) ** power)
    if value <= 0:
        raise ConfigError(f"memory {text!r} must be a size above 0 such as 2GiB, 512MB or a number of bytes")
    return value


# ---------------------------------------------------------------------------- the actor


def _load_payload(payload: tuple[str, Any]) -> LitAgent:
    """The agent an actor runs: ``("spec", "module:object")``, ``("name", (module, qualname))``
    or ``("pickle", bytes)`` (cloudpickle's, as Ray ships objects)."""
    kind, value = payload
    if kind == "spec":
        return as_agent(load_object(value, "agent"))
    if kind == "name":
        module, qualname = value
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return as_agent(obj)
    from ray import cloudpickle

    return as_agent(cloudpickle.loads(value))


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

    def _describe_request(self) -> str:
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
        payload = _payload(agent)
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
                f"Ray refused the runner actors' options ({self._describe_request()}): {exc}"
            ) from None
        log.info("started %d runner actor(s), each asking for %s", self.replicas, self._describe_request())
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
            why = (
                f"Ray could not place {unplaced} of {len(self.actors)} runner actor(s) within {limit:g} s: "
                f"each asks for {self._describe_request()}; the cluster has {total} in all, {free} free. "
                "Ask for less, or add nodes that have these resources"
            )
        elif placed is None:  # Ray's actor table could not be read: say both
            total, free = _resources(ray)
            why = (
                f"runner actor(s) {names} of {len(self.actors)} were not placed or did not register with "
                f"the server within {limit:g} s: each asks for {self._describe_request()}; the cluster has "
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


def _payload(agent: Any) -> tuple[str, Any]:
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
    name = _global_name(agent)
    if name is not None:
        return "name", name
    from ray import cloudpickle

    try:
        return "pickle", cloudpickle.dumps(agent)
    except Exception as exc:  # noqa: BLE001 - whatever stops pickling
        raise ConfigError(
            f"the agent cannot be sent to Ray actors: it does not pickle ({type(exc).__name__}: {exc})"
        ) from None


def _global_name(agent: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` when ``agent`` is a global of an importable module (a
    ``@rollout`` function at module level), else None."""
    module = getattr(agent, "__module__", None)
    qualname = vars(agent).get("__qualname__") if hasattr(agent, "__dict__") else None
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    if module == "__main__":
        return None  # a fresh interpreter has no such module: cloudpickle sends it by value
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return (module, qualname) if obj is agent else None


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


# ---------------------------------------------------------------------------- the CLI


def serve_on_ray(runners: RayRunners, agent: Any, server_url: str, token: str | None) -> dict[str, int]:
    """``agentbolt runner --ray``: start the actors, wait until they are ready, serve until
    each did ``max_rollouts`` or SIGINT/SIGTERM (the first stops them gracefully, a second
    releases running rollouts at once). Returns the summed counts."""
    stop, release = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            log.warning("second signal: releasing running attempts now")
            release.set()
        else:
            log.info("stopping: no new rollouts; running ones get %.0f s to finish", runners.grace)
            stop.set()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        runners.start(agent, server_url, token=token)
        for sig in previous:  # after ray.init, which sets a SIGTERM handler that exits at once
            signal.signal(sig, on_signal)
        infos = runners.wait_ready(stop_event=stop)
        for info in infos:
            log.info(
                "Ray runner %d: %s (pid %s on %s)",
                info["index"] + 1,
                info["worker_id"],
                info["pid"],
                info["host"],
            )
        print(
            f"{len(infos)} Ray runner actor(s) ready; each asks for {runners._describe_request()}", flush=True
        )
        runners.wait(stop_event=stop)
        return runners.stop(release=release)
    except BaseException:
        runners.stop(grace=0.0, wait=False)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def run_cli(
    address: str | None,
    agent: Any,
    server_url: str,
    token: str | None,
    replicas: int | None,
    cpus: float | None,
    memory: str | None,
    resources: list[str] | None,
    ready_timeout: float,
    concurrency: int,
    lease_seconds: float | None,
    max_rollouts: int | None,
    tracing: bool | None,
) -> None:
    """The ``agentbolt runner --ray ...`` command's work (options checked, one-line errors)."""
    if address is None:
        raise ConfigError("--replicas and the --ray-* options need --ray ADDRESS (or --ray local)")
    runners = RayRunners(
        address=address,
        replicas=replicas or 1,
        num_cpus=1.0 if cpus is None else cpus,
        memory=parse_memory(memory) if memory is not None else None,
        resources=_parse_resources(resources or []),
        concurrency=concurrency,
        lease_seconds=lease_seconds,
        max_rollouts=max_rollouts,
        ready_timeout=ready_timeout,
        tracing=tracing,
    )
    totals = serve_on_ray(runners, agent, server_url, token)
    print("stopped: " + ", ".join(f"{totals[name]} {name}" for name in STATS), flush=True)


def _parse_resources(items: list[str]) -> dict[str, float]:
    """``["sandbox=1", "gpu_slot=0.5"]`` -> ``{"sandbox": 1.0, "gpu_slot": 0.5}``."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value < 0:
            raise ConfigError(f"--ray-resource {item!r} must look like NAME=AMOUNT, e.g. sandbox=1")
        if name.strip() in out:
            raise ConfigError(f"--ray-resource {name.strip()!r} is given twice")
        out[name.strip()] = value
    return out
