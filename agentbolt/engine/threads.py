"""Choosing how many CPU threads the engine thread's forward passes use, by timing them.

On a CPU shared with other busy processes, every parallel operator waits for its slowest thread,
and a thread the OS has parked stalls them all: on a 2-core machine running other jobs, decode
steps with 1 thread measured 4-6x faster than with 2, while on an idle machine 2 threads win.
So the engine keeps measuring: every ``period`` decode steps it times a few steps with each
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


class ThreadTuner:
    """Picks the intra-op thread count of the calling (engine) thread from measured step times."""

    def __init__(
        self, max_threads: int | None = None, period: int = 48, trials: int = 3, slack: float = 1.5
    ) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.candidates = sorted({1, max(1, self.max_threads // 2), self.max_threads})
        self.period, self.trials, self.slack = period, trials, slack
        self.base_period, self.max_period = period, period * 16
        self._probed = False
        self.current = self.max_threads
        self._process_default = torch.get_num_threads()  # what threads started later should get
        self._plan: list[int] = []
        self._times: dict[int, list[float]] = defaultdict(list)
        self._since_probe = period  # probe as soon as there is work

    @property
    def enabled(self) -> bool:
        return len(self.candidates) > 1

    def next_threads(self) -> int:
        """Thread count for the coming decode step (applied to the calling thread)."""
        if self.enabled and not self._plan and self._since_probe >= self.period:
            self._plan = [c for _ in range(self.trials) for c in self.candidates]
            self._times.clear()
        threads = self._plan[0] if self._plan else self.current
        _set_threads_here(threads, self._process_default)
        return threads

    def record(self, threads: int, seconds: float) -> None:
        self._since_probe += 1
        if not self._plan or self._plan[0] != threads:
            return
        self._plan.pop(0)
        self._times[threads].append(seconds)
        if len(self._times) == len(self.candidates) and all(len(t) == 1 for t in self._times.values()):
            best = min(t[0] for t in self._times.values())  # first round done: drop the slow ones
            slow = {c for c, t in self._times.items() if t[0] > self.slack * best}
            self._plan = [c for c in self._plan if c not in slow]
            for c in slow:
                del self._times[c]
        if not self._plan:
            best = min(self._times, key=lambda c: statistics.median(self._times[c]))
            kept = self._probed and best == self.current
            self.period = min(self.period * 2, self.max_period) if kept else self.base_period
            self.current, self._probed, self._since_probe = best, True, 0


def _set_threads_here(threads: int, default: int) -> None:
    if torch.get_num_threads() == threads:
        return
    torch.set_num_threads(threads)
    # set_num_threads also changed the default new threads start with: restore it elsewhere.
    helper = threading.Thread(target=torch.set_num_threads, args=(default,), daemon=True)
    helper.start()
    helper.join()
