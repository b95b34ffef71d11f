"""Child processes that end with their parent, however the parent ends.

A process agentbolt starts for a parent (a Trainer's runner, a server process) must not
outlive it. A runner left behind by a parent killed with SIGKILL (or SIGTERM, with no handler
to stop its children) retries a server that is gone, every few seconds, for ever, and holds the
parent's terminal output open. Two safeguards, both set up by the child:

- :func:`watch_pipe`: a thread blocked reading a pipe whose only write end the parent holds.
  The kernel closes that end when the parent ends, for whatever reason, on every OS; the read
  then returns and the thread ends the process.
- :func:`die_with_parent` (Linux): ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills
  the child when the parent ends, even while the child's interpreter is held in C code and its
  watchdog thread cannot run. The kernel sends it when the *thread* that started the child
  ends: only for children whose starting thread outlives them (the Trainer's runners, started
  and stopped by the thread in ``fit``).

The parent's side, :func:`stop_on_signals`: SIGTERM and SIGHUP, which would end it at once,
become an exception, so that it stops its children first, as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["die_with_parent", "stop_on_signals", "stopped_by_signal", "watch_pipe", "watch_sentinel"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel SIGKILL this process when its parent ends; exit now if the
    parent (``parent_pid``) has already ended. Elsewhere, nothing (:func:`watch_pipe` does it)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it ended before prctl: no signal will come
        os._exit(1)


def _exit_at_eof(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os._exit(1)


def watch_pipe(fd: int) -> None:
    """End this process (``os._exit``: no cleanup waits on a parent that is gone) once ``fd``,
    the read end of a pipe whose write end only the parent holds, reaches end of file."""
    threading.Thread(target=_exit_at_eof, args=(fd,), name="agentbolt-lifeline", daemon=True).start()


def watch_sentinel() -> None:
    """:func:`watch_pipe` for a child started by :mod:`multiprocessing` (spawn): its parent's
    sentinel becomes ready when the parent ends."""
    import multiprocessing.connection

    parent: Any = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="agentbolt-lifeline", daemon=True).start()


class _Stopped(BaseException):
    """Raised in the main thread by a SIGTERM or SIGHUP while :func:`stop_on_signals` is active."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception in the main thread (where they would kill the
    process at once), so the ``finally`` of the block stops what it started; afterwards the
    signal is raised again with its default action, and the process ends as it would have.
    Signals with a handler of the program's own, and other threads, are left alone; SIGINT
    already raises KeyboardInterrupt."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _raise_stopped)
    try:
        yield
    except _Stopped as stopped:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()
        signal.raise_signal(stopped.signum)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: a second one must not cut the cleanup short
    raise _Stopped(signum)


def stopped_by_signal(exc: BaseException | None) -> bool:
    """Whether ``exc`` (the exception leaving ``fit``) is a stop asked by a signal."""
    return isinstance(exc, _Stopped | KeyboardInterrupt)
