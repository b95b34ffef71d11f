"""Tuning a PostgreSQL store from its URL: ``pool_size`` (agentbolt's) and libpq ``options``
such as ``synchronous_commit=off`` reach every pooled session, with or without a schema."""

from __future__ import annotations

import pytest

from agentbolt.errors import ConfigError
from agentbolt.store import open_store

pytestmark = pytest.mark.postgres


def _show(store, setting: str) -> str:
    with store.db.transaction() as tx:
        return tx.one(f"SHOW {setting}")[0]  # a fixed setting name, not a value


def test_pool_size_and_options_from_the_url(pg_dsn: str, pg_schema: str) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a search_path in the URL: it must exist
        conn.execute(f"CREATE SCHEMA {pg_schema}")
    url = f"{pg_dsn}?options=-csearch_path%3D{pg_schema}%20-csynchronous_commit%3Doff&pool_size=3"
    store = open_store(url)
    try:
        assert store.db.pool.max_size == 3
        assert _show(store, "synchronous_commit") == "off"
        assert _show(store, "search_path") == pg_schema
    finally:
        store.close()


def test_options_survive_next_to_a_schema(pg_dsn: str, pg_schema: str) -> None:
    from agentbolt.store.postgres import PostgresDatabase
    from agentbolt.store.sql import SqlStore

    store = SqlStore(PostgresDatabase(f"{pg_dsn}?options=-csynchronous_commit%3Doff", schema=pg_schema))
    try:
        assert _show(store, "synchronous_commit") == "off" and _show(store, "search_path") == pg_schema
        assert _show(store, "default_transaction_isolation") == "read committed"
    finally:
        store.close()


def test_a_bad_pool_size_is_a_config_error(pg_dsn: str) -> None:
    with pytest.raises(ConfigError, match="pool_size"):
        open_store(f"{pg_dsn}?pool_size=lots")
