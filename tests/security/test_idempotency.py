"""Issue 37, the exactly-once leftovers: an ``Idempotency-Key`` names one request on every keyed
route (a repeat gets the first answer, the key sent with another body a 422
``IdempotencyKeyReused`` that holds nothing of the first answer and stores nothing), the
runner's uploads are exactly once, and a finish the server fails on fails its attempt with
the server's error rather than a lapsed lease."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread
from agentbolt.store import open_store
from tests.security.conftest import ADMIN

WORKER = "w-keys"


@pytest.fixture
def server(tmp_path):
    config = ServerConfig(db=str(tmp_path / "store.db"), tokens={ADMIN: Role.ADMIN})
    with ServerThread(config) as srv:
        yield srv


@dataclass
class Case:
    """A keyed route: where to post, as whom, two different bodies, and what it stored."""

    path: str
    token: str
    first: dict[str, Any]
    other: dict[str, Any]
    stored: Callable[[], Any]


def _claimed(admin: Client, upstream) -> Any:
    admin.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
    admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
    claim = admin.dequeue(WORKER)
    assert claim is not None and claim.agent_key is not None
    return claim


def _events(admin: Client, rollout_id: str, kind: str | None = None) -> list[tuple[Any, ...]]:
    return [(e.type, e.source, e.data) for e in admin.all_events(rollout_id) if kind in (None, e.type)]


def _enqueue(admin: Client, upstream) -> Case:
    def task(q: int) -> dict[str, Any]:
        return {"rollouts": [{"task": {"id": f"t{q}", "data": {"q": q}}}]}

    stored = lambda: sorted(r.task.id for r in admin.list_rollouts().items)  # noqa: E731
    return Case("/api/rollouts", ADMIN, task(1), task(2), stored)


def _dequeue(admin: Client, upstream) -> Case:
    admin.enqueue([RolloutCreate(task=Task(data={"q": i})) for i in range(2)])
    stored = lambda: sorted(r.status for r in admin.list_rollouts().items)  # noqa: E731
    first, other = {"worker_id": WORKER, "lease_seconds": 30}, {"worker_id": WORKER, "lease_seconds": 60}
    return Case("/api/dequeue", ADMIN, first, other, stored)


def _finish(admin: Client, upstream) -> Case:
    claim = _claimed(admin, upstream)
    stored = lambda: admin.list_attempts(claim.rollout.id)  # noqa: E731
    first = {"status": "succeeded", "reward": 1.0, "worker_id": WORKER}
    other = {"status": "succeeded", "reward": 0.0, "worker_id": WORKER}
    return Case(f"/api/attempts/{claim.attempt.id}/finish", ADMIN, first, other, stored)


def _publish(admin: Client, upstream) -> Case:
    def llm(model: str) -> dict[str, Any]:
        return {"resources": {"llm": LLM(base_url=upstream.base_url, model=model).model_dump(mode="json")}}

    stored = lambda: [r.version for r in admin.list_resources().items]  # noqa: E731
    return Case("/api/resources", ADMIN, llm("a"), llm("b"), stored)


def _reward(admin: Client, upstream) -> Case:
    claim = _claimed(admin, upstream)
    admin.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id=WORKER)
    stored = lambda: [(h.revision, h.score) for h in admin.reward_history(claim.rollout.id)]  # noqa: E731
    path = f"/api/rollouts/{claim.rollout.id}/rewards"
    return Case(path, ADMIN, {"name": "human", "score": 0.75}, {"name": "human", "score": 0.25}, stored)


def _attempt_events(admin: Client, upstream) -> Case:
    claim = _claimed(admin, upstream)
    first = {"worker_id": WORKER, "events": [{"sequence": 0, "type": "message", "data": {"n": 1}}]}
    other = {"worker_id": WORKER, "events": [{"sequence": 1, "type": "message", "data": {"n": 2}}]}
    stored = lambda: _events(admin, claim.rollout.id)  # noqa: E731
    return Case(f"/api/attempts/{claim.attempt.id}/events", ADMIN, first, other, stored)


def _agent_events(admin: Client, upstream) -> Case:
    claim = _claimed(admin, upstream)
    stored = lambda: _events(admin, claim.rollout.id)  # noqa: E731
    path = f"/agent/{claim.rollout.id}/{claim.attempt.id}/events"
    return Case(path, claim.agent_key, {"reward": 0.25}, {"reward": 1.0}, stored)


def _gateway(admin: Client, upstream) -> Case:
    claim = _claimed(admin, upstream)

    def chat(text: str) -> dict[str, Any]:
        return {"model": "double", "messages": [{"role": "user", "content": text}]}

    stored = lambda: (len(upstream.calls), _events(admin, claim.rollout.id))  # noqa: E731
    path = f"/gateway/{claim.rollout.id}/{claim.attempt.id}/v1/chat/completions"
    return Case(path, claim.agent_key, chat("first question"), chat("another question"), stored)


ROUTES = {
    "enqueue": _enqueue,
    "dequeue": _dequeue,
    "finish": _finish,
    "publish": _publish,
    "reward": _reward,
    "attempt-events": _attempt_events,
    "agent-events": _agent_events,
    "gateway": _gateway,
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_key_reused_with_another_body_is_422_on_every_keyed_route(server, admin, upstream, route):
    case = ROUTES[route](admin, upstream)

    def post(body: dict[str, Any]) -> httpx.Response:
        headers = {"authorization": f"Bearer {case.token}", "idempotency-key": f"key-{route}"}
        return httpx.post(server.url + case.path, json=body, headers=headers, timeout=10)

    first = post(case.first)
    assert first.status_code in (200, 201), first.text
    stored = case.stored()
    if route != "gateway":  # a gateway retry is forwarded again and joins the call's record
        again = post(case.first)
        assert (again.status_code, again.json()) == (first.status_code, first.json())
    else:
        again = post(case.first)
        assert again.headers["x-agentbolt-call-id"] == first.headers["x-agentbolt-call-id"]
        stored = case.stored()
    reused = post(case.other)
    assert reused.status_code == 422, reused.text
    error = reused.json()["error"]
    assert error["type"] == "IdempotencyKeyReused" and f"key-{route}" in error["message"]
    assert set(reused.json()) == {"error"}  # nothing of the first answer
    assert case.stored() == stored  # and nothing stored


def test_a_retried_upload_of_attempt_events_stores_once_and_gets_the_first_answer(server, admin, upstream):
    """The runner's upload after a lost answer: the same key and batch again."""
    claim = _claimed(admin, upstream)
    url = f"{server.url}/api/attempts/{claim.attempt.id}/events"
    batch = {"worker_id": WORKER, "events": [{"sequence": i, "type": "message"} for i in range(3)]}
    headers = {"authorization": f"Bearer {ADMIN}", "idempotency-key": "upload-1"}
    answers = [httpx.post(url, json=batch, headers=headers, timeout=10).json() for _ in range(3)]
    assert answers == [{"added": 3}] * 3
    # without a key a repeat still stores nothing twice ((attempt, sequence) is unique), but
    # answers for itself
    plain = {"authorization": f"Bearer {ADMIN}"}
    assert httpx.post(url, json=batch, headers=plain, timeout=10).json() == {"added": 0}
    assert len(admin.all_events(claim.rollout.id)) == 3
    # the first answer stands after the attempt ended; a new key gets the store's word
    admin.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id=WORKER)
    assert httpx.post(url, json=batch, headers=headers, timeout=10).json() == {"added": 3}
    late = httpx.post(url, json=batch, headers={**plain, "idempotency-key": "upload-2"}, timeout=10)
    assert late.status_code == 409 and late.json()["error"]["type"] == "AttemptEnded"


