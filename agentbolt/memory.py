"""The memory of a whole process tree, honestly counted: PSS (proportional set size) summed over
a process and all its descendants, sampled by a background thread.

Summing RSS over a tree counts every page shared after a fork (or mapped from the same file)
once per process that maps it; PSS divides each shared page among the processes sharing it,
so the sum over the tree is the memory the tree holds. Linux only (``/proc/<pid>/smaps_rollup``);
elsewhere :func:`tree_pss_bytes` returns None and :class:`PeakMemory` reports nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

__all__ = [
    "KERNEL_CACHE_CAPACITY",
    "PeakMemory",
    "bound_kernel_cache",
    "descendants",
    "large_blocks_mapped",
    "map_large_blocks",
    "pss_bytes",
    "release_free_memory",
    "rss_bytes",
    "tree_pss_bytes",
]


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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int) -> int | None:
    """One process's resident size in bytes (``/proc/<pid>/statm``: no page walk, unlike PSS);
    None when it is gone or there is no /proc. Never below its PSS."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
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

    A spike shorter than ``interval`` can be missed. PSS walks every page table of a process
    while holding its memory map's lock (``perf record -a`` over 20 s of ``agentbolt demo``'s
    training on the Xeon AMX machine: the kernel's ``smaps_account`` alone, 3.16% of all
    samples), so each sample
    first sums the tree's resident sizes, which cost no walk and are never below PSS: where that
    sum is not above the peak so far, the tree's PSS cannot be either, and the walk is skipped
    (``skipped`` counts those samples). The peak is the same as with every sample walked."""

    def __init__(self, pid: int | None = None, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.peak_bytes: int | None = None
        self.samples = 0
        self.skipped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int | None:
        """The tree's PSS now, or None where it was not read: no /proc, or (once there is a
        peak) its resident sizes sum to no more than that peak."""
        if self.peak_bytes is not None:
            root = os.getpid() if self.pid is None else self.pid
            resident = sum(rss_bytes(p) or 0 for p in (root, *descendants(root)))
            if resident <= self.peak_bytes:
                self.skipped += 1
                return None
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


@functools.cache
def _glibc_function(name: str) -> Callable[..., int] | None:
    """A function of the C library when it is glibc's (None elsewhere); looked up once."""
    lib = ctypes.util.find_library("c")
    if not lib:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None


KERNEL_CACHE_CAPACITY = 256
"""How many compiled oneDNN primitives :func:`bound_kernel_cache` lets a process keep (oneDNN's
own default is 1024)."""


def bound_kernel_cache(capacity: int = KERNEL_CACHE_CAPACITY) -> bool:
    """Keep at most ``capacity`` compiled oneDNN primitives in this process (the least recently
    used are dropped), unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is already set; returns whether
    this call set it.

    PyTorch multiplies bfloat16 matrices on CPUs with bfloat16 units through oneDNN, which
    compiles a primitive for every new shape and keeps up to 1024 of them. Training where the
    engine runs makes new shapes all the time: each update's token count, each decode step's row
    count. Traced on a 2-core Xeon with AMX, a full ``agentbolt demo`` grew its anonymous
    mappings under 1 MB from 11 to 221 MB (at most 128 MB with 256 primitives kept). Four quiet
    demos alternated there peaked at 2.16 and 2.18 GB (whole process tree) with 256 kept, 2.45
    and 2.50 GB with 1024, in about the same time (222 s against 208-227 s; README). oneDNN
    reads the variable when it builds its first primitive: call this before any bfloat16 product
    (``agentbolt demo`` and ``agentbolt train`` do, at start)."""
    if any(f"{prefix}_PRIMITIVE_CACHE_CAPACITY" in os.environ for prefix in ("ONEDNN", "DNNL")):
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(int(capacity))
    return True


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``); False where there
    is no glibc. A training pass frees its activations into the heap, which glibc otherwise keeps
    mapped: the process would hold them through the next rollouts and validation. The engine's
    batcher calls it at the first idle step after work. The batch's key-value cache, logits and activations are freed into glibc's heaps, which
    keep them mapped (its mmap threshold rises to 32 MB as blocks are freed). Served 40 mixed
    batches of 1-32 chats (``benchmarks/engine_memory.py``, SmolLM2 in bfloat16, 2-core EPYC),
    ``agentbolt model serve`` held 2.18-2.24 GB between batches at the end without this, 1.37 GB
    with it (0.98 GB at start; the rest is mostly oneDNN's compiled kernels), in the same time
    (237-243 s against 240-251 s; 41 hand-backs, 1.4-1.5 s together). The peak inside the
    largest batch is about the same (2.12-2.14 GB against 2.18-2.24). One ``malloc_trim`` per
    idle moment costs the next batch the page faults of the memory it touches again, once, where
    mapping every large block would cost them at every large allocation of every step. Without
    glibc nothing is handed back, and nothing counted."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20
"""The ceiling of glibc's own (dynamic) threshold on 64-bit systems: what
:func:`large_blocks_mapped` sets on exit unless :func:`map_large_blocks` set another."""
_THRESHOLD_AFTER = [_GLIBC_MMAP_THRESHOLD_MAX]


def map_large_blocks(threshold: int = 2**20) -> bool:
    """From now on, in the whole process, every allocation of ``threshold`` bytes or more gets its
    own memory map, handed back to the system when freed (glibc's ``M_MMAP_THRESHOLD``, kept
    after :func:`large_blocks_mapped` blocks too); False without glibc.

    Otherwise blocks up to 32 MB (the threshold glibc raises as mapped blocks are freed, and
    what :func:`large_blocks_mapped` leaves) come from the heaps, and each thread that
    allocates (the engine's, the trainer's) gets a heap of its own: the key-value caches and
    activations of the engine's batches, freed between two blocks that live on, leave holes that
    ``malloc_trim`` cannot hand back. ``agentbolt demo`` calls this first (figures there)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        return False
    _THRESHOLD_AFTER[0] = int(threshold)
    return True


@contextlib.contextmanager
def large_blocks_mapped(threshold: int = 128 * 2**10) -> Iterator[bool]:
    """Inside the block, every allocation of ``threshold`` bytes or more gets its own memory map
    (glibc's ``M_MMAP_THRESHOLD``), handed back to the system the moment it is freed; yields
    whether that took effect (False without glibc).

    glibc serves allocations below its threshold from the heap, and that threshold rises with the
    blocks freed, up to 32 MB: the tensors of a training pass then come from the heap, and those
    it frees between two that live on (a layer's activations between the inputs checkpointing
    keeps) become holes the process keeps until ``malloc_trim``. Its resident size then follows
    what the pass allocated over time, not what it holds: a checkpointed forward pass of SmolLM2
    over 2048 tokens held 0.15-0.18 GB once the heap was trimmed, while the process had grown by
    0.6-1.0 GB. A GRPO update of the demo (24 rows of up to 169 tokens, replayed offline) grew the
    process by 0.71-0.93 GB, and by 0.49-0.54 GB inside this block. Room already free in the heap
    still serves allocations of any size (a trim gives its pages back, not the room). Each
    mapped allocation costs a system call and page faults on first use: this is for passes that
    free much (training), not for a decode loop. On exit the threshold is set to 32 MB, the
    highest value glibc's own adjustment reaches on 64-bit systems (a threshold once set cannot
    be handed back to that adjustment)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        yield False
        return
    try:
        yield True
    finally:
        mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_AFTER[0])
