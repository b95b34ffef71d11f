"""The thread-count tuner picks the fastest measured setting and leaves other threads alone."""

from __future__ import annotations

import threading

import torch

from agentbolt.engine.threads import ThreadTuner


def _in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def test_probe_picks_the_fastest_count_and_reprobes() -> None:
    def run() -> list[int]:
        tuner = ThreadTuner(max_threads=4, period=5, trials=2)
        assert tuner.candidates == [1, 2, 4]
        speed = {1: 0.9, 2: 0.2, 4: 0.5}  # seconds per step: 2 threads is fastest here
        chosen = []
        for _ in range(20):
            n = tuner.next_threads()
            assert torch.get_num_threads() == n
            tuner.record(n, speed[n])
            chosen.append(n)
        return chosen

    chosen = _in_thread(run)
    assert chosen[:6] == [1, 2, 4, 1, 2, 4]  # interleaved probe
    assert chosen[6:11] == [2] * 5  # then the winner until the next probe
    assert chosen[11:17] == [1, 2, 4, 1, 2, 4]


def test_other_threads_keep_their_thread_count() -> None:
    before = torch.get_num_threads()
    _in_thread(lambda: ThreadTuner(max_threads=2).next_threads() if ThreadTuner(max_threads=2).enabled else 1)
    assert torch.get_num_threads() == before
    assert _in_thread(torch.get_num_threads) == before  # threads started later too
