"""Dequeue stays an index read after a bulk enqueue on PostgreSQL.

The planner sizes a table it never analyzed at a handful of rows; with that estimate the claim
query sorted the whole queue on every dequeue (3 ms each with 2,000 queued, more with more)
until autovacuum analyzed the table up to a minute later. A bulk enqueue now refreshes the
statistics itself; small ones leave that to autovacuum.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from agentbolt.schemas import RolloutCreate, Task
from agentbolt.store.sql import SqlStore
from agentbolt.store.statements import LAPSED, LATEST_VERSION, NEXT_QUEUED

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_store(pg_dsn: str, pg_schema: str) -> Iterator[SqlStore]:
    from agentbolt.store.postgres import PostgresDatabase

    store = SqlStore(PostgresDatabase(pg_dsn, schema=pg_schema, pool_size=2))
    yield store
    store.close()


def _analyzed(store: SqlStore) -> dict[str, bool]:
    with store.db.autocommit() as tx:
        rows = tx.all(
            "SELECT relname, last_analyze IS NOT NULL FROM pg_stat_user_tables "
            "WHERE schemaname = current_schema() AND relname IN ('rollouts', 'tasks')"
        )
    return dict(rows)


def _generic_plan(store: SqlStore, sql: str, args: tuple[float, ...] = ()) -> str:
    """The plan of ``sql`` as the server runs it: a prepared statement (psycopg prepares a
    statement on its fifth use) with a generic plan; ``?`` parameters are numbers here."""
    for n in range(1, len(args) + 1):
        sql = sql.replace("?", f"${n}", 1)
    types = f"({', '.join(['float8'] * len(args))})" if args else ""
    values = f"({', '.join(map(repr, args))})" if args else ""
    with store.db.autocommit() as tx:
        tx.run("SET plan_cache_mode = force_generic_plan")
        tx.run(f"PREPARE plan_check{types} AS {sql}")
        try:
            return "\n".join(r[0] for r in tx.all(f"EXPLAIN EXECUTE plan_check{values}"))
        finally:
            tx.run("DEALLOCATE plan_check")
            tx.run("RESET plan_cache_mode")


def _enqueue(store: SqlStore, n: int) -> None:
    store.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(n)])


def test_a_bulk_enqueue_analyzes_so_the_claim_reads_the_queue_in_index_order(pg_store: SqlStore) -> None:
    _enqueue(pg_store, 2000)
    assert _analyzed(pg_store) == {"rollouts": True, "tasks": True}
    plan = _generic_plan(pg_store, NEXT_QUEUED)
    assert "Sort" not in plan and "Index" in plan, plan
    claim = pg_store.dequeue("w1")
    assert claim is not None and claim.rollout.task.data == {"i": 0}  # the oldest, its task read back


def test_small_enqueues_leave_statistics_to_autovacuum_until_they_add_up(pg_store: SqlStore) -> None:
    _enqueue(pg_store, 50)
    assert _analyzed(pg_store) == {"rollouts": False, "tasks": False}
    for _ in range(3):  # 200 rows in all since the last ANALYZE: now it is worth one
        _enqueue(pg_store, 50)
    assert _analyzed(pg_store) == {"rollouts": True, "tasks": True}


def test_a_table_busy_with_vacuum_or_analyze_never_holds_up_an_enqueue(
    pg_store: SqlStore, pg_dsn: str
) -> None:
    import psycopg

    _enqueue(pg_store, 1)  # the tables exist
    with psycopg.connect(pg_dsn, options=f"-csearch_path={pg_store.db.schema}") as other:
        # the lock VACUUM and ANALYZE take: inserts pass, another ANALYZE would wait for it
        other.execute("LOCK TABLE rollouts IN SHARE UPDATE EXCLUSIVE MODE")
        done = threading.Event()
        worker = threading.Thread(target=lambda: (_enqueue(pg_store, 500), done.set()), daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert done.is_set(), "the enqueue waited for the table's lock"
        other.rollback()
    assert pg_store.stats()["rollouts"]["queued"] == 501
    assert _analyzed(pg_store) == {"rollouts": False, "tasks": False}  # skipped, not lost:
    _enqueue(pg_store, 1)  # the next enqueue analyzes
    assert _analyzed(pg_store) == {"rollouts": True, "tasks": True}


def test_a_long_history_does_not_slow_the_claim_or_the_lease_sweep(pg_store: SqlStore) -> None:
    """3,000 rollouts, all but 10 finished, each with its attempt, statistics fresh (as
    autovacuum leaves them): the claim reads only queued rows and the sweep only running
    attempts, instead of walking every finished one in key order."""
    _enqueue(pg_store, 3000)
    with pg_store.db.autocommit() as tx:
        tx.run("UPDATE rollouts SET status = 'succeeded' WHERE qseq <= 2990")
        tx.run(
            "INSERT INTO attempts (id, rollout_id, number, worker_id, status, started_at, heartbeat_at, "
            "lease_expires_at) SELECT 'at' || qseq, id, 1, 'w', 'succeeded', 0, 0, 0 FROM rollouts "
            "WHERE status = 'succeeded'"
        )
        tx.run("ANALYZE")
    claim = _generic_plan(pg_store, NEXT_QUEUED)
    assert "status = 'queued'" in claim and "Index" in claim and "rollouts_pkey" not in claim, claim
    sweep = _generic_plan(pg_store, LAPSED, (1e12, 1e12))
    assert "status = 'running'" in sweep and "Index" in sweep and "Seq Scan" not in sweep, sweep
    assert "attempts_pkey" not in sweep, sweep


def test_the_latest_version_is_read_from_its_index_however_many_were_published(pg_store: SqlStore) -> None:
    """Unpinned claims ask for the newest version that is not a trial: an index read, not a scan
    of every version a long run published (trials among them)."""
    with pg_store.db.autocommit() as tx:
        tx.run(
            "INSERT INTO resources (version, resources, metadata, created_at, trial) "
            "SELECT g, '{}', '{}', 0, CASE WHEN g % 3 = 0 OR g > 4990 THEN 1 ELSE 0 END "
            "FROM generate_series(1, 5000) g"
        )
        tx.run("ANALYZE resources")
    plan = _generic_plan(pg_store, f"SELECT {LATEST_VERSION}")
    assert "Index" in plan and "Seq Scan" not in plan and "Sort" not in plan, plan
    latest = pg_store.latest_resources()
    assert latest is not None and (latest.version, latest.trial) == (4990, False)
    _enqueue(pg_store, 1)
    claim = pg_store.dequeue("w1")
    assert claim is not None and claim.rollout.resources_version == 4990
