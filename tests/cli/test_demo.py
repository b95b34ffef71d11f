"""``agentbolt demo`` with its output going to a pipe, as in a log or CI: a plain line per GRPO
step, written out as each step ends (not at exit), with the figures of the live table."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentbolt.engine import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output lines as they arrive; None once it closed its output."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _until(lines: queue.Queue[str | None], prefix: str, deadline: float, seen: list[str]) -> str:
    while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting with {prefix!r} in:\n" + "\n".join(seen))


def _steps(metrics: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []


def test_demo_off_a_terminal_prints_a_flushed_line_per_step(tiny: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--model", str(tiny), "--steps", "2", "--group-size", "2", "--tasks-per-step", "2"]
    args += ["--val-tasks", "2", "--concurrency", "4", "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbolt", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines, seen = _lines(proc), list[str]()
        deadline = time.monotonic() + 300
        _until(lines, f"agentbolt demo: GRPO on {tiny}, 2 steps of 2 tasks x 2 rollouts;", deadline, seen)
        first = _until(lines, "GRPO step 1 |", deadline, seen)
        # read while step 2 still runs: a line held in a buffer would only come at exit
        assert [s["step"] for s in _steps(run_dir / "metrics.jsonl")] == [0, 1]
        second = _until(lines, "GRPO step 2 |", deadline, seen)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "\n".join(seen)
    finally:
        proc.kill()
        proc.wait(10)
    steps = _steps(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for line, row in zip((first, second), steps[1:], strict=True):
        assert f"| success {row['success']:.0%} | reward mean {row['reward_mean']:.3f} |" in line
        assert f"| retried {row['retried']} |" in line and f"| t rollouts {row['t_rollouts']:.1f}s |" in line


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400"}  # the error box on one line
    return subprocess.run(
        [sys.executable, "-m", "agentbolt", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_demo_resume_without_a_run_folder_is_refused(tmp_path: Path) -> None:
    done = _demo("--resume")
    assert done.returncode == 2
    assert "--resume continues a run: give its folder with --run-dir" in done.stderr
    assert "Traceback" not in done.stderr
    empty = _demo("--resume", "--run-dir", str(tmp_path))
    assert empty.returncode == 2
    assert "no checkpoint to resume in" in empty.stderr


def test_demo_names_the_tasks_and_advantages_it_knows() -> None:
    task = _demo("--task", "chess")
    assert task.returncode == 2
    assert "unknown task 'chess'; choose one of: calculator, chain, guess" in task.stderr
    advantage = _demo("--task", "chain", "--advantage", "token")
    assert advantage.returncode == 2
    assert "'token': choose rollout, turn or gigpo" in advantage.stderr


def test_demo_chain_runs_gigpo_end_to_end_on_a_tiny_model(tiny: Path, tmp_path: Path) -> None:
    """The mechanism, not the gain: the multi-turn task under step-level grouping writes its
    per-turn metrics and the before/after table with greedy and sampled success."""
    run_dir = tmp_path / "run"
    args = ["--task", "chain", "--advantage", "gigpo", "--model", str(tiny), "--steps", "1"]
    args += ["--group-size", "2", "--tasks-per-step", "2", "--val-tasks", "2", "--concurrency", "4"]
    done = _demo(*args, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "task chain" in done.stdout and "advantage gigpo" in done.stdout
    assert "sampled (temperature 1)" in done.stdout and "greedy (temperature 0)" in done.stdout
    memory = next(line for line in done.stdout.splitlines() if line.startswith("peak memory: "))
    gb = float(memory.split()[2])
    assert 0.1 < gb < 20 and "GB (whole process tree" in memory  # the engine alone is over 0.1 GB
    steps = _steps(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert {"turns_mean", "step_reward_mean", "anchor_groups", "val_greedy"} <= set(steps[1])