def test_the_clients_upload_sends_one_key_per_batch_and_its_retry_the_same(server, admin, upstream):
    """Each request the client makes carries its own key; a retry of it (here: its answer lost
    once) sends that key again, so the server answers it with the first answer."""
    claim = _claimed(admin, upstream)
    seen: list[str] = []
    lost = [True]

    class LoseFirstAnswer(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport()

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            answer = self.inner.handle_request(request)
            if request.url.path.endswith("/events"):
                seen.append(request.headers["idempotency-key"])
                if lost[0]:
                    answer.read()
                    lost[0] = False
                    raise httpx.ReadError("answer lost", request=request)
            return answer

    from agentbolt.schemas import EventCreate

    with Client(server.url, ADMIN, transport=LoseFirstAnswer()) as client:
        batch = [EventCreate(sequence=i, type="message") for i in range(2)]
        assert client.add_events(claim.attempt.id, batch, WORKER) == 2  # the first answer
        assert client.add_events(claim.attempt.id, [EventCreate(sequence=2, type="m")], WORKER) == 1
    assert seen[0] == seen[1] and seen[2] != seen[0]
    assert len(admin.all_events(claim.rollout.id)) == 3


def test_a_finish_the_server_answers_500_fails_its_attempt_with_that_error(tmp_path):
    """The store fails on every succeeded outcome (a fault injected into it): the runner's five
    tries get HTTP 500, then it fails the attempt saying so, instead of leaving it to lapse."""
    config = ServerConfig(db=str(tmp_path / "store.db"), tokens={ADMIN: Role.ADMIN})
    store = open_store(config.db)
    finish = store.finish_attempt
    tries: list[str] = []

    def failing(attempt_id: str, outcome: Any, *args: Any, **kwargs: Any) -> Any:
        tries.append(outcome.status)
        if outcome.status == AttemptStatus.SUCCEEDED:
            raise RuntimeError("the disk holding succeeded outcomes is gone")
        return finish(attempt_id, outcome, *args, **kwargs)

    store.finish_attempt = failing  # type: ignore[method-assign]
    with ServerThread(config, store=store) as srv, Client(srv.url, ADMIN) as admin:
        [ro] = admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        program = Program([sys.executable, "-c", "pass"], scorer=lambda run: 1.0)
        runner = Runner(program, srv.url, token=ADMIN, max_rollouts=1, poll_wait=0.2, lease_seconds=60)
        asyncio.run(asyncio.wait_for(runner.run(), 60))
        assert tries == [AttemptStatus.SUCCEEDED] * 5 + [AttemptStatus.FAILED]
        assert (runner.completed, runner.failed, runner.lost) == (0, 1, 0)
        rollout = admin.get_rollout(ro.id)
        [attempt] = admin.list_attempts(ro.id)
        assert rollout.status == RolloutStatus.FAILED and attempt.status == AttemptStatus.FAILED
        assert attempt.error is not None and "lease" not in attempt.error
        assert "the server failed on the attempt's finish (succeeded)" in attempt.error
        assert "failed after 5 tries: HTTP 500" in attempt.error and "internal server error" in attempt.error
