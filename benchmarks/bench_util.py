"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts
this folder on ``sys.path``)."""

from __future__ import annotations

import os
import statistics
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def store_url(backend: str, pg: str, settings: dict[str, str] | None = None) -> Iterator[str]:
    """A store URL for one run: a new SQLite file, or a new schema in the PostgreSQL database
    ``pg`` (server ``settings`` such as synchronous_commit applied to its sessions), dropped
    afterwards."""
    if backend == "sqlite":
        yield str(Path(tempfile.mkdtemp(prefix="agentbolt-bench-")) / "bench.db")
        return
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    options = "%20".join(f"-c{k}%3D{v}" for k, v in {"search_path": schema, **(settings or {})}.items())
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{pg}{'&' if '?' in pg else '?'}options={options}"
    finally:
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
