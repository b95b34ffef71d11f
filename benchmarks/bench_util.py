"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, which puts
this folder on ``sys.path``)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


def grpo_on_task(
    task: Any, prefix: str, train: list[Any], heldout: list[Any], **grpo: Any
) -> tuple[Any, Path, float]:
    """GRPO from the untrained bundled model on a built-in or external ``task``
    (:class:`agentbolt.tasks.BuiltinTask`) as the learning benchmarks run it: 4 tasks x 8 rollouts
    a step, no checkpoints, plot or validation between steps (``grpo`` overrides or adds), one
    runner of 32 rollouts, the task's system prompt published, the trainer's output in
    ``log.txt`` of a fresh run folder. Returns the result, the run folder and the seconds taken."""
    from rich.console import Console

    from agentbolt import PromptTemplate, Trainer
    from agentbolt.algorithms.grpo import GRPO

    settings: dict[str, Any] = dict(
        tasks_per_step=4, group_size=8, val_every=0, checkpoint_every=0, plot=False
    )
    algo = GRPO(**{**settings, **grpo})
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    t0 = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        result = Trainer(
            algo,
            n_runners=1,
            runner_concurrency=32,
            run_dir=run_dir,
            console=Console(file=log, width=200),
            resources={"system_prompt": PromptTemplate(template=task.system_prompt, engine="plain")},
        ).fit(task.agent(), train, heldout)
    return result, run_dir, time.perf_counter() - t0
