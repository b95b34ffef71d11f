"""Launching test ranks: an environment without the caller's rank variables, and a run that
kills the whole process group on a timeout (torchrun's workers would outlive torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    env.pop("AGENTBOLT_DIST_STRATEGY", None)
    env.update(extra)
    return env


def run_ranks(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` to its end, its exit status asserted 0; past ``timeout`` every process it
    started is killed and the test fails with their output."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"ranks still running after {timeout} s: {out[-2000:]}{err[-3000:]}") from None
    finally:
        try:  # a rank that outlived the launcher (the group leader exited first)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(command, proc.returncode, out, err)
