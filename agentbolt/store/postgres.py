"""PostgreSQL backend: one database shared by several server replicas.

Each :meth:`PostgresDatabase.transaction` borrows a pooled connection (psycopg 3 +
``psycopg_pool``) and runs one READ COMMITTED transaction on it. Dequeue picks its row with
``FOR UPDATE SKIP LOCKED``, so replicas claiming at the same time take different rollouts
instead of waiting on each other. The store's SQL is written with ``?`` placeholders; they are
rewritten to psycopg's ``%s`` once per statement text (psycopg prepares a statement on a
connection after its fifth use, so the hot ones run as prepared statements).

Tuning from the URL: ``pool_size=N`` (agentbolt's: connections per process, default 8), and
any server setting through libpq's ``options``, e.g.
``?options=-csynchronous_commit%3Doff``: commits return before the WAL reaches the disk, so an
OS crash or power loss of the database host can lose the last few hundred milliseconds of
acknowledged writes (a crash of PostgreSQL itself or of agentbolt loses nothing, and the
database stays consistent). Off by default.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from agentbolt.errors import ConfigError, StoreUnavailable
from agentbolt.store.database import Database, Tx

__all__ = ["PostgresDatabase"]

log = logging.getLogger("agentbolt.store")

# Any constant works: it only has to differ from advisory locks other applications take.
_MIGRATE_LOCK = 0x61677462  # "agtb"
_SECTION_LOCK = 0x61670000  # + n: Database.serialize(tx, n) sections
# inserted(): below this many new rows since the last ANALYZE, no check at all
_ANALYZE_MIN_ROWS = 200
# lower case only: search_path folds unquoted names to lower case, CREATE SCHEMA "X" would not
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@functools.lru_cache(maxsize=1024)
def to_pyformat(sql: str) -> str:
    """``?`` -> ``%s`` and ``%`` -> ``%%``, leaving quoted literals and identifiers untouched."""
    out, quote = [], None
    for ch in sql:
        if quote:
            if ch == quote:
                quote = None  # a doubled quote ('') closes and reopens: same result
        elif ch in "'\"":
            quote = ch
        elif ch == "?":
            out.append("%s")
            continue
        out.append("%%" if ch == "%" else ch)
    return "".join(out)


@contextmanager
def _no_nul() -> Iterator[None]:
    """PostgreSQL text cannot hold NUL characters (SQLite can): a client's string with one is
    a bad request (400), not a server error. psycopg refuses it before anything is sent."""
    try:
        yield
    except psycopg.DataError as exc:
        if "NUL (0x00)" in str(exc):
            raise ValueError("text values cannot contain NUL (0x00) characters") from None
        raise


class _PgTx(Tx):
    def __init__(self, conn: psycopg.Connection) -> None:
        self.cur = conn.cursor()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with _no_nul():
            return self.cur.execute(to_pyformat(sql), params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        with _no_nul():
            return self.cur.execute(to_pyformat(sql), params).rowcount


def _pop_pool_size(dsn: str, default: int) -> tuple[str, int]:
    """``pool_size=N`` in a URL's query sets the connections this process may open; it is
    agentbolt's, not libpq's (which would refuse it), so it is taken out of the URL. Size it
    so that replicas x pool_size stays under the server's ``max_connections``."""
    parts = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if "://" in dsn else []
    sizes = [v for k, v in query if k == "pool_size"]
    if not sizes:
        return dsn, default
    try:
        size = int(sizes[-1])
    except ValueError:
        raise ConfigError(f"pool_size must be an integer, got {sizes[-1]!r}") from None
    rest = urllib.parse.urlencode(
        [(k, v) for k, v in query if k != "pool_size"], quote_via=urllib.parse.quote
    )
    return urllib.parse.urlunsplit(parts._replace(query=rest)), size


