"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts
this folder on ``sys.path``)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), immune to other load; 0 for a
    process that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pids_named(name: str) -> list[int]:
    """Processes whose command name is ``name`` (e.g. every PostgreSQL process of a local server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def pct(values: list[float], q: int) -> float:
    """The q-th percentile of ``values`` (seconds) in milliseconds; NaN with fewer than two."""
    return statistics.quantiles(values, n=100)[q - 1] * 1000 if len(values) > 1 else float("nan")
