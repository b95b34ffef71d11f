"""Helpers for the scale, chaos and fuzz tests: PostgreSQL schemas, runners in threads and in
processes, and an audit of the stored queue read straight from the database (not through the
server under test, and much faster than thousands of HTTP calls)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentbolt.runner.worker import Runner

HERE = Path(__file__).parent
AGENTS = str(HERE / "scale_agents.py")
CLOCK_SLACK = 0.5  # seconds; see _check_rollout
PG_DSN = os.environ.get("AGENTBOLT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _root_conftest() -> Any:
    # tests/conftest.py by path: inside this directory "conftest" names this folder's own file
    spec = importlib.util.spec_from_file_location("_agentbolt_root_conftest", HERE.parent / "conftest.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


need = _root_conftest().need


def scaled(name: str, default: int) -> int:
    """A test size that an environment variable can raise (or lower)."""
    return int(os.environ.get(name, default))


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# ---------------------------------------------------------------------------- PostgreSQL


def pg_reachable() -> str | None:
    """None when PostgreSQL answers, else why not."""
    import psycopg

    try:
        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL is unreachable ({type(exc).__name__}); set AGENTBOLT_TEST_PG"
    return None


@contextmanager
def pg_schema() -> Iterator[str]:
    """A store URL on a fresh schema of the test database; the schema is dropped afterwards."""
    import psycopg

    why = pg_reachable()
    need(why is None, why or "")
    schema = f"scale_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_DSN}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def db_query(db: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the store's tables directly (SQLite file read-only, or PostgreSQL)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db) as conn:
            return conn.execute(sql.replace("?", "%s"), params).fetchall()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


class DoubleClaimWatch:
    """Polls the database for a rollout with two running attempts at once (must never happen)."""

    SQL = "SELECT rollout_id, COUNT(*) FROM attempts WHERE status = 'running' GROUP BY rollout_id HAVING COUNT(*) > 1"

    def __init__(self, db: str, every: float = 0.05) -> None:
        self.db, self.every = db, every
        self.seen: list[tuple[Any, ...]] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="double-claim-watch")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.seen += db_query(self.db, self.SQL)
                self.polls += 1
            except Exception:  # the database may be briefly unreachable (a killed server mid-write)
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> DoubleClaimWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------------------- runners


class RunnerThread:
    """An agentbolt :class:`Runner` on its own event loop in a daemon thread."""

    def __init__(self, agent: Any, url: str, **kwargs: Any) -> None:
        kwargs.setdefault("flush_interval", 0.2)
        self.runner = Runner(agent, url, **kwargs)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"runner-{self.runner.worker_id}")

    def _main(self) -> None:
        try:
            asyncio.run(self.runner.run())
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def start(self) -> RunnerThread:
        self.thread.start()
        return self

    def __enter__(self) -> RunnerThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.stop()
        else:  # the test already failed: stop the runner without masking that error
            self.runner.stop()

    def stop(self, timeout: float = 30.0) -> None:
        wait_until(
            lambda: getattr(self.runner, "_stopping", None) is not None or not self.thread.is_alive(),
            10,
            "the runner loop to start",
        )
        self.runner.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"runner {self.runner.worker_id} did not stop"
        assert self.error is None, f"runner {self.runner.worker_id} crashed: {self.error!r}"


class CliRunner:
    """``python -m agentbolt runner`` in a subprocess, so it can be SIGKILLed."""

    def __init__(self, url: str, agent: str, *args: str, log: Path | None = None) -> None:
        cmd = [
            sys.executable,
            "-m",
            "agentbolt",
            "runner",
            "--server",
            url,
            "--agent",
            f"{AGENTS}:{agent}",
            *args,
        ]
        self.log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


# ---------------------------------------------------------------------------- audit


@dataclass
class Audit:
    """What the database holds for a set of rollouts, and every broken invariant found."""

    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    problems: list[str] = field(default_factory=list)

    def status_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for r in self.rollouts.values():
            counts[r["status"]] += 1
        return dict(counts)

    def attempt_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for attempts in self.attempts.values():
            for a in attempts:
                counts[a["status"]] += 1
        return dict(counts)


def audit(db: str, rollout_ids: list[str], check_events: Callable[..., str | None] | None = None) -> Audit:
    """Check, from the database: every rollout exists and is final; a succeeded rollout has
    exactly one succeeded attempt (and its events, when ``check_events`` is given: called with
    the attempt's events, the task data and the task id); a failed one used all its attempts;
    attempt numbers are unique and one attempt's life never overlaps the next's; no attempt of
    a final rollout is still running."""
    from agentbolt.schemas import Event

    out = Audit()
    wanted = set(rollout_ids)
    for rid, status, max_att, attempts, task_id, data in db_query(
        db,
        "SELECT r.id, r.status, r.max_attempts, r.attempts, t.id, t.data FROM rollouts r "
        "JOIN tasks t ON t.id = r.task_id",
    ):
        if rid in wanted:
            out.rollouts[rid] = {
                "status": status,
                "max_attempts": max_att,
                "attempts": attempts,
                "task_id": task_id,
                "data": orjson.loads(data),
            }
    for row in db_query(
        db,
        "SELECT id, rollout_id, number, worker_id, status, started_at, ended_at FROM attempts ORDER BY number",
    ):
        if row[1] in wanted:
            keys = ("id", "rollout_id", "number", "worker_id", "status", "started_at", "ended_at")
            out.attempts[row[1]].append(dict(zip(keys, row, strict=True)))
    events: dict[str, list[Event]] = defaultdict(list)
    if check_events is not None:
        for aid, rid, seq, kind, ts, data, eid in db_query(
            db, "SELECT attempt_id, rollout_id, sequence, type, timestamp, data, id FROM events"
        ):
            if rid in wanted:
                events[aid].append(
                    Event(
                        id=eid,
                        rollout_id=rid,
                        attempt_id=aid,
                        sequence=seq,
                        type=kind,
                        timestamp=ts,
                        data=orjson.loads(data),
                    )
                )
    missing = wanted - out.rollouts.keys()
    if missing:
        out.problems.append(f"{len(missing)} rollout(s) lost, e.g. {sorted(missing)[:3]}")
    for rid, r in out.rollouts.items():
        out.problems += _check_rollout(rid, r, out.attempts[rid], events, check_events)
    return out


def _check_rollout(
    rid: str,
    r: dict[str, Any],
    attempts: list[dict[str, Any]],
    events: dict[str, list[Any]],
    check_events: Callable[..., str | None] | None,
) -> list[str]:
    problems = []
    succeeded = [a for a in attempts if a["status"] == "succeeded"]
    if r["status"] == "succeeded" and len(succeeded) != 1:
        problems.append(f"{rid}: succeeded with {len(succeeded)} succeeded attempts")
    if r["status"] != "succeeded" and succeeded:
        problems.append(f"{rid}: {r['status']} but has a succeeded attempt")
    if r["status"] == "failed":
        used = [a for a in attempts if a["status"] != "released"]
        if len(used) != r["max_attempts"]:
            problems.append(f"{rid}: failed after {len(used)} of {r['max_attempts']} attempts")
    if r["status"] not in ("succeeded", "failed", "cancelled"):
        problems.append(f"{rid}: not final ({r['status']})")
    elif any(a["status"] == "running" for a in attempts):
        problems.append(f"{rid}: final but an attempt is still running")
    numbers = [a["number"] for a in attempts]
    if len(set(numbers)) != len(numbers):
        problems.append(f"{rid}: attempt numbers repeat: {numbers}")
    for a, b in zip(attempts, attempts[1:], strict=False):
        # Timestamps are read before each transaction starts, so a claim that waited on a lock
        # can be stamped a little before the end it waited for: allow CLOCK_SLACK of inversion.
        # A real double claim shows as an overlap of a whole lease or run.
        if a["ended_at"] is None or a["ended_at"] - CLOCK_SLACK > b["started_at"]:
            problems.append(f"{rid}: attempt {a['number']} still ran when attempt {b['number']} started")
    if check_events is not None:
        for a in succeeded:
            why = check_events(events.get(a["id"], []), r["data"], r["task_id"])
            if why:
                problems.append(f"{rid}: succeeded attempt {a['id']}: {why}")
    return problems
