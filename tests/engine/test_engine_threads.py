"""The thread-count tuner picks the fastest measured setting and leaves other threads alone."""

from __future__ import annotations

import threading

import pytest
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
    assert chosen[:4] == [1, 2, 4, 2]  # interleaved probe; 1 and 4 are over 1.5x the best: tried once
    assert chosen[4:9] == [2] * 5  # then the winner until the next probe
    assert chosen[9:13] == [1, 2, 4, 2]


def _probe(tuner: ThreadTuner, step_times: dict[int, list[float]]) -> tuple[int, float]:
    """Run one probe with the given per-count step times; return the choice and the time spent."""
    queues = {n: list(times) for n, times in step_times.items()}
    spent = 0.0
    while True:
        n = tuner.next_threads()
        if not tuner.probing and spent:
            return n, spent
        seconds = queues[n].pop(0)
        spent += seconds
        tuner.record(n, seconds)


def test_one_stalled_step_does_not_decide_the_count() -> None:
    # 1 thread is faster (0.10 s) but one of its probe steps stalls (a parked thread); 2 threads 0.12 s.
    # The mean of two trials (the former rule) picked 2; the median of three picks 1.
    times = {1: [0.10, 0.50, 0.10], 2: [0.12, 0.13, 0.12]}
    chosen, _ = _in_thread(lambda: _probe(ThreadTuner(max_threads=2, period=100), times))
    assert chosen == 1


def test_a_candidate_far_slower_on_its_first_step_is_not_tried_again() -> None:
    # Under load 2 threads can be 8x slower: the probe spends one such step, not one per trial.
    times = {1: [0.1, 0.1, 0.1], 2: [0.8, 0.8, 0.8]}
    tuner = ThreadTuner(max_threads=2, period=100)
    chosen, spent = _in_thread(lambda: _probe(tuner, times))
    assert chosen == 1
    assert spent == pytest.approx(0.1 * 3 + 0.8)  # all three 1-thread trials, one 2-thread step


def test_probes_grow_apart_while_the_count_holds_and_close_up_when_it_changes() -> None:
    def run() -> list[int]:
        tuner = ThreadTuner(max_threads=2, period=4)
        speed = {1: 0.1, 2: 0.3}
        starts, probing = [], False
        for step in range(120):
            if step == 50:
                speed = {1: 0.3, 2: 0.1}  # the load changed: 2 threads now win
            n = tuner.next_threads()
            if tuner.probing and not probing:
                starts.append(step)
            probing = tuner.probing
            tuner.record(n, speed[n])
        return starts

    starts = _in_thread(run)
    # a probe: 3 one-thread steps + 1 two-thread step (3x slower: tried once); then 4, 8, 16, 32
    # steps on the winner, the gap doubling while 1 thread keeps winning
    assert starts[:5] == [0, 8, 20, 40, 76], starts
    # load changed at step 50; the probe at 76 (4 steps: 1 thread tried once) picks 2 threads,
    # and the gaps start again from 4
    assert starts[5:7] == [84, 96], starts


def test_other_threads_keep_their_thread_count() -> None:
    before = torch.get_num_threads()
    _in_thread(lambda: ThreadTuner(max_threads=2).next_threads() if ThreadTuner(max_threads=2).enabled else 1)
    assert torch.get_num_threads() == before
    assert _in_thread(torch.get_num_threads) == before  # threads started later too


def test_each_range_of_batch_sizes_keeps_its_own_count() -> None:
    """A lone row is fastest on 1 thread and 32 rows on 2: the first steps (a warm-up request,
    then a full batch) must not hand the full batch the lone row's count, as one shared probe
    comparing a 1-row step with a 32-row step did."""

    def run() -> tuple[list[int], list[int], dict[str, int]]:
        tuner = ThreadTuner(max_threads=2, period=100)
        per_step = {1: {1: 0.010, 2: 0.012}, 32: {1: 0.100, 2: 0.060}}  # seconds per step
        lone = []
        for _ in range(8):  # a warm-up request decoded alone
            n = tuner.next_threads(1)
            tuner.record(n, per_step[1][n], 1)
            lone.append(n)
        full = []
        for _ in range(10):  # then 32 rows
            n = tuner.next_threads(32)
            tuner.record(n, per_step[32][n], 32)
            full.append(n)
        return lone, full, tuner.chosen()

    lone, full, chosen = _in_thread(run)
    assert lone[-2:] == [1, 1]  # the lone row's probe picked 1 thread
    # the full batch probed for itself: 1 thread over 1.5x slower per step, tried once
    assert full[:2] == [1, 2]
    assert full[2:] == [2] * 8  # 2 threads' remaining trials, then kept
    assert chosen == {"1": 1, "32-63": 2}


def test_steps_of_one_range_are_compared_per_row() -> None:
    """16 and 31 rows fall in one range: a probe step's time counts per row, so a count whose
    trials happened to get the bigger batch is not judged slower for it."""

    def run() -> int:
        tuner = ThreadTuner(max_threads=2, period=100, trials=1)
        # 2 threads take 6 ms per row, 1 thread 8 ms; the 2-thread trial gets 31 rows, 1 thread 16
        n = tuner.next_threads(16)
        tuner.record(n, 0.008 * 16, 16)
        n = tuner.next_threads(31)
        tuner.record(n, 0.006 * 31, 31)
        return tuner.next_threads(20)

    assert _in_thread(run) == 2


def test_a_prefill_takes_the_count_of_the_largest_batches_probed() -> None:
    """A server's first steps decode one row, whose probe keeps 1 thread; a prefill of 31 prompts
    after them ran on that 1 thread. It takes all threads before any probe, then the count kept
    for the largest range of batch sizes probed, and is never itself a probe step."""

    def run() -> list[int]:
        tuner = ThreadTuner(max_threads=2, period=100)
        seen = [tuner.prefill_threads(), torch.get_num_threads()]
        for _ in range(8):  # a lone row: 1 thread wins
            n = tuner.next_threads(1)
            tuner.record(n, {1: 0.010, 2: 0.020}[n], 1)
        seen.append(tuner.prefill_threads())  # only small batches probed: their count
        for _ in range(10):  # 32 rows: 2 threads win
            n = tuner.next_threads(32)
            tuner.record(n, {1: 0.100, 2: 0.060}[n], 32)
        assert torch.get_num_threads() == 2
        for _ in range(3):  # a 1-row step sets 1 thread on this thread ...
            tuner.record(tuner.next_threads(1), 0.01, 1)
        assert torch.get_num_threads() == 1
        seen += [tuner.prefill_threads(), torch.get_num_threads()]  # ... a prefill goes back to 2
        return seen

    assert _in_thread(run) == [2, 2, 1, 2, 2]
