"""Storage behind one object: :class:`SqlStore` over a SQLite or PostgreSQL database."""

from __future__ import annotations

import sqlite3

from agentbolt.errors import StoreUnavailable
from agentbolt.store.database import Database
from agentbolt.store.sql import SqlStore
from agentbolt.store.sqlite import SqliteDatabase

__all__ = ["Database", "SqlStore", "SqliteDatabase", "open_store"]


def open_store(url: str = ":memory:", lease_seconds: float | None = None) -> SqlStore:
    """Open a store from a URL: a SQLite path, ``sqlite:///path``, ``:memory:``, or
    ``postgresql://...`` (needs the PostgreSQL backend)."""
    kwargs = {"lease_seconds": lease_seconds} if lease_seconds else {}
    if url.startswith(("postgresql://", "postgres://")):
        from agentbolt.store.postgres import PostgresDatabase

        return SqlStore(PostgresDatabase(url), **kwargs)
    path = url.removeprefix("sqlite:///").removeprefix("sqlite://") or ":memory:"
    try:
        return SqlStore(SqliteDatabase(path), **kwargs)
    except (OSError, sqlite3.Error) as exc:  # a missing or unwritable folder, not a database file
        raise StoreUnavailable(f"cannot open the SQLite store {path!r}: {exc}") from None
