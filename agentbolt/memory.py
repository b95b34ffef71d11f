"""The memory of a whole process tree, honestly counted: PSS (proportional set size) summed over
a process and all its descendants, sampled by a background thread.

Summing RSS over a tree counts every page shared after a fork (or mapped from the same file)
once per process that maps it; PSS divides each shared page among the processes sharing it,
so the sum over the tree is the memory the tree holds. Linux only (``/proc/<pid>/smaps_rollup``);
elsewhere :func:`tree_pss_bytes` returns None and :class:`PeakMemory` reports nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path
from types import TracebackType

__all__ = ["PeakMemory", "descendants", "pss_bytes", "release_free_memory", "tree_pss_bytes"]


def descendants(pid: int) -> list[int]:
    """The children of ``pid``, their children, and so on (from ``/proc/<pid>/task/*/children``)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            todo.extend(children)
    return found


def pss_bytes(pid: int) -> int | None:
    """One process's PSS in bytes; None when it is gone or the kernel does not say."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def tree_pss_bytes(pid: int | None = None) -> int | None:
    """PSS summed over ``pid`` (default: this process) and all its descendants; None where
    ``/proc/<pid>/smaps_rollup`` cannot be read (not Linux)."""
    root = os.getpid() if pid is None else pid
    own = pss_bytes(root)
    if own is None:
        return None
    return own + sum(pss_bytes(child) or 0 for child in descendants(root))


class PeakMemory:
    """The peak of :func:`tree_pss_bytes` while the ``with`` block runs, sampled every
    ``interval`` seconds by a daemon thread (plus once at start and at exit)::

        with PeakMemory() as peak:
            ...
        print(peak.describe())  # "peak memory: 1.84 GB (whole process tree, PSS)"

    A spike shorter than ``interval`` can be missed; the sampling itself costs about a
    millisecond of CPU per process and sample."""

    def __init__(self, pid: int | None = None, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.peak_bytes: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int | None:
        now = tree_pss_bytes(self.pid)
        if now is not None:
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes or 0, now)
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        if self.sample() is not None:  # nothing to sample where /proc has no smaps_rollup
            self._thread = threading.Thread(target=self._loop, name="agentbolt-peak-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.sample()

    @property
    def peak_gb(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / 1e9

    def describe(self) -> str:
        if self.peak_gb is None:
            return "peak memory: not measured (needs Linux /proc/<pid>/smaps_rollup)"
        return f"peak memory: {self.peak_gb:.2f} GB (whole process tree, PSS)"


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``); False where there
    is no glibc. A training pass frees its activations into the heap, which glibc otherwise keeps
    mapped: the process would hold them through the next rollouts and validation."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