class PostgresDatabase(Database):
    name = "postgres"
    # the claim's subquery reads rollouts alone: only the rollout row is locked (copies of one
    # task, a GRPO group, do not block each other)
    claim_lock = "FOR UPDATE SKIP LOCKED"
    types = {"real": "DOUBLE PRECISION", "serial": "BIGSERIAL PRIMARY KEY"}

    def __init__(self, dsn: str, schema: str | None = None, pool_size: int = 8) -> None:
        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        dsn, pool_size = _pop_pool_size(dsn, pool_size)
        if pool_size < 1:
            raise ConfigError(f"pool_size must be at least 1, got {pool_size}")
        self.schema = schema
        self.connections = pool_size
        self._stats_lock = threading.Lock()
        self._unanalyzed = 0  # rows inserted by this process since its last ANALYZE
        self._analyzing = False
        self._probe(dsn)
        kwargs: dict[str, Any] = {"autocommit": True}  # transactions are explicit: transaction()
        if schema is not None:
            self._create_schema(dsn, schema)
            options = conninfo_to_dict(dsn).get("options") or ""
            kwargs["options"] = f"{options} -c search_path={schema}".strip()
        # min_size 1: idle replicas (and tests opening many stores) hold few server connections.
        self.pool = ConnectionPool(
            dsn, min_size=1, max_size=pool_size, kwargs=kwargs, open=True, name=f"agentbolt-{schema or 'db'}"
        )

    @staticmethod
    def _probe(dsn: str) -> None:
        """Fail at once with libpq's own reason (refused, unknown host, no such database) rather
        than after the pool's 30 s timeout with none."""
        try:
            psycopg.connect(dsn, connect_timeout=10).close()
        except psycopg.Error as exc:
            reason = " ".join(str(exc).split())
            raise StoreUnavailable(f"cannot connect to PostgreSQL: {reason}") from None

    @staticmethod
    def _create_schema(dsn: str, schema: str) -> None:
        # Concurrent CREATE SCHEMA IF NOT EXISTS can still collide on the catalog: serialize it.
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_MIGRATE_LOCK,))
            conn.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(schema)))

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self.pool.connection() as conn, conn.transaction():
            yield _PgTx(conn)

    @contextmanager
    def autocommit(self) -> Iterator[Tx]:
        with self.pool.connection() as conn:  # the pool's connections are in autocommit mode
            yield _PgTx(conn)

    def inserted(self, tables: Sequence[str], rows: int) -> None:
        """ANALYZE ``tables`` once the rows this process added since its last ANALYZE reach 10%
        of what the statistics say the first table holds (or it was never analyzed).

        Why: dequeue's plan depends on how many rollouts the planner thinks are queued. With a
        table that was never analyzed it estimates a handful and sorts the whole queue on every
        claim (3 ms per dequeue with 2,000 queued, growing with the queue) instead of reading
        the queue index in order. Autovacuum's own ANALYZE comes only up to a minute later, so
        a bulk enqueue refreshes the statistics itself, as PostgreSQL's documentation advises
        after bulk loads. The enqueue is committed before: nothing here can undo it."""
        with self._stats_lock:
            self._unanalyzed += rows
            if self._unanalyzed < _ANALYZE_MIN_ROWS or self._analyzing:
                return
            self._analyzing, pending = True, self._unanalyzed
        try:
            if self._analyze(tables, pending):
                with self._stats_lock:
                    self._unanalyzed -= pending
        except psycopg.errors.LockNotAvailable:
            pass  # another session is analyzing or vacuuming the table: try again next time
        except psycopg.Error as exc:
            log.warning("ANALYZE after a bulk enqueue failed (the enqueue is stored): %s", exc)
        finally:
            self._analyzing = False

    def _analyze(self, tables: Sequence[str], pending: int) -> bool:
        with self.transaction() as tx:
            row = tx.one("SELECT reltuples FROM pg_class WHERE oid = to_regclass(?)", (tables[0],))
            known = row[0] if row and row[0] is not None else -1
            if known >= 0 and pending < 0.1 * known:
                return False
            # never queue behind a long VACUUM: the enqueue's answer waits for this
            tx.run("SET LOCAL lock_timeout = '200ms'")
            for table in tables:
                tx.run(pgsql.SQL("ANALYZE {}").format(pgsql.Identifier(table)).as_string(None))
        return True

    def serialize(self, tx: Tx, what: int, on: str = "") -> None:
        # a transaction-scoped advisory lock, per schema (stores in other schemas do not wait);
        # two values of ``on`` whose hashes collide only wait for each other, harmlessly
        tx.run("SELECT pg_advisory_xact_lock(?, hashtext(current_schema() || ?))", (_SECTION_LOCK + what, on))

    def lock_schema(self, tx: Tx) -> None:
        # per schema: stores in other schemas of the same database do not wait
        tx.run("SELECT pg_advisory_xact_lock(?, hashtext(current_schema()))", (_MIGRATE_LOCK,))

    def close(self) -> None:
        self.pool.close()
