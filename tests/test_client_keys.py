"""Idempotency keys: every mutating call of both clients carries one ``Idempotency-Key``, made
once per call and sent again by each retry; reads carry none.

A small HTTP server on 127.0.0.1 records what arrives (method, path, key, body) and answers
each endpoint with a canned body. Between the client and the server sits a transport that lets
the first copy of every keyed request reach the server, reads the answer, drops it and raises
a read error: the client's retry must carry the same key. A last test does the same against the
real agentbolt server: the store holds each write once."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from agentbolt.client import AsyncClient, Client, RetryPolicy
from agentbolt.http1 import IDEMPOTENCY_KEY, Http1Transport
from agentbolt.schemas import (
    Attempt,
    AttemptStatus,
    Claim,
    EventCreate,
    Mode,
    PromptTemplate,
    Resources,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.server import ServerThread

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    key: str | None
    body: Any


def _rollout(rollout_id: str = "ro-1") -> dict[str, Any]:
    return Rollout(
        id=rollout_id,
        task=Task(id="t", data={}),
        mode=Mode.TRAIN,
        status=RolloutStatus.RUNNING,
        resources_version=None,
        timeout_seconds=None,
        max_attempts=3,
        attempts=1,
        created_at=0.0,
        updated_at=0.0,
    ).model_dump(mode="json")


_ATTEMPT = Attempt(
    id="at-1",
    rollout_id="ro-1",
    number=1,
    worker_id="w",
    status=AttemptStatus.RUNNING,
    started_at=0.0,
    heartbeat_at=0.0,
    lease_expires_at=60.0,
).model_dump(mode="json")
_RESOURCES = Resources(version=1, resources={}, created_at=0.0).model_dump(mode="json")


def _answer(method: str, path: str, body: Any) -> Any:
    """The canned answer of each endpoint the tests call."""
    if path == "/api/rollouts" and method == "POST":
        return [_rollout(item["id"]) for item in body["rollouts"]]
    if path == "/api/dequeue":
        return Claim(rollout=_rollout(), attempt=_ATTEMPT, resources=None, lease_seconds=60.0).model_dump(
            mode="json"
        )
    if path == "/api/rollouts/wait":
        return {"rollouts": [], "done": True}
    if path == "/api/events/query":
        return {"items": [], "next_cursor": None}
    if path.startswith("/api/resources"):
        return _RESOURCES
    if path.endswith("/heartbeat"):
        return _ATTEMPT
    if path.endswith("/events"):
        return {"added": len(body["events"])}
    return _rollout()  # finish, cancel, get


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect
    seen: list[Seen]

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = self.path.split("?")[0]
        self.seen.append(Seen(self.command, path, self.headers.get(IDEMPOTENCY_KEY), body))
        data = json.dumps(_answer(self.command, path, body)).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[Seen]]]:
    seen: list[Seen] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


class _DropFirstAnswer(httpx.BaseTransport):
    """The first copy of each keyed request reaches the server; its answer is lost."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.keys: set[str] = set()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        key = request.headers.get(IDEMPOTENCY_KEY)
        if key is None or key in self.keys:
            return response
        self.keys.add(key)
        response.read()
        response.close()
        raise httpx.ReadError("the answer was lost", request=request)

    def close(self) -> None:
        self.inner.close()


