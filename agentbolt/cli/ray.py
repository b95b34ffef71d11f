"""``agentbolt runner --ray``: the command line's options read into
:class:`~agentbolt.runner.ray_runners.RayRunners`, which then serve until each actor did its
rollouts or a signal stops them."""

from __future__ import annotations

import logging
import re
import signal
import threading
from typing import Any

from agentbolt.cli.assignments import assignment, malformed
from agentbolt.errors import ConfigError
from agentbolt.runner.ray_actor import STATS
from agentbolt.runner.ray_runners import RayRunners

__all__ = ["parse_memory", "parse_resources", "run_cli", "serve_on_ray"]

log = logging.getLogger("agentbolt.runner.ray")


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
            f"{len(infos)} Ray runner actor(s) ready; each asks for {runners.describe_request()}", flush=True
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
        resources=parse_resources(resources or []),
        concurrency=concurrency,
        lease_seconds=lease_seconds,
        max_rollouts=max_rollouts,
        ready_timeout=ready_timeout,
        tracing=tracing,
    )
    totals = serve_on_ray(runners, agent, server_url, token)
    print("stopped: " + ", ".join(f"{totals[name]} {name}" for name in STATS), flush=True)


def parse_resources(items: list[str]) -> dict[str, float]:
    """``["sandbox=1", "gpu_slot=0.5"]`` -> ``{"sandbox": 1.0, "gpu_slot": 0.5}``."""
    form = ("--ray-resource", "NAME=AMOUNT", "sandbox=1")
    out: dict[str, float] = {}
    for item in items:
        name, amount = assignment(item, *form)
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if value < 0:
            raise malformed(item, *form)
        if name in out:
            raise ConfigError(f"--ray-resource {name!r} is given twice")
        out[name] = value
    return out
