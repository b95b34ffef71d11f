"""Client.pages: one loop that follows a paged endpoint's cursors, used by every reader of
paged data (all_events, events_of, the SFT export, the prompt export); and the errors both
clients raise for an error answer: the class its body names, else one chosen by status."""

from __future__ import annotations

import json

import httpx
import pytest

from agentbolt.cli.export import all_resources
from agentbolt.client import AsyncClient, Client, RequestError
from agentbolt.errors import (
    AgentboltError,
    AttemptEnded,
    ConfigError,
    Conflict,
    InvalidTransition,
    LeaseLost,
    NotFound,
)
from agentbolt.export import fetch_rollouts
from agentbolt.schemas import AttemptStatus, EventCreate, PromptTemplate, RolloutCreate, Task


def _paged_resources(total: int, per_page: int, seen: list[dict]) -> httpx.MockTransport:
    """GET /api/resources answering ``total`` versions ``per_page`` at a time; records each query."""

    def handle(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        seen.append(params)
        start = int(params.get("cursor", "0"))
        versions = range(start + 1, min(start + per_page, total) + 1)
        items = [{"version": v, "resources": {}, "created_at": 0.0} for v in versions]
        more = start + per_page < total
        return httpx.Response(
            200, json={"items": items, "next_cursor": str(start + per_page) if more else None}
        )

    return httpx.MockTransport(handle)


def test_pages_follows_next_cursor_until_the_last_page():
    seen: list[dict] = []
    with Client("http://store", transport=_paged_resources(7, 3, seen)) as client:
        versions = [r.version for r in client.pages(client.list_resources, limit=3)]
    assert versions == [1, 2, 3, 4, 5, 6, 7]
    assert [q.get("cursor") for q in seen] == [None, "3", "6"]
    assert all(q["limit"] == "3" for q in seen)


def test_pages_is_lazy_and_stops_at_an_empty_last_page():
    seen: list[dict] = []
    with Client("http://store", transport=_paged_resources(0, 3, seen)) as client:
        pages = client.pages(client.list_resources, limit=3)
        assert seen == []  # nothing is fetched before the first item is asked for
        assert list(pages) == []
    assert len(seen) == 1


def test_the_prompt_export_reads_every_resources_version():
    seen: list[dict] = []
    with Client("http://store", transport=_paged_resources(1201, 500, seen)) as client:
        assert [r.version for r in all_resources(client)] == list(range(1, 1202))
    assert len(seen) == 3


def test_paged_readers_against_a_real_server(client: Client):
    """list_rollouts, list_events and the batched events query, each over several pages."""
    client.publish_resources({"system_prompt": PromptTemplate(template="p")})
    created = client.enqueue([RolloutCreate(task=Task(id=f"t{i}", data={})) for i in range(5)])
    for _ in created:
        claim = client.dequeue("w")
        assert claim is not None
        events = [EventCreate(sequence=n, type="message", data={"n": n}) for n in range(3)]
        client.add_events(claim.attempt.id, events)
        client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, reward=float(claim.rollout.task.id[1:]))
    ids = [r.id for r in created]
    assert [r.id for r in client.pages(client.list_rollouts, limit=2)] == ids
    assert [e.data["n"] for e in client.pages(client.list_events, ids[0], limit=2)] == [0, 1, 2]
    assert [e.data["n"] for e in client.all_events(ids[1], limit=1)] == [0, 1, 2]
    assert {rid: len(events) for rid, events in client.events_of(ids).items()} == dict.fromkeys(ids, 3)
    kept = fetch_rollouts(client, mode=None, version=None, min_reward=2.0)
    assert [r.task.id for r in kept] == ["t2", "t3", "t4"]
    assert [r.version for r in all_resources(client)] == [1]


def _answering(status: int, body: bytes, content_type: str = "application/json") -> httpx.MockTransport:
    return httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"content-type": content_type})
    )


def _error(status: int, type_: str, message: str) -> httpx.MockTransport:
    return _answering(status, json.dumps({"error": {"type": type_, "message": message}}).encode())


@pytest.mark.parametrize(
    ("status", "type_", "raised"),
    [
        (404, "NotFound", NotFound),
        (409, "LeaseLost", LeaseLost),
        (409, "AttemptEnded", AttemptEnded),
        (409, "InvalidTransition", InvalidTransition),
        (409, "Conflict", Conflict),
        (400, "ConfigError", ConfigError),
    ],
)
def test_an_error_body_names_the_error_raised(status, type_, raised):
    with Client("http://store", transport=_error(status, type_, "what went wrong")) as client:
        with pytest.raises(AgentboltError) as caught:
            client.get_rollout("ro-1")
    assert type(caught.value) is raised
    assert str(caught.value) == "what went wrong"


@pytest.mark.parametrize(
    ("status", "body", "raised"),
    [
        (404, b'{"error": {"type": "http_error", "message": "Not Found"}}', NotFound),
        (409, b'{"error": {"type": "Mystery", "message": "cannot go from a to b"}}', InvalidTransition),
        (409, b'{"error": {"type": "Mystery", "message": "held by another worker"}}', LeaseLost),
        (409, b"<html>proxy page</html>", LeaseLost),
        (400, b'{"error": {"type": "bad_request", "message": "nope"}}', RequestError),
        (422, b'{"error": {"type": "validation_error", "message": "reward: bad"}}', RequestError),
    ],
)
def test_an_unknown_error_type_falls_back_to_the_status(status, body, raised):
    with Client("http://store", transport=_answering(status, body)) as client:
        with pytest.raises(AgentboltError) as caught:
            client.get_rollout("ro-1")
    assert type(caught.value) is raised
    if raised is RequestError:
        assert caught.value.status_code == status


async def test_the_async_client_maps_errors_the_same_way():
    client = AsyncClient("http://store", transport=httpx.MockTransport(_attempt_ended))
    try:
        with pytest.raises(AttemptEnded, match="cancelled"):
            await client.heartbeat("at-1", "w")
    finally:
        await client.aclose()


def _attempt_ended(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        409, json={"error": {"type": "AttemptEnded", "message": "attempt at-1 is cancelled"}}
    )


def test_a_real_server_error_arrives_as_its_class(client: Client):
    with pytest.raises(NotFound, match="ro-missing"):
        client.get_rollout("ro-missing")


def test_the_backoff_stays_finite_however_long_a_call_keeps_failing():
    """A runner retries forever while the server is down: its thousandth delay is as bounded
    as its tenth (the exponent once overflowed a float at the 1,025th failure)."""
    from agentbolt.client import RetryPolicy

    policy = RetryPolicy(attempts=0, base_delay=0.2, max_delay=5.0)
    for attempt in (0, 10, 1024, 5000, 10**6):
        assert 0.0 <= policy.delay(attempt) <= 5.0
    assert not policy.gives_up(10**6)  # attempts=0: an outage is ridden out
    assert policy.gives_up(7, server_errors=5)  # but not a request the server fails on