class _AsyncDropFirstAnswer(httpx.AsyncBaseTransport):
    """:class:`_DropFirstAnswer` over the lean transport the async client uses."""

    def __init__(self) -> None:
        self.inner = Http1Transport()
        self.keys: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        key = request.headers.get(IDEMPOTENCY_KEY)
        if key is None or key in self.keys:
            return response
        self.keys.add(key)
        await response.aread()
        await response.aclose()
        raise httpx.ReadError("the answer was lost", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


WRITES = [
    ("POST", "/api/rollouts"),
    ("POST", "/api/dequeue"),
    ("POST", "/api/attempts/at-1/heartbeat"),
    ("POST", "/api/attempts/at-1/events"),
    ("POST", "/api/attempts/at-1/finish"),
    ("POST", "/api/rollouts/ro-1/cancel"),
    ("POST", "/api/resources"),
]
READS = [("POST", "/api/rollouts/wait"), ("GET", "/api/resources/1")]
_EVENTS = [EventCreate(sequence=0, type="message", data={})]
_NEW = [RolloutCreate(task=Task(data={"n": 1})), RolloutCreate(id="mine", task=Task(data={"n": 2}))]


def _check_keys(seen: list[Seen], reads: list[tuple[str, str]]) -> None:
    """Each write arrived twice under one key of its own; each read once, without a key."""
    by_call: dict[tuple[str, str], list[Seen]] = {}
    for s in seen:
        by_call.setdefault((s.method, s.path), []).append(s)
    assert sorted(by_call) == sorted(WRITES + reads)
    keys = set()
    for call in WRITES:
        copies = by_call[call]
        assert len(copies) == 2, call
        assert copies[0].key == copies[1].key, call
        assert re.fullmatch(r"[0-9a-f]{32}", copies[0].key or ""), call
        assert copies[0].body == copies[1].body, call
        keys.add(copies[0].key)
    assert len(keys) == len(WRITES)  # one key per call, never shared
    for call in reads:
        assert [s.key for s in by_call[call]] == [None], call


def _check_enqueue_and_publish(seen: list[Seen]) -> None:
    enqueued = next(s.body["rollouts"] for s in seen if s.path == "/api/rollouts")
    assert re.fullmatch(r"ro-[0-9a-f]{16}", enqueued[0]["id"])  # named by the client
    assert enqueued[1]["id"] == "mine"
    published = next(s.body for s in seen if s.path == "/api/resources")
    assert published["trial"] is True


def test_the_sync_client_retries_each_write_under_its_key(recorder):
    url, seen = recorder
    with Client(url, retry=FAST_RETRY, transport=_DropFirstAnswer()) as client:
        rollouts = client.enqueue(_NEW)
        assert rollouts[1].id == "mine"
        claim = client.dequeue("w")
        assert claim is not None and claim.lease_seconds == 60.0
        client.heartbeat(claim.attempt.id, "w")
        assert client.add_events(claim.attempt.id, _EVENTS, "w") == 1
        client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w")
        client.cancel("ro-1")
        client.publish_resources({"p": PromptTemplate(template="x")}, trial=True)
        client.wait(["ro-1"], timeout=0.1)
        client.get_resources(1)
        assert client.events_of(["ro-1"]) == {"ro-1": []}
    _check_keys(seen, READS + [("POST", "/api/events/query")])
    _check_enqueue_and_publish(seen)


async def test_the_async_client_retries_each_write_under_its_key(recorder):
    url, seen = recorder
    client = AsyncClient(url, retry=FAST_RETRY, transport=_AsyncDropFirstAnswer())
    try:
        await client.enqueue(_NEW)
        claim = await client.dequeue("w")
        assert claim is not None
        await client.heartbeat(claim.attempt.id, "w")
        assert await client.add_events(claim.attempt.id, _EVENTS, "w") == 1
        await client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w")
        await client.cancel("ro-1")
        await client.publish_resources({"p": PromptTemplate(template="x")}, trial=True)
        await client.wait(["ro-1"], timeout=0.1)
        await client.get_resources(1)
    finally:
        await client.aclose()
    _check_keys(seen, READS)
    _check_enqueue_and_publish(seen)


def test_lost_answers_leave_one_of_each_write_on_the_real_server(tmp_path):
    """Against the real server, every write's first answer lost: each retry gets the first
    result back, and the store holds each write once."""
    from agentbolt.server import ServerConfig

    lossy = _DropFirstAnswer()
    with (
        ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server,
        Client(server.url, retry=FAST_RETRY, transport=lossy) as client,
    ):
        version = client.publish_resources({"p": PromptTemplate(template="x")}).version
        trial = client.publish_resources({"p": PromptTemplate(template="y")}, trial=True).version
        created = client.enqueue([RolloutCreate(task=Task(data={"n": n})) for n in range(2)])
        claim = client.dequeue("w")
        assert claim is not None
        client.heartbeat(claim.attempt.id, "w")
        client.add_events(claim.attempt.id, _EVENTS, "w")  # the retry's answer: 0 new events
        finished = client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w")
        other = next(r.id for r in created if r.id != claim.rollout.id)
        cancelled = client.cancel(other)
        stored = client.list_rollouts(limit=10).items
        versions = sorted(r.version for r in client.list_resources().items)
        latest = client.latest_resources()
        events = client.all_events(claim.rollout.id)
    assert len(lossy.keys) == 8  # every write lost its first answer
    assert (version, trial, versions) == (1, 2, [1, 2])
    assert latest is not None and latest.version == 1  # a trial is never the latest
    assert sorted(r.id for r in stored) == sorted(r.id for r in created)
    assert finished.status == RolloutStatus.SUCCEEDED and finished.attempts == 1
    assert cancelled.status == RolloutStatus.CANCELLED
    assert [e.sequence for e in events] == [0]
