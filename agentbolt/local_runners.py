"""A Trainer's local runner processes: how they start, how each says it has registered with the
server, and how they stop.

Each runner is a fresh interpreter whose main module is agentbolt's own (``python -c`` calling
:func:`child_main`), never the user's script. multiprocessing's ``spawn`` and ``forkserver``
import the parent's main module in the child: a script without an ``if __name__ ==
"__main__":`` guard ran its training again there, and a script read from stdin, ``python -c``
or a notebook has no main module to import. The agent goes over the child's stdin, pickled with
cloudpickle: by name when it is a global of a module the child can import (the parent's
``sys.path`` goes along), by value otherwise (classes and functions of ``__main__``, closures,
a module loaded from a file path outside ``sys.path``). An agent that does not pickle at all (it
holds a lock, a socket, a live client) falls back to a ``fork`` of the parent where the
platform has one.

A child says it has registered by writing a byte on a pipe of its own, and ends with its parent
(:mod:`agentbolt.lifeline`): its stdin, from which it reads the agent, stays open as the
parent's lifeline (agents read an empty stdin).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.lifeline import die_with_parent, watch_pipe
from agentbolt.runner.agent import LitAgent
from agentbolt.runner.travel import how_to_start, unpickled

__all__ = ["LocalRunners", "child_main"]

log = logging.getLogger("agentbolt.trainer")

RUNNER_PRELOAD = ("openai",)
"""Modules a runner process imports in the background once it has registered (when installed)."""

URGENT_GRACE = 5.0
"""Seconds runners get to release their attempts when the Trainer stops on a signal."""

_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from agentbolt.local_runners import child_main; child_main()"
_HEADER = struct.Struct("!Q")


# ---------------------------------------------------------------------------- the runner process


def _import_quietly(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed or broken: the agent's own import says why
            log.debug("runner preload of %s failed", name, exc_info=True)


def _run(
    agent: LitAgent,
    url: str,
    token: str | None,
    concurrency: int,
    lease: float | None,
    registered_fd: int,
) -> None:
    """Run the runner until it is stopped, then end the process at once: an abandoned sync
    agent's thread would hold the interpreter's exit for as long as it runs."""
    from agentbolt.runner.worker import Runner

    class _Runner(Runner):
        async def _register(self) -> None:
            await super()._register()
            with contextlib.suppress(OSError):
                os.write(registered_fd, b"r")
                os.close(registered_fd)
            # the OpenAI SDK most agents call takes seconds to import (3.5 s measured on a loaded
            # 2-core machine): import it now, while the trainer loads its model, not inside the
            # first rollout, where it held up the first step
            threading.Thread(target=_import_quietly, args=(RUNNER_PRELOAD,), daemon=True).start()

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s runner %(levelname)s %(message)s")
    code = 0
    try:
        _Runner(agent, url, token=token, concurrency=concurrency, lease_seconds=lease).run_sync()
    except (KeyboardInterrupt, SystemExit):
        code = 1
    except BaseException:  # noqa: BLE001 - printed for the trainer's "its error is printed above"
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def child_main() -> None:
    """A runner process started by :class:`LocalRunners`: ``argv`` is agentbolt's folder, the
    registration pipe's fd and the parent's pid; stdin brings the settings and the agent."""
    registered_fd, parent = int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(parent)
    lifeline = os.dup(0)  # not inherited by the agent's own subprocesses
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    (size,) = _HEADER.unpack(_read(lifeline, _HEADER.size))
    settings = pickle.loads(_read(lifeline, size))
    watch_pipe(lifeline)
    os.set_inheritable(registered_fd, False)
    sys.path[:] = [*settings["sys_path"], *(p for p in sys.path if p not in settings["sys_path"])]
    sys.argv = [sys.argv[0]]
    _run(
        unpickled(settings["agent"]),
        settings["url"],
        settings["token"],
        settings["concurrency"],
        settings["lease"],
        registered_fd,
    )


def _read(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:  # the parent ended before it sent everything
            os._exit(1)
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _fork_main(
    agent: LitAgent,
    url: str,
    token: str | None,
    concurrency: int,
    lease: float | None,
    registered_fd: int,
    lifeline: tuple[int, int],
    parent: int,
) -> None:
    """A forked runner process (an agent that does not pickle)."""
    os.close(lifeline[1])
    die_with_parent(parent)
    watch_pipe(lifeline[0])
    _run(agent, url, token, concurrency, lease, registered_fd)


# ---------------------------------------------------------------------------- the parent's side


class _Child:
    """One runner process, started either way, and the read end of its registration pipe."""

    def __init__(self, handle: subprocess.Popen[bytes] | Any, registered_fd: int) -> None:
        self.handle, self.registered_fd = handle, registered_fd
        self.registered = self.closed = False

    @property
    def pid(self) -> int:
        return int(self.handle.pid)

    @property
    def exitcode(self) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    def wait(self, timeout: float) -> None:
        if isinstance(self.handle, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.handle.wait(max(timeout, 0.0))
        else:
            self.handle.join(max(timeout, 0.0))

    def signal(self, sig: int) -> None:
        if self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def read_registration(self) -> None:
        """Read what the child wrote: a byte once it registered; end of file once it ended."""
        if self.closed:
            return
        data = os.read(self.registered_fd, 1)
        if data:
            self.registered = True
        if not data or self.registered:
            os.close(self.registered_fd)
            self.closed = True


class LocalRunners:
    """``n`` runner processes on this machine."""

    def __init__(self, n: int, concurrency: int, lease_seconds: float | None) -> None:
        self.n, self.concurrency, self.lease_seconds = n, concurrency, lease_seconds
        self.start_method: str | None = None
        self.children: list[_Child] = []
        self._lifeline: int | None = None  # the write end the forked children watch

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self.children]

    def start(self, agent: LitAgent, url: str, token: str | None) -> str:
        """Start the processes; returns how (``subprocess`` or ``fork``)."""
        self.start_method, payload = how_to_start(agent)
        for _ in range(self.n):
            read_end, write_end = os.pipe()
            try:
                if self.start_method == "fork":
                    handle = self._fork(payload, url, token, write_end)
                else:
                    handle = self._spawn(payload, url, token, write_end)
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)
            self.children.append(_Child(handle, read_end))
        return self.start_method

    def _spawn(
        self, agent: bytes, url: str, token: str | None, registered_fd: int
    ) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[1])  # where this agentbolt is imported from
        command = [
            sys.executable,
            *_interpreter_flags(),
            "-c",
            _BOOT,
            root,
            str(registered_fd),
            str(os.getpid()),
        ]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(registered_fd,))
        settings = {
            "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            "agent": agent,
            "url": url,
            "token": token,
            "concurrency": self.concurrency,
            "lease": self.lease_seconds,
        }
        data = pickle.dumps(settings)
        # written by a thread: a large agent fills the pipe until the child reads it, and the
        # next child need not wait for this one's start-up
        threading.Thread(target=_send, args=(proc, _HEADER.pack(len(data)) + data), daemon=True).start()
        return proc

    def _fork(self, agent: LitAgent, url: str, token: str | None, registered_fd: int) -> Any:
        if self._lifeline is None:
            read_end, self._lifeline = os.pipe()
            self._lifeline_read = read_end
        ctx: Any = multiprocessing.get_context("fork")
        lifeline = (self._lifeline_read, self._lifeline)
        args = (agent, url, token, self.concurrency, self.lease_seconds, registered_fd, lifeline, os.getpid())
        proc = ctx.Process(target=_fork_main, args=args, daemon=True)
        proc.start()
        return proc

    def wait_registered(self, url: str, timeout: float | None) -> None:
        """Wait until every runner has registered with the server; a clear error when one died
        or stays silent past ``timeout`` seconds (None: no check)."""
        if timeout is None:
            return
        deadline = time.monotonic() + timeout
        total = len(self.children)
        while True:
            waiting = [(i, c) for i, c in enumerate(self.children, 1) if not c.registered]
            if not waiting:
                return
            for index, child in waiting:
                if not child.closed and child.exitcode is not None:
                    child.read_registration()  # what it wrote before it ended
                if child.closed and not child.registered:
                    child.wait(2.0)  # closed its pipe: its exit code comes in a moment
                    raise ConfigError(
                        f"runner {index} of {total} (pid {child.pid}, started with {self.start_method}) "
                        f"exited with code {child.exitcode} before it registered with the server at "
                        f"{url}; its error is printed above"
                    )
            if time.monotonic() > deadline:
                index, child = waiting[0]
                hint = (
                    "A process forked while another of its threads holds a lock can hang: make the agent "
                    "pickle (build what it holds inside execute_rollout) or start no threads before "
                    "Trainer.fit"
                    if self.start_method == "fork"
                    else "Its agent's imports may be slow or stuck"
                )
                raise ConfigError(
                    f"runner {index} of {total} (pid {child.pid}, started with {self.start_method}) "
                    f"did not register with the server at {url} within {timeout:g} s "
                    f"(runner_start_timeout). {hint}; or raise runner_start_timeout."
                )
            fds = [c.registered_fd for _, c in waiting if not c.closed]
            ready, _, _ = select.select(fds, [], [], 0.05)
            for _, child in waiting:
                if child.registered_fd in ready:
                    child.read_registration()

    def stop(self, grace: float = 15.0, urgent: bool = False) -> None:
        """SIGTERM: each runner stops claiming and gets its own grace for running rollouts;
        ``urgent`` (the Trainer was stopped by a signal) sends a second signal, so they release
        their attempts at once, and waits at most :data:`URGENT_GRACE` seconds. Then SIGKILL."""
        for child in self.children:
            child.signal(signal.SIGTERM)
            if urgent:  # another signal: two SIGTERMs sent at once may arrive as one
                child.signal(signal.SIGINT)
        deadline = time.monotonic() + (min(grace, URGENT_GRACE) if urgent else grace)
        for child in self.children:
            child.wait(max(0.1, deadline - time.monotonic()))
            if child.exitcode is None:
                child.signal(signal.SIGKILL)
                child.wait(2.0)
        for child in self.children:
            if not child.closed:
                os.close(child.registered_fd)
            if isinstance(child.handle, subprocess.Popen) and child.handle.stdin is not None:
                with contextlib.suppress(OSError):
                    child.handle.stdin.close()
        if self._lifeline is not None:
            os.close(self._lifeline)
            os.close(self._lifeline_read)
            self._lifeline = None
        self.children.clear()


def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(OSError, ValueError):  # the child ended (or was stopped) first
        proc.stdin.write(data)
        proc.stdin.flush()


def _interpreter_flags() -> list[str]:
    """This interpreter's options (``-X``, ``-W``, ``-O``...), as multiprocessing passes them."""
    return list(subprocess._args_from_interpreter_flags())  # type: ignore[attr-defined]
