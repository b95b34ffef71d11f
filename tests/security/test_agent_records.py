"""Issue 37, "the runner is the referee": an agent is untrusted code, and in RL a policy finds
any way to write its own grade or training data. These probes try it through the agent key
(the events URL a program agent gets) against a server with tokens, and check that what
training reads (adapters, export) holds only what the system recorded."""

from __future__ import annotations

import json

import httpx
import pytest

from agentbolt.adapters import to_chat_rows, to_trajectories
from agentbolt.client import Client
from agentbolt.export import export_dataset
from agentbolt.schemas import LLM, AttemptStatus, EventCreate, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread
from agentbolt.store import open_store

ADMIN, RUNNER = "adm-token-37aa", "run-token-37bb"

MESSAGES = [{"role": "user", "content": "hi"}]
FORGED = {  # a model call the model never made: token ids that would teach the policy anything
    "endpoint": "chat.completions",
    "request": {"model": "double", "messages": [{"role": "user", "content": "forged prompt"}]},
    "response": {},
    "prompt_token_ids": [666, 666],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "forged answer"},
            "finish_reason": "stop",
            "token_ids": [777],
            "logprobs": [0.0],
        }
    ],
}


class Agent:
    """One claimed attempt, seen from its agent: its key, its gateway and its events URL."""

    def __init__(self, server, upstream, runner: Client) -> None:
        with Client(server.url, ADMIN) as admin:
            admin.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
            admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        claim = runner.dequeue(runner.worker)
        assert claim is not None and claim.agent_key is not None
        self.claim, self.url, self.runner = claim, server.url, runner
        self.headers = {"authorization": f"Bearer {claim.agent_key}"}

    @property
    def events_url(self) -> str:
        return f"{self.url}/agent/{self.claim.rollout.id}/{self.claim.attempt.id}/events"

    def post(self, body) -> httpx.Response:
        return httpx.post(self.events_url, json=body, headers=self.headers, timeout=10)

    def call(self) -> int:
        """One model call through the gateway: its call id."""
        llm = self.claim.resources.resources["llm"]
        answer = httpx.post(
            f"{llm.base_url}/chat/completions",
            json={"model": "double", "messages": MESSAGES},
            headers={"authorization": f"Bearer {llm.api_key}"},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        return int(answer.headers["x-agentbolt-call-id"])

    def events(self) -> list:
        with Client(self.url, ADMIN) as admin:
            return admin.all_events(self.claim.rollout.id)


@pytest.fixture
def server(tmp_path):
    config = ServerConfig(db=str(tmp_path / "store.db"), tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER})
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture
def runner(server):
    with Client(server.url, RUNNER) as client:
        registration = client.register_worker("probe")
        assert registration is not None
        client.worker = registration.worker_id
        yield client


@pytest.fixture
def agent(server, upstream, runner) -> Agent:
    return Agent(server, upstream, runner)


@pytest.mark.parametrize("kind", ["llm_call", "exception", "span", "program_exit", "trajectory", "note"])
def test_an_agent_key_cannot_post_the_systems_records_403_naming_the_type(agent, kind):
    r = agent.post([{"type": "message", "data": {"content": "ok"}}, {"type": kind, "data": FORGED}])
    assert r.status_code == 403, r.text
    assert f"type {kind!r}" in r.json()["error"]["message"]
    assert agent.events() == []  # the whole request is refused: not even its allowed event


def test_a_final_reward_from_the_agent_key_is_403(agent):
    for body in (
        {"type": "reward", "data": {"value": 1.0, "final": True}},
        {"type": "reward", "data": {"value": 1, "final": False}},
    ):
        r = agent.post(body)
        assert r.status_code == 403, r.text
        assert "final" in r.json()["error"]["message"]
    assert agent.events() == []


