"""Running the server: in the foreground (CLI), in a background thread (tests, Trainer) or in
its own process (benchmarks, chaos tests)."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from agentbolt.server.app import create_app
from agentbolt.server.config import ServerConfig

__all__ = ["ServerProcess", "ServerThread", "free_port", "serve", "start_together", "wait_healthy"]

log = logging.getLogger("agentbolt.server")


KEEP_ALIVE_S = 75
"""Seconds an idle client connection is kept open: longer than any client keeps one idle."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _uvicorn_config(app: Any, config: ServerConfig, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        # Idle keep-alive connections are closed by the client first: httpx and the OpenAI
        # client drop theirs after 5 s, uvicorn's own default. With equal timers a request
        # sent on a connection the server is closing at that moment fails before it is read
        # (benchmarks/scale_sim.py saw ~3% of 300 agents' calls fail that way under load).
        timeout_keep_alive=KEEP_ALIVE_S,
        # proxy_headers stays on: a claim's gateway URL is built from the request's scheme and
        # host, which X-Forwarded-Proto sets behind a TLS-terminating balancer (FORWARDED_ALLOW_IPS)
        server_header=False,  # "server: uvicorn" tells a client nothing it needs
    )


def serve(config: ServerConfig, log_level: str = "info", on_ready: Callable[[], None] | None = None) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM. ``on_ready`` runs once the store
    is open, just before the server starts listening."""
    app = create_app(config)
    if on_ready is not None:
        on_ready()
    _settle_gc()
    uvicorn.Server(_uvicorn_config(app, config, log_level)).run()


def _settle_gc() -> None:
    """Keep the cyclic garbage collector off what start-up built (modules, the app, its
    routes: it lives as long as the process) and run it less often: each request allocates
    a few dozen short-lived containers, and the collections they triggered, each walking
    the long-lived heap, cost about 5% of the server's CPU. Only for a server that owns its
    process (``serve``): a server thread leaves its host's collector alone."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)


def wait_healthy(url: str, timeout: float = 30.0, token: str | None = None) -> None:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server at {url} not healthy after {timeout:.0f} s")
        time.sleep(0.05)


class ServerThread:
    """The server in a daemon thread of this process, on an ephemeral port by default."""

    def __init__(
        self, config: ServerConfig | None = None, store: Any = None, log_level: str = "warning"
    ) -> None:
        config = config or ServerConfig(db=":memory:")
        if config.port == 0 or config.port == ServerConfig.port:
            from dataclasses import replace

            config = replace(config, port=free_port())
        self.config = config
        self.app = create_app(config, store=store)
        self._server = uvicorn.Server(_uvicorn_config(self.app, config, log_level))
        # no signal handlers to keep off: uvicorn installs them only from the main thread
        self._thread = threading.Thread(target=self._server.run, name="agentbolt-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agentbolt server thread failed to start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _process_main(config: ServerConfig, log_level: str, profile: str | None = None) -> None:
    from agentbolt.lifeline import watch_sentinel

    watch_sentinel()  # ends with its parent, even one killed with SIGKILL
    logging.basicConfig(level=log_level.upper())
    if profile is None:
        serve(config, log_level)
        return
    import cProfile
    import signal

    def stop(*_: object) -> None:  # uvicorn raises the signal again once it has shut down
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    profiler = cProfile.Profile(time.process_time)  # CPU time: other load does not count
    profiler.enable()
    try:
        serve(config, log_level)
    finally:  # a graceful stop (SIGTERM) returns from serve()
        profiler.disable()
        profiler.dump_stats(profile)


class ServerProcess:
    """The server in a child process (so it can be killed with SIGKILL and restarted)."""

    def __init__(self, config: ServerConfig, log_level: str = "warning", profile: str | None = None) -> None:
        """``profile``: a path where the process writes its cProfile statistics when stopped."""
        if config.port == ServerConfig.port or config.port == 0:
            from dataclasses import replace

            config = replace(config, port=free_port())
        self.config, self.log_level, self.profile = config, log_level, profile
        self.process: multiprocessing.process.BaseProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=_process_main, args=(self.config, self.log_level, self.profile), daemon=True
        )
        self.process.start()
        token = next(iter(self.config.tokens), None)
        wait_healthy(self.url, timeout, token)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            self.kill()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(servers: list[ServerProcess], timeout: float = 120.0) -> None:
    """Start server processes (replicas) side by side: each takes seconds to import and
    migrate. Raises the first start's error once every start has ended."""
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.start(timeout=timeout)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
