"""A smoke run of ``benchmarks/scale_sim.py``: the scale benchmark, small.

The script runs as a user runs it (a subprocess: real server processes, real runner processes
with the real Runner, agents calling the gateway with their attempt's key, the instant stub
model), on a store this test provides, so that afterwards the test audits that store itself
(tests/scale/scale_support.audit, straight from the database) instead of trusting the script's
own check. Then the printed and JSON figures must agree with it and with each other.

One SQLite run, and one on PostgreSQL with 2 server replicas (runners split over them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scale_support import audit, db_query, pg_schema

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale_sim.py"
AGENTS, CALLS, CALIBRATION = 40, 2, 100
PROCESSES = {"sqlite": ["server", "stub model", "runner 1", "runner 2", "driver"]}
PROCESSES["postgres"] = [
    "server 1",
    "server 2",
    "stub model",
    "runner 1",
    "runner 2",
    "driver",
    "PostgreSQL backends",
]


def _run(store: str, out: Path, *extra: str) -> tuple[dict, str]:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--agents",
        str(AGENTS),
        "--tool-latency",
        "0.3",
        "--calls",
        str(CALLS),
        "--duration",
        "3",
        "--calibration-calls",
        str(CALIBRATION),
        "--store",
        store,
        "--json",
        str(out),
        *extra,
    ]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def _check(r: dict, printed: str, db: str, backend: str) -> None:
    check = r["check"]
    n = check["enqueued"]
    assert n >= AGENTS and check["ok"] is True
    # the store, audited by the test: every rollout succeeded exactly once
    ids = [rid for (rid,) in db_query(db, "SELECT id FROM rollouts")]
    report = audit(db, ids)
    assert report.problems == [], report.problems[:5]
    assert report.status_counts() == {"succeeded": n + 1}  # + the calibration's one rollout
    assert report.attempt_counts() == {"succeeded": n + 1}
    assert check["succeeded"] == n and check["not_exactly_once"] == 0
    # calls recorded = calls made: the agents' count against the store's
    recorded = db_query(db, "SELECT COUNT(*) FROM events WHERE type = 'llm_call'")[0][0]
    assert check["calls_made"] == check["calls_recorded"] == n * CALLS
    assert r["calibration"]["calls"] > CALIBRATION  # it also warms its connections up with a call each
    assert recorded == n * CALLS + r["calibration"]["calls"]
    tries = [json.loads(d) for (d,) in db_query(db, "SELECT data FROM events WHERE type = 'llm_call'")]
    assert check["client_retries"] == sum(t["retries"] for t in tries)  # tries beyond the first
    tools = db_query(db, "SELECT COUNT(*) FROM events WHERE type = 'tool_call'")[0][0]
    assert tools == check["tool_events"] == n * CALLS
    # the window's figures
    assert r["rollouts_in_window"] > 0 and r["rollouts_per_s"] > 0
    assert math.isclose(r["rollouts_per_s"], r["rollouts_in_window"] / r["window_s"])
    # each rollout makes CALLS calls: the window's calls are its ended rollouts' CALLS each, give
    # or take those of the at most AGENTS rollouts the window's edges cut (a ratio of the two
    # rates was within 50% when quiet, and off by 2x under load, with few rollouts in the window)
    window_calls = round(r["gateway_calls_per_s"] * r["window_s"])
    assert abs(window_calls - CALLS * r["rollouts_in_window"]) <= CALLS * AGENTS, (window_calls, r)
    for key in ("claim", "queue_wait", "model_call"):
        d = r[key]
        assert d["n"] > 0 and 0 <= d["p50_ms"] <= d["p99_ms"] < 60_000, (key, d)
    assert r["rollout_s_mean"] >= 0.15 * CALLS  # at least the tool sleeps (0.3 s -50 %)
    # CPU: every process measured, positive; per rollout consistent with the totals
    for name in PROCESSES[backend]:
        assert r["cpu_s"][name] > 0, name
        assert math.isclose(r["cores"][name], r["cpu_s"][name] / r["window_s"])
    servers = sum(v for k, v in r["cpu_s"].items() if k.startswith("server"))
    assert math.isclose(r["server_cpu_ms_per_rollout"], servers / r["rollouts_in_window"] * 1000)
    assert r["calibration"]["server_ms_per_call"] > 0
    assert r["machine"]["busy_cores"] > 0 and r["machine"]["cores"] == os.cpu_count()
    # the bottleneck line names a measured process; the estimate is its formula over the figures
    assert any(name in r["bottleneck"] for name in r["cpu_s"]), r["bottleneck"]
    est = r["estimate"]
    assert math.isclose(est["rollouts_per_s"], 10_000 / r["rollout_s_mean"])
    assert math.isclose(est["server_cores"], est["rollouts_per_s"] * r["server_cpu_ms_per_rollout"] / 1000)
    assert est["replicas"] >= 1
    # what was printed says the same
    assert f"First bottleneck: {r['bottleneck']}" in printed
    assert f"Check: OK - {n}/{n} rollouts succeeded" in printed
    assert f"{r['rollouts_per_s']:.1f}" in printed
    assert "Paper estimate for 10,000 concurrent agents" in printed
    assert f"= {est['server_cores']:.1f} cores" in printed
    if backend == "postgres":
        pg = r["postgres"]
        assert pg["rows_written_per_rollout"] > 0 and pg["commits_per_rollout"] > 0
        assert est["pg_rows_per_s"] > 0 and "row writes/s" in printed
    else:
        assert "postgres" not in r and "run with --backend postgres" in printed


@pytest.mark.timeout(120)
def test_scale_sim_sqlite(tmp_path):
    db = str(tmp_path / "sim.db")
    r, printed = _run(db, tmp_path / "sim.json")
    assert r["config"]["backend"] == "sqlite" and r["config"]["replicas"] == 1
    _check(r, printed, db, "sqlite")


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_scale_sim_postgres_two_replicas(tmp_path):
    with pg_schema() as db:
        r, printed = _run(db, tmp_path / "sim.json", "--replicas", "2")
        assert r["config"]["backend"] == "postgres" and r["config"]["replicas"] == 2
        _check(r, printed, db, "postgres")
        # the runners were split over the replicas: runner i talks to replica i, whose CPU shows it
        urls = r["config"]["runner_urls"]
        assert len(urls) == 2 and len(set(urls)) == 2, urls
        assert r["cpu_s"]["server 2"] > 0.3 * r["cpu_s"]["server 1"], r["cpu_s"]
        workers = {w for (w,) in db_query(db, "SELECT DISTINCT worker_id FROM attempts")}
        for i in (1, 2):
            assert any(w.startswith(f"sim-runner-{i}") for w in workers), workers