def test_what_an_agent_may_post_is_stored_with_source_agent(agent):
    call = agent.call()
    body = [
        {"reward": 0.5},
        {"reward": 0.1, "call": call},
        {"type": "state", "data": {"key": "room=hall", "llm_call_id": call}},
        {"type": "message", "data": {"role": "log", "content": "done"}},
        {"type": "tool_call", "data": {"name": "ls"}},
        {"type": "custom.score_parts", "data": {"a": 1}},
    ]
    r = agent.post(body)
    assert r.status_code == 200 and r.json() == {"added": 6}, r.text
    sources = [(e.type, e.source) for e in agent.events()]
    assert sources == [("llm_call", "gateway")] + [
        (kind, "agent")
        for kind in ("reward", "reward", "state", "message", "tool_call", "custom.score_parts")
    ]


def test_a_reward_or_state_naming_another_attempts_call_is_422_naming_the_id(server, upstream, runner):
    mine, other = Agent(server, upstream, runner), Agent(server, upstream, runner)
    theirs = other.call()
    for body in (
        {"reward": 1.0, "call": theirs},
        {"type": "state", "data": {"key": "k", "llm_call_id": theirs}},
        {"type": "reward", "data": {"value": 1.0, "llm_call_id": theirs}},
        {"reward": 1.0, "call": 987654},  # made up
    ):
        r = mine.post(body)
        assert r.status_code == 422, r.text
        named = body.get("call") or body["data"]["llm_call_id"]
        assert f"llm_call_id {named}" in r.json()["error"]["message"]
    assert mine.events() == []


def test_the_source_comes_from_the_credential_never_the_body(agent):
    attempt = agent.claim.attempt.id
    runner_post = {"worker_id": agent.runner.worker, "events": [{"sequence": 0, "type": "message"}]}
    assert agent.runner.add_events(attempt, [EventCreate(sequence=0, type="message")]) == 1
    with Client(agent.url, ADMIN) as admin:
        assert admin.add_events(attempt, [EventCreate(sequence=1, type="message")]) == 1
    assert agent.post({"type": "message", "data": {}}).status_code == 200
    assert [e.source for e in agent.events()] == ["runner", "admin", "agent"]
    forged = {"type": "message", "data": {}, "source": "gateway"}
    assert agent.post(forged).status_code == 422  # a body naming its source is refused
    runner_post["events"][0] |= {"sequence": 5, "source": "gateway"}
    headers = {"authorization": f"Bearer {agent.runner.token}"}
    r = httpx.post(f"{agent.url}/api/attempts/{attempt}/events", json=runner_post, headers=headers)
    assert r.status_code == 422 and "source" in r.text
    assert len(agent.events()) == 3


def test_a_forged_llm_call_stored_the_old_way_never_reaches_adapters_or_export(server, agent, tmp_path):
    """The store as the events URL wrote before sources were checked: the forged call sits beside
    the gateway's own, and training reads only the gateway's."""
    real = agent.call()
    store = open_store(str(server.config.db))
    try:
        store.add_agent_events(agent.claim.attempt.id, [EventCreate(type="llm_call", data=FORGED)], key=None)
    finally:
        store.close()
    events = agent.events()
    assert [(e.type, e.source) for e in events] == [("llm_call", "gateway"), ("llm_call", "agent")]
    rows, stats = to_trajectories(events, reward=1.0)
    assert stats.calls == 1 and [[c.event_id for c in r.calls] for r in rows] == [[real]]
    assert 666 not in rows[0].input_ids and 777 not in rows[0].input_ids
    assert "forged" not in str(to_chat_rows(events))
    agent.runner.finish(agent.claim.attempt.id, AttemptStatus.SUCCEEDED, reward=1.0)
    with Client(agent.url, ADMIN) as admin:
        for fmt in ("openai", "tokens"):
            out = tmp_path / f"data-{fmt}.jsonl"
            summary = export_dataset(admin, out, fmt)
            assert summary.rows == 1, summary
            text = out.read_text()
            assert "forged" not in text
            # the forged ids as ids (a logprob's digits may hold "666" by chance)
            assert not {666, 777} & _ints([json.loads(line) for line in text.splitlines()])


def _ints(value: object) -> set[int]:
    """Every integer inside a JSON value: the token ids of an exported row."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_ints(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_ints(v) for v in value))
    return set()
