"""Issue 37, quotas per attempt: an agent that floods its events URL or the gateway, or posts a
giant event, is refused (429 for a count, 413 for bytes, naming the limit) while its attempt
goes on, the runner serves the next rollout, and nothing refused is stored. Limits are set low
here so each probe is quick."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.security.conftest import ADMIN

RUNNER = "run-token-quota-2"
EVENTS, BYTES, CALLS = 5, 4000, 3

# Posts 8 events, one request each, then a giant one; prints each answer's status and the last
# refusal's message, and exits 0: the agent did its work, only its flood was refused.
FLOOD = r"""
import json, os, urllib.error, urllib.request
def post(body):
    request = urllib.request.Request(
        os.environ["AGENTBOLT_EVENTS_URL"], data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        return urllib.request.urlopen(request, timeout=10).status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"]
answers = [post({"type": "custom.flood", "data": {"i": i}}) for i in range(8)]
print("statuses", " ".join(str(s) for s, _ in answers))
print("refused:", answers[-1][1])
"""


@pytest.fixture
def server(tmp_path):
    config = ServerConfig(
        db=str(tmp_path / "store.db"),
        tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER},
        quota_events=EVENTS,
        quota_event_bytes=BYTES,
        quota_calls=CALLS,
    )
    with ServerThread(config) as srv:
        yield srv


def _agent_events(admin: Client, rollout_id: str) -> list:
    return [e for e in admin.all_events(rollout_id) if e.source == "agent"]


def test_an_event_flood_is_429_after_the_limit_and_the_runner_serves_the_next_rollout(server, admin):
    rollouts = admin.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(2)])
    script = FLOOD.replace("{", "{{").replace("}", "}}")  # the argv is a template: braces doubled
    runner = Runner(
        Program([sys.executable, "-c", script], scorer=lambda run: 1.0),
        server.url,
        token=RUNNER,
        max_rollouts=2,
        poll_wait=0.2,
    )
    asyncio.run(asyncio.wait_for(runner.run(), 60))
    assert runner.completed == 2 and runner.failed == 0
    for ro in rollouts:
        rollout = admin.get_rollout(ro.id)
        assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error  # the attempt went on
        stdout = " ".join(
            e.data["content"]
            for e in admin.all_events(ro.id)
            if e.type == "message" and e.data.get("role") == "stdout"
        )
        assert "statuses 200 200 200 200 200 429 429 429" in stdout, stdout
        assert f"at most {EVENTS} events" in stdout and "quota_events" in stdout
        # each attempt has its own quota; the refused events are not stored
        flood = _agent_events(admin, ro.id)
        assert [e.data["i"] for e in flood] == [0, 1, 2, 3, 4]


class _Agent:
    """One claimed attempt, seen from its agent: its key, its events URL, its gateway."""

    def __init__(self, server: ServerThread, admin: Client, upstream) -> None:
        admin.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
        [self.rollout] = admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        claim = admin.dequeue("w-quota")
        assert claim is not None and claim.agent_key is not None
        self.claim, self.url = claim, server.url
        self.headers = {"authorization": f"Bearer {claim.agent_key}"}

    def post(self, body: object) -> httpx.Response:
        url = f"{self.url}/agent/{self.claim.rollout.id}/{self.claim.attempt.id}/events"
        return httpx.post(url, json=body, headers=self.headers, timeout=10)

    def call(self, text: str = "hi") -> httpx.Response:
        llm = self.claim.resources.resources["llm"]
        body = {"model": "double", "messages": [{"role": "user", "content": text}]}
        return httpx.post(f"{llm.base_url}/chat/completions", json=body, headers=self.headers, timeout=10)


def test_a_giant_event_is_413_naming_the_limit_and_the_attempt_goes_on(server, admin, upstream):
    agent = _Agent(server, admin, upstream)
    giant = agent.post({"type": "message", "data": {"content": "x" * (BYTES + 1)}})
    assert giant.status_code == 413, giant.text
    error = giant.json()["error"]
    assert error["type"] == "QuotaExceeded" and f"at most {BYTES} bytes" in error["message"]
    small = agent.post({"type": "message", "data": {"content": "ok"}})
    assert small.status_code == 200 and small.json() == {"added": 1}
    # the bytes add up over posts: the next that would pass the limit is refused too
    near = agent.post({"type": "message", "data": {"content": "y" * (BYTES - 30)}})
    assert near.status_code == 413, near.text
    assert [e.data["content"] for e in _agent_events(admin, agent.rollout.id)] == ["ok"]
    ended = admin.finish(agent.claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w-quota")
    assert ended.status == RolloutStatus.SUCCEEDED


def test_a_body_over_the_servers_limit_is_413_before_it_is_read(tmp_path, upstream):
    config = ServerConfig(db=str(tmp_path / "s.db"), tokens={ADMIN: Role.ADMIN}, max_body_bytes=10_000)
    with ServerThread(config) as srv, Client(srv.url, ADMIN) as admin:
        agent = _Agent(srv, admin, upstream)
        r = agent.post({"type": "message", "data": {"content": "x" * 20_000}})
        assert r.status_code == 413, r.text
        assert _agent_events(admin, agent.rollout.id) == []


def test_a_gateway_call_flood_is_429_after_the_limit(server, admin, upstream):
    agent = _Agent(server, admin, upstream)
    before = len(upstream.calls)
    answers = [agent.call(f"q{i}") for i in range(CALLS + 2)]
    assert [a.status_code for a in answers] == [200] * CALLS + [429, 429]
    refused = answers[-1]
    assert refused.json()["error"]["type"] == "QuotaExceeded"
    assert f"at most {CALLS} model calls" in refused.json()["error"]["message"]
    assert refused.headers["x-should-retry"] == "false"  # OpenAI's clients would retry a 429
    assert len(upstream.calls) - before == CALLS  # the refused calls never reached the model
    calls = [e for e in admin.all_events(agent.rollout.id) if e.type == "llm_call"]
    assert len(calls) == CALLS
    # the attempt goes on: its agent may still report, and it finishes
    assert agent.post({"reward": 0.5}).status_code == 200
    ended = admin.finish(agent.claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="w-quota")
    assert ended.status == RolloutStatus.SUCCEEDED


def test_the_runners_own_uploads_are_not_counted(server, admin, upstream):
    agent = _Agent(server, admin, upstream)
    from agentbolt.schemas import EventCreate

    many = [EventCreate(sequence=i, type="message", data={"i": i}) for i in range(EVENTS * 3)]
    assert admin.add_events(agent.claim.attempt.id, many, "w-quota") == EVENTS * 3
    assert agent.post([{"type": "message", "data": {"i": i}} for i in range(EVENTS)]).status_code == 200
    over = agent.post({"type": "message", "data": {}})
    assert over.status_code == 429, over.text
