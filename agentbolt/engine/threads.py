"""Choosing how many CPU threads the engine thread's forward passes use, by timing them.

On a CPU shared with other busy processes, every parallel operator waits for its slowest thread,
and a thread the OS has parked stalls them all: on a 2-core machine running other jobs, decode
steps with 1 thread measured 4-6x faster than with 2, while on an idle machine 2 threads win.
So the engine keeps measuring, for each range of batch sizes on its own (see
:class:`ThreadTuner`): every ``period`` decode steps it times a few steps with each
candidate count (interleaved, so a change in load hits both) and keeps the fastest until the next
probe. Probe steps do real work; nothing is spent on dummy runs.

Under load a probe step with the wrong count can be several times slower (8x measured for 2 threads
on a busy 2-core machine), so a candidate whose first trial is over ``slack`` times the best first
trial is dropped from the rest of the probe: it costs one slow step, not ``trials``. The survivors
are compared by the median of ``trials`` steps (3 by default), so one stalled step (a thread parked
by the OS) does not decide the count, as it did with the mean of two. Each probe that keeps the
count doubles the steps to the next one (up to 16x ``period``); a probe that changes it starts
again from ``period``, so a steady machine pays for few probes and a change of load is still seen.

``torch.set_num_threads`` is per thread for OpenMP, but it also sets the default that threads
started later inherit; that default is put back from a short-lived helper thread so the rest of
the process (training, other threads) keeps its own setting.
"""

from __future__ import annotations

import statistics
import threading
from collections import defaultdict

import torch

__all__ = ["ThreadTuner"]


class _Bucket:
    """The probe state of one range of batch sizes."""

    __slots__ = ("current", "period", "plan", "probed", "since_probe", "times")

    def __init__(self, current: int, period: int) -> None:
        self.current, self.period = current, period
        self.plan: list[int] = []
        self.times: dict[int, list[float]] = defaultdict(list)
        self.probed = False
        self.since_probe = period  # probe as soon as there is work


class ThreadTuner:
    """Picks the intra-op thread count of the calling (engine) thread from measured step times,
    for each range of batch sizes on its own (rows 1, 2-3, 4-7, ..., a power of two each).

    A step's best count depends on its size: one row gains nothing from a second thread while
    32 rows nearly halve their time with it. Compared across sizes, probe steps lied: a server's
    first steps decode a warm-up request or the first arrival alone, the batch then grows, and
    one count's probe step had 1 row where the other's had 32; so each range probes and keeps
    its own count, and inside a range a step's time is taken per row."""

    def __init__(
        self, max_threads: int | None = None, period: int = 48, trials: int = 3, slack: float = 1.5
    ) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.candidates = sorted({1, max(1, self.max_threads // 2), self.max_threads})
        self.period, self.trials, self.slack = period, trials, slack
        self.base_period, self.max_period = period, period * 16
        self._process_default = torch.get_num_threads()  # what threads started later should get
        self._buckets: dict[int, _Bucket] = {}
        self._active = self._bucket(1)

    @property
    def enabled(self) -> bool:
        return len(self.candidates) > 1

    @property
    def current(self) -> int:
        """The count kept for the batch size of the latest step."""
        return self._active.current

    @property
    def probing(self) -> bool:
        """Whether the latest step's range of batch sizes is in the middle of a probe."""
        return bool(self._active.plan)

    def chosen(self) -> dict[str, int]:
        """The count kept per range of batch sizes probed so far (``"4-7": 2``)."""
        return {_label(k): b.current for k, b in sorted(self._buckets.items()) if b.probed}

    def _bucket(self, rows: int) -> _Bucket:
        key = max(1, rows).bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.max_threads, self.base_period)
        return bucket

    def next_threads(self, rows: int = 1) -> int:
        """Thread count for the coming decode step of ``rows`` rows (applied to the calling thread)."""
        b = self._active = self._bucket(rows)
        if self.enabled and not b.plan and b.since_probe >= b.period:
            b.plan = [c for _ in range(self.trials) for c in self.candidates]
            b.times.clear()
        threads = b.plan[0] if b.plan else b.current
        _set_threads_here(threads, self._process_default)
        return threads

    def prefill_threads(self) -> int:
        """Thread count for a prefill (applied to the calling thread): the count kept for the
        largest batch sizes probed so far, all threads before any probe. A prefill is not probed:
        it multiplies as many rows as the largest decode steps or more, and before this it simply
        ran with whatever the latest decode step had set, often 1 thread after a server's first
        single-row steps: a 31-prompt prefill of SmolLM2 took 0.48-0.54 s served that way, where
        32-prompt prefills in process on 2 threads took 0.27-0.38 s (quiet 2-core machine)."""
        probed = [key for key, b in self._buckets.items() if b.probed]
        threads = self._buckets[max(probed)].current if probed else self.max_threads
        _set_threads_here(threads, self._process_default)
        return threads

    def record(self, threads: int, seconds: float, rows: int = 1) -> None:
        """The time a step of ``rows`` rows took with ``threads``."""
        b = self._bucket(rows)
        b.since_probe += 1
        if not b.plan or b.plan[0] != threads:
            return
        b.plan.pop(0)
        b.times[threads].append(seconds / max(1, rows))
        if len(b.times) == len(self.candidates) and all(len(t) == 1 for t in b.times.values()):
            best = min(t[0] for t in b.times.values())  # first round done: drop the slow ones
            slow = {c for c, t in b.times.items() if t[0] > self.slack * best}
            b.plan = [c for c in b.plan if c not in slow]
            for c in slow:
                del b.times[c]
        if not b.plan:
            best = min(b.times, key=lambda c: statistics.median(b.times[c]))
            kept = b.probed and best == b.current
            b.period = min(b.period * 2, self.max_period) if kept else self.base_period
            b.current, b.probed, b.since_probe = best, True, 0


def _label(key: int) -> str:
    low, high = 1 << (key - 1), (1 << key) - 1
    return str(low) if low == high else f"{low}-{high}"


def _set_threads_here(threads: int, default: int) -> None:
    if torch.get_num_threads() == threads:
        return
    torch.set_num_threads(threads)
    # set_num_threads also changed the default new threads start with: restore it elsewhere.
    helper = threading.Thread(target=torch.set_num_threads, args=(default,), daemon=True)
    helper.start()
    helper.join()
