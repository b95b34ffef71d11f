"""Fault-suite fixtures: a fresh store per test (SQLite file, or a PostgreSQL schema), the
OpenAI-compatible model double, and the figures each test leaves for the summary."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_audit import Figures, figures_table

PG_DSN = os.environ.get("AGENTBOLT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
UPSTREAM = Path(__file__).parent.parent / "scale" / "upstream_proc.py"
_FIGURES: list[Figures] = []


def _pg_or_skip() -> None:
    """Skip when PostgreSQL is missing, except under CI=true, where that is a failure."""
    import psycopg

    try:
        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except psycopg.Error as exc:
        message = f"PostgreSQL is unreachable ({type(exc).__name__}); set AGENTBOLT_TEST_PG"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL on an empty database: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield str(tmp_path / "faults.db")
        return
    import psycopg

    _pg_or_skip()
    schema = f"faults_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_DSN}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(scope="session")
def upstream_port() -> Iterator[int]:
    """The model double (``tests/scale/upstream_proc.py``) in its own process."""
    from agentbolt.server.run import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(UPSTREAM), str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def figures() -> list[Figures]:
    return _FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("fault injection: faults, rollouts, lost, duplicated")
        for line in figures_table(_FIGURES):
            terminalreporter.write_line(line)
