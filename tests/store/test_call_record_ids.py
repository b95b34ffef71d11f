"""``record_call`` answers the id of the ``llm_call`` record a try went to (the call id the
gateway hands the agent), on every backend: a new record's own id, a joined record's id."""

from __future__ import annotations

from test_contract import claim, make

from agentbolt.schemas import EventCreate
from agentbolt.store import SqlStore
from agentbolt.store.calls import CallEvent


def _call(n: int) -> EventCreate:
    return EventCreate(type="llm_call", timestamp=1000.0 + n, data={"answer": n})


def test_record_call_answers_the_id_of_the_record(store: SqlStore) -> None:
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    store.add_events(aid, [EventCreate(sequence=0, type="message", data={})])  # ids are not 1, 2, ...
    first = store.record_call(aid, _call(0), None, "h1", retry=0)
    retried = store.record_call(aid, _call(1), None, "h1", retry=1)
    keyed = store.record_call(aid, _call(2), "k", "h2", retry=None)
    keyed_again = store.record_call(aid, _call(3), "k", "h2", retry=None)
    other = store.record_call(aid, _call(4), None, "h1", retry=0)
    assert [bool(r) for r in (first, retried, keyed, keyed_again, other)] == [True, False, True, False, True]
    stored = [(e.id, e.data["answer"]) for e in store.list_events(queued.id, types=["llm_call"]).items]
    assert stored == [(first.id, 1), (keyed.id, 3), (other.id, 4)]
    assert (retried.id, keyed_again.id) == (first.id, keyed.id)
    assert len({first.id, keyed.id, other.id}) == 3


def test_the_gateways_lean_call_event_records_as_an_event_create_does(store: SqlStore) -> None:
    """The gateway records with a :class:`CallEvent` (no pydantic model): the same record, on
    the first try and on a retry that joins it."""
    [queued] = store.enqueue(make(1))
    aid = claim(store).attempt.id
    lean = store.record_call(aid, CallEvent("llm_call", 1000.0, {"answer": 0}), None, "h1", retry=0)
    joined = store.record_call(aid, CallEvent("llm_call", 1001.0, {"answer": 1}), None, "h1", retry=1)
    model = store.record_call(aid, _call(2), None, "h2", retry=0)
    assert bool(lean) and not bool(joined) and joined.id == lean.id
    events = store.list_events(queued.id, types=["llm_call"]).items
    assert [(e.id, e.type, e.timestamp, e.data) for e in events] == [
        (lean.id, "llm_call", 1000.0, {"answer": 1, "retries": 1, "tries": [0, 1]}),
        (model.id, "llm_call", 1002.0, {"answer": 2, "retries": 0, "tries": [0]}),
    ]
