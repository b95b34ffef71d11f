"""The async client's lean path (calls without query parameters to a plain-http server go
through ``Http1Transport.request``, not httpx's client) and the server's fast path for the
runner's three calls (dequeue, events, finish): against a real server, they answer and fail
as the httpx path and FastAPI's routes do."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentbolt.client import AsyncClient, Client, RequestError
from agentbolt.errors import AttemptEnded, NotFound
from agentbolt.http1 import Http1Transport
from agentbolt.schemas import AttemptStatus, EventCreate, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig
from agentbolt.server.config import Role
from agentbolt.server.run import ServerThread

TOKEN = "admin-token-for-the-lean-path"


@pytest.fixture
def secured(tmp_path):
    config = ServerConfig.with_token(TOKEN, db=str(tmp_path / "lean.db"))
    with ServerThread(config) as server:
        yield server


async def _run_one(url: str, events: int = 3) -> tuple[str, str, int, RolloutStatus]:
    """Register, claim, post events, finish: through the lean path."""
    client = AsyncClient(url, token=TOKEN)
    try:
        assert client._lean is not None  # plain http: the lean path is taken
        registration = await client.register_worker("lean")
        assert registration is not None
        claim = await client.dequeue(registration.worker_id)
        assert claim is not None
        added = await client.add_events(
            claim.attempt.id, [EventCreate(sequence=i, type="message", data={"i": i}) for i in range(events)]
        )
        # the same events again: stored once
        again = await client.add_events(
            claim.attempt.id, [EventCreate(sequence=i, type="message", data={"i": i}) for i in range(events)]
        )
        assert again == 0
        rollout = await client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0)
        return claim.rollout.id, claim.attempt.id, added, rollout.status
    finally:
        await client.aclose()


def test_a_rollout_runs_through_the_lean_path_and_the_fast_routes(secured):
    with Client(secured.url, token=TOKEN) as admin:
        [queued] = admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        rollout_id, attempt_id, added, status = asyncio.run(_run_one(secured.url))
        assert (rollout_id, added, status) == (queued.id, 3, RolloutStatus.SUCCEEDED)
        stored = admin.get_rollout(rollout_id)
        assert stored.status == RolloutStatus.SUCCEEDED and stored.reward == 1.0
        assert [e.data for e in admin.all_events(rollout_id)] == [{"i": 0}, {"i": 1}, {"i": 2}]


async def _errors(url: str) -> None:
    client = AsyncClient(url, token=TOKEN)
    other = AsyncClient(url, token=TOKEN)
    try:
        registration = await client.register_worker("one")
        assert registration is not None and await other.register_worker("two") is not None
        claim = await client.dequeue(registration.worker_id)
        assert claim is not None
        # a worker token naming another worker: 403 from the fast path, as the route gives it
        with pytest.raises(RequestError, match="belongs to worker") as refused:
            await client.add_events(claim.attempt.id, [EventCreate(type="x")], worker_id="someone-else")
        assert refused.value.status_code == 403
        with pytest.raises(NotFound, match="at-missing"):
            await client.finish("at-missing", AttemptStatus.SUCCEEDED, 1.0)
        finished = await client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0)
        assert finished.status == RolloutStatus.SUCCEEDED
        with pytest.raises(AttemptEnded, match="succeeded"):
            await client.add_events(claim.attempt.id, [EventCreate(sequence=9, type="x")])
        # the queue is empty: null, not an error
        assert await client.dequeue(registration.worker_id) is None
    finally:
        await client.aclose()
        await other.aclose()


def test_errors_through_the_lean_path_are_the_classes_the_server_names(secured):
    with Client(secured.url, token=TOKEN) as admin:
        admin.enqueue([RolloutCreate(task=Task(data={"q": 2}))])
    asyncio.run(_errors(secured.url))


@pytest.mark.parametrize(
    ("path", "body", "headers", "where"),
    [
        ("/api/dequeue", b'{"worker_id": ""}', {}, "body.worker_id"),
        ("/api/dequeue", b'{"worker_id": "w", "wait": "5"}', {}, "body.wait"),
        ("/api/dequeue", b'{"worker_id": "w", "extra": 1}', {}, "body.extra"),
        ("/api/dequeue", b"{not json", {}, "body"),
        ("/api/dequeue", b'{"worker_id": "w"}', {"idempotency-key": "has space"}, "header.Idempotency-Key"),
        ("/api/attempts/at-1/events", b'{"events": [{"type": ""}]}', {}, "body.events.0.type"),
        ("/api/attempts/at-1/finish", b'{"status": "nope"}', {}, "body.status"),
    ],
)
def test_bad_input_to_the_fast_routes_gets_fastapis_422(secured, path, body, headers, where):
    answer = httpx.post(
        secured.url + path,
        content=body,
        headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json", **headers},
    )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "validation_error"
    assert error["message"].startswith(where)


def test_a_runner_token_must_name_its_worker_on_the_fast_routes(tmp_path):
    config = ServerConfig(db=str(tmp_path / "r.db"), tokens={TOKEN: Role.ADMIN, "runner-token": Role.RUNNER})
    with ServerThread(config) as server, Client(server.url, token=TOKEN) as admin:
        admin.enqueue([RolloutCreate(task=Task(data={}))])
        with Client(server.url, token="runner-token") as runner:
            claim = runner.dequeue("w1")
            assert claim is not None
            with pytest.raises(RequestError) as caught:
                runner.add_events(claim.attempt.id, [EventCreate(type="x")])
            assert caught.value.status_code == 422
            assert "must name the worker" in str(caught.value)


async def _chunked_and_timeout() -> None:
    async def app(scope, receive, send):  # a raw ASGI app: a chunked answer, or a slow one
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            await asyncio.sleep(2)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-seen", b"yes")]})
        await send({"type": "http.response.body", "body": b'{"a":', "more_body": True})
        await send({"type": "http.response.body", "body": b" 1}"})

    import uvicorn

    from agentbolt.server.run import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    transport = Http1Transport()
    try:
        timeouts = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}
        for _ in range(2):  # the second reuses the kept-alive connection
            answer = await transport.request("POST", ("127.0.0.1", port), b"/x", [], b"{}", timeouts)
            assert (answer.status_code, answer.content, answer.header(b"x-seen")) == (200, b'{"a": 1}', "yes")
        with pytest.raises(httpx.ReadTimeout):
            await transport.request(
                "POST", ("127.0.0.1", port), b"/slow", [], b"{}", {**timeouts, "read": 0.2}
            )
    finally:
        await transport.aclose()
        server.should_exit = True
        await task


def test_the_lean_request_reads_chunked_answers_and_keeps_its_read_timeout():
    asyncio.run(_chunked_and_timeout())


async def _cancel(url: str, rollout_id: str) -> RolloutStatus:
    client = AsyncClient(url, token=TOKEN)
    try:
        return (await client.cancel(rollout_id)).status  # a POST without a body
    finally:
        await client.aclose()


def test_a_write_without_a_body_goes_through_the_lean_path(secured):
    with Client(secured.url, token=TOKEN) as admin:
        [queued] = admin.enqueue([RolloutCreate(task=Task(data={"q": 3}))])
        assert asyncio.run(_cancel(secured.url, queued.id)) == RolloutStatus.CANCELLED
        assert admin.get_rollout(queued.id).status == RolloutStatus.CANCELLED
