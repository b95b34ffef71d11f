"""Every stored event says who wrote it (``source``), and a database from before sources were
kept gets them where its rows tell (schema migration 6), on both backends."""

from __future__ import annotations

import pytest

from agentbolt.errors import InvalidInput
from agentbolt.schemas import EventCreate, EventSource, RolloutCreate, Task
from agentbolt.store.schema import migrate

LEGACY_ROWS = [  # (sequence, type, call_key): what each kind of writer left, and the source it gets
    (0, "reward", None, "runner"),
    (None, "message", "agent:k:0", "agent"),
    (None, "llm_call", "agent:k:1", "agent"),  # a model call an agent posted: never the gateway's
    (None, "llm_call", "sha256:ab", "gateway"),
    (None, "llm_call", "key:abc:retried", "gateway"),
    (None, "llm_call", None, None),  # no key: an agent's post without one; unknown
    (None, "span", "span:t:1", None),
]


def _running(store) -> tuple[str, str]:
    store.enqueue([RolloutCreate(task=Task(data={}))])
    claim = store.dequeue("w1")
    assert claim is not None
    return claim.rollout.id, claim.attempt.id


def test_each_writer_is_stored_as_the_source_it_was_given(store):
    rollout, attempt = _running(store)
    store.add_events(attempt, [EventCreate(sequence=0, type="message")], "w1")
    store.add_events(attempt, [EventCreate(sequence=1, type="message")], "w1", EventSource.ADMIN)
    store.add_agent_events(attempt, [EventCreate(type="message")], key="k")
    store.record_events(attempt, [EventCreate(type="span")], ["span:x"])
    events = store.list_events(rollout, limit=100).items
    assert [e.source for e in events] == ["runner", "admin", "agent", "runner"]


def test_a_state_naming_a_call_the_attempt_lacks_is_refused_and_stores_nothing(store):
    rollout, attempt = _running(store)
    for call in (12345, "7", True, -1):
        state = EventCreate(type="state", data={"key": "s", "llm_call_id": call})
        with pytest.raises(InvalidInput, match=f"llm_call_id {call!r} names no model call of attempt"):
            store.add_agent_events(attempt, [EventCreate(type="message"), state], key=None)
    assert store.list_events(rollout, limit=10).items == []


def test_migration_6_names_the_source_of_existing_rows_where_the_row_tells(store):
    rollout, attempt = _running(store)
    db = store.db
    with db.transaction() as tx:
        tx.run("DELETE FROM schema_migrations WHERE version = 6")
        tx.run("ALTER TABLE events DROP COLUMN source")
        for i, (sequence, kind, key, _) in enumerate(LEGACY_ROWS):
            tx.run(
                "INSERT INTO events (rollout_id, attempt_id, sequence, type, timestamp, data, call_key) "
                "VALUES (?, ?, ?, ?, ?, '{}', ?)",
                (rollout, attempt, sequence, kind, float(i), key),
            )
    migrate(db)
    events = store.list_events(rollout, limit=100).items
    assert [(e.type, e.source) for e in events] == [(kind, source) for _, kind, _, source in LEGACY_ROWS]
