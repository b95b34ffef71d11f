"""Store fixtures: every contract test runs on SQLite (file, WAL), SQLite in memory and PostgreSQL.

PostgreSQL is ``postgresql://postgres@127.0.0.1:5432/test`` unless ``AGENTBOLT_TEST_PG`` says
otherwise. Each test gets its own schema, dropped afterwards, so the suite can run again and
again on one database. Where PostgreSQL cannot be reached the PostgreSQL cases skip, except
under ``CI=true``, where they fail: CI must not go green without having run them.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from agentbolt.store import SqliteDatabase, SqlStore

PG_DSN = os.environ.get("AGENTBOLT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
BACKENDS = [
    "sqlite-file",
    "sqlite-memory",
    pytest.param("postgres", marks=pytest.mark.postgres),
]
DURABLE_BACKENDS = ["sqlite-file", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    """The PostgreSQL DSN, once it answered; skip (fail under CI) when it does not."""
    import psycopg

    try:
        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except psycopg.Error as exc:
        where = re.sub(r"://([^:@/]*):[^@/]*@", r"://\1:***@", PG_DSN)  # never print a password
        message = f"PostgreSQL at {where} is unreachable ({exc}); set AGENTBOLT_TEST_PG"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return PG_DSN


@dataclass
class StoreFactory:
    """Opens stores on one backend's database: ``open()`` again reaches the same data (same
    file, same schema), except for ``:memory:``, where it hands back the first store."""

    backend: str
    opener: Callable[..., SqlStore]
    opened: list[SqlStore] = field(default_factory=list)

    @property
    def shared_only(self) -> bool:
        return self.backend == "sqlite-memory"

    def open(self, **kwargs: object) -> SqlStore:
        if self.shared_only and self.opened:
            return self.opened[0]
        store = self.opener(**kwargs)
        self.opened.append(store)
        return store

    def close_all(self) -> None:
        for store in self.opened:
            store.close()
        self.opened.clear()


def _sqlite_factory(backend: str, tmp_path) -> StoreFactory:
    path = str(tmp_path / "store.db") if backend == "sqlite-file" else ":memory:"

    def opener(pool_size: int = 1, **kw: object) -> SqlStore:  # one connection per store anyway
        return SqlStore(SqliteDatabase(path), **kw)

    return StoreFactory(backend, opener)


@pytest.fixture
def pg_schema(pg_dsn: str) -> Iterator[str]:
    """A fresh schema name for this test (the backend creates it); dropped afterwards."""
    import psycopg

    schema = f"test_{uuid.uuid4().hex[:12]}"
    yield schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def store_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreFactory]:
    backend = request.param
    if backend == "postgres":
        from agentbolt.store.postgres import PostgresDatabase

        dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema")

        def opener(pool_size: int = 4, **kw: object) -> SqlStore:
            return SqlStore(PostgresDatabase(dsn, schema=schema, pool_size=pool_size), **kw)

        factory = StoreFactory(backend, opener)
    else:
        factory = _sqlite_factory(backend, tmp_path)
    yield factory
    factory.close_all()  # before pg_schema's teardown drops the schema


@pytest.fixture
def store(store_factory: StoreFactory) -> SqlStore:
    return store_factory.open()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``store_factory`` (and so ``store``) over the backends; a test marked
    ``durable`` runs only where data outlives the store object."""
    if "store_factory" in metafunc.fixturenames:
        durable = metafunc.definition.get_closest_marker("durable") is not None
        params = DURABLE_BACKENDS if durable else BACKENDS
        metafunc.parametrize("store_factory", params, indirect=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "durable: runs only on backends whose data outlives the store")
