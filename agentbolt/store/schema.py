"""The versioned schema, and the one loop that brings a database up to date.

Types are portable: REAL and DOUBLE PRECISION differ, so ``{real}`` and ``{serial}`` (an
auto-increasing integer primary key) are filled in from the backend's ``types``. ``qseq`` is
the queue order.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentbolt.schemas import now
from agentbolt.store.database import Database

__all__ = ["MIGRATIONS", "migrate"]

MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """CREATE TABLE tasks (id TEXT PRIMARY KEY, data TEXT NOT NULL, metadata TEXT NOT NULL)""",
            """CREATE TABLE rollouts (
                qseq {serial}, id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL, mode TEXT NOT NULL,
                status TEXT NOT NULL, resources_version INTEGER, timeout_seconds {real},
                max_attempts INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
                last_attempt INTEGER NOT NULL DEFAULT 0, group_id TEXT,
                reward {real}, error TEXT, metadata TEXT NOT NULL, created_at {real} NOT NULL,
                updated_at {real} NOT NULL, started_at {real}, ended_at {real})""",
            "CREATE INDEX rollouts_status ON rollouts (status, qseq)",
            "CREATE INDEX rollouts_mode ON rollouts (mode, qseq)",
            "CREATE INDEX rollouts_version ON rollouts (resources_version, qseq)",
            "CREATE INDEX rollouts_group ON rollouts (group_id)",
            """CREATE TABLE attempts (
                id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, number INTEGER NOT NULL,
                worker_id TEXT NOT NULL, status TEXT NOT NULL, started_at {real} NOT NULL,
                heartbeat_at {real} NOT NULL, lease_expires_at {real} NOT NULL, deadline {real},
                ended_at {real}, reward {real}, error TEXT)""",
            "CREATE INDEX attempts_rollout ON attempts (rollout_id, number)",
            "CREATE INDEX attempts_live ON attempts (status, lease_expires_at)",
            """CREATE TABLE events (
                id {serial}, rollout_id TEXT NOT NULL, attempt_id TEXT NOT NULL, sequence BIGINT,
                type TEXT NOT NULL, timestamp {real} NOT NULL, data TEXT NOT NULL)""",
            "CREATE UNIQUE INDEX events_seq ON events (attempt_id, sequence)",
            "CREATE INDEX events_rollout ON events (rollout_id, timestamp, id)",
            "CREATE INDEX events_type ON events (type, id)",
            """CREATE TABLE resources (version INTEGER PRIMARY KEY, resources TEXT NOT NULL,
                metadata TEXT NOT NULL, created_at {real} NOT NULL)""",
            """CREATE TABLE workers (id TEXT PRIMARY KEY, last_seen {real} NOT NULL,
                claims INTEGER NOT NULL DEFAULT 0)""",
        ],
    ),
    (
        # Issue 18: each key lives on the row its request created (so it is kept as long as the
        # row); trial resources versions are never the latest.
        2,
        [
            "ALTER TABLE attempts ADD COLUMN claim_key TEXT",
            "ALTER TABLE attempts ADD COLUMN finish_key TEXT",
            # NULLs are distinct: attempts claimed without a key never conflict
            "CREATE UNIQUE INDEX attempts_claim_key ON attempts (worker_id, claim_key)",
            "ALTER TABLE resources ADD COLUMN request_key TEXT",
            "ALTER TABLE resources ADD COLUMN trial INTEGER NOT NULL DEFAULT 0",
            "CREATE UNIQUE INDEX resources_request_key ON resources (request_key)",
            "CREATE INDEX resources_latest ON resources (trial, version)",
            # what the server recognises a repeat of its own records by (a span's trace and span
            # id, a model call's key or body hash); only those rows are indexed, newest last
            "ALTER TABLE events ADD COLUMN call_key TEXT",
            "CREATE INDEX events_call_key ON events (attempt_id, call_key, id) WHERE call_key IS NOT NULL",
        ],
    ),
    (
        # Issue 14: credentials the server issues. An attempt's agent key (kept in plain text,
        # like the upstream keys in resources: it is useless once the attempt ends) and the
        # sha256 of a registered worker's token (the token itself is shown once, at registration).
        3,
        [
            "ALTER TABLE attempts ADD COLUMN agent_key TEXT",
            "CREATE UNIQUE INDEX attempts_agent_key ON attempts (agent_key)",
            "ALTER TABLE workers ADD COLUMN token_sha256 TEXT",
            "CREATE UNIQUE INDEX workers_token ON workers (token_sha256)",
        ],
    ),
    (
        # Issue 20: named rewards after the run. A slot per (rollout, name) holds a reward as it
        # stands (pending until scored); each score is a new row of reward_scores (the history),
        # which keeps the request's idempotency key.
        4,
        [
            """CREATE TABLE reward_slots (
                rollout_id TEXT NOT NULL, name TEXT NOT NULL, source TEXT NOT NULL,
                scale TEXT NOT NULL, state TEXT NOT NULL, revision INTEGER NOT NULL DEFAULT 0,
                current_id BIGINT, updated_at {real}, PRIMARY KEY (rollout_id, name))""",
            "CREATE INDEX reward_slots_state ON reward_slots (name, state)",
            """CREATE TABLE reward_scores (
                id {serial}, rollout_id TEXT NOT NULL, name TEXT NOT NULL, revision INTEGER NOT NULL,
                source TEXT NOT NULL, author TEXT, state TEXT NOT NULL, score {real}, value {real},
                error TEXT, comment TEXT, data TEXT NOT NULL, created_at {real} NOT NULL,
                request_key TEXT)""",
            "CREATE UNIQUE INDEX reward_scores_key ON reward_scores (request_key)",
            "CREATE INDEX reward_scores_slot ON reward_scores (rollout_id, name, revision)",
        ],
    ),
    (
        # Revocable workers: when an admin revoked the worker (NULL: never). A revoked worker's
        # token is refused, and no dequeue or heartbeat may name its id.
        5,
        ["ALTER TABLE workers ADD COLUMN revoked_at {real}"],
    ),
    (
        # Issue 37: who wrote each event, set by the server from the credential (EventSource).
        # Existing rows get it where the row tells: a sequence is the runner's numbering, an
        # "agent:" key an agent's post, a key or body hash on an llm_call the gateway's recorder.
        # The rest stay NULL (unknown), and training does not read their model calls.
        6,
        [
            "ALTER TABLE events ADD COLUMN source TEXT",
            "UPDATE events SET source = 'runner' WHERE sequence IS NOT NULL",
            "UPDATE events SET source = 'agent' WHERE sequence IS NULL AND call_key LIKE 'agent:%'",
            "UPDATE events SET source = 'gateway' WHERE sequence IS NULL AND type = 'llm_call' "
            "AND (call_key LIKE 'key:%' OR call_key LIKE 'sha256:%')",
        ],
    ),
    (
        # Issue 37: a key reused with another request is refused (store.keys), so each key is
        # kept with the sha256 of its request; writes that create no single row keep theirs in
        # request_keys. An attempt counts what its agent posted to the events URL (its quotas).
        7,
        [
            "ALTER TABLE attempts ADD COLUMN claim_sha256 TEXT",
            "ALTER TABLE attempts ADD COLUMN finish_sha256 TEXT",
            "ALTER TABLE attempts ADD COLUMN agent_events INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE attempts ADD COLUMN agent_bytes BIGINT NOT NULL DEFAULT 0",
            "ALTER TABLE resources ADD COLUMN request_sha256 TEXT",
            "ALTER TABLE reward_scores ADD COLUMN request_sha256 TEXT",
            "ALTER TABLE events ADD COLUMN request_sha256 TEXT",
            """CREATE TABLE request_keys (scope TEXT NOT NULL, key TEXT NOT NULL,
                body_sha256 TEXT NOT NULL, answer TEXT NOT NULL, created_at {real} NOT NULL,
                PRIMARY KEY (scope, key))""",
        ],
    ),
]

_APPLIED = (
    "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at {real} NOT NULL)"
)


def migrate(db: Database, migrations: Sequence[tuple[int, list[str]]] = MIGRATIONS) -> None:
    """Apply the migrations ``db`` has not recorded yet, all in one transaction. Under the
    backend's schema lock, replicas that start together wait for the first one, then find every
    version recorded and do nothing."""
    with db.transaction() as tx:
        db.lock_schema(tx)
        tx.run(_APPLIED.format(**db.types))
        done = {r[0] for r in tx.all("SELECT version FROM schema_migrations")}
        for version, statements in migrations:
            if version in done:
                continue
            for statement in statements:
                tx.run(statement.format(**db.types))
            tx.run("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (version, now()))
