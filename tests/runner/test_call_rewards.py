"""Per-call rewards and states from an in-process agent: the runner, a real server on 127.0.0.1,
the real openai client and the upstream double (tests/server/upstream_double.py). The agent
learns each call's id from the gateway's answer and rewards / labels that call."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from rich.console import Console

import agentbolt
from agentbolt import LLM, Runner, Task
from agentbolt.cli.render import render_rollout
from agentbolt.runner.agent import RolloutContext, call_id_of, emit_reward, emit_state
from agentbolt.schemas import Attempt, AttemptStatus, Rollout, RolloutCreate, RolloutStatus

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from upstream_double import UpstreamDouble  # noqa: E402


@pytest.fixture(scope="module")
def upstream():
    with UpstreamDouble() as double:
        yield double


def _run(runner: Runner, timeout: float = 30) -> None:
    asyncio.run(asyncio.wait_for(runner.run(), timeout))


@agentbolt.rollout
def two_turns(task: Task, llm: LLM) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    first = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "one"}])
    emit_state("room=1", call=first)
    chunks = list(
        client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": "two"}], stream=True
        )
    )
    emit_state("room=2", call=chunks[-1])
    emit_reward(0.25, name="step", call=first)  # a plain response object
    emit_reward(0.5, name="step", call=chunks[-1])  # the last chunk of a stream
    emit_reward(0.75, llm_call_id=call_id_of(first))  # the alias, by number
    return 1.0


def test_an_agent_rewards_and_labels_its_own_calls(server, client, upstream):
    client.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
    [rollout] = client.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
    _run(Runner(two_turns, server.url, max_rollouts=1))
    done = client.get_rollout(rollout.id)
    assert done.reward == 1.0  # per-call rewards do not count into the rollout's reward
    events = client.all_events(rollout.id)
    calls = [e for e in events if e.type == "llm_call"]
    assert len(calls) == 2 and calls[0].id < calls[1].id
    first, second = (c.id for c in calls)
    rewards = [(e.data["value"], e.data.get("llm_call_id")) for e in events if e.type == "reward"]
    assert rewards == [(0.25, first), (0.5, second), (0.75, first), (1.0, None)]  # the last: returned
    states = [e.data for e in events if e.type == "state"]
    assert states == [{"key": "room=1", "llm_call_id": first}, {"key": "room=2", "llm_call_id": second}]

    # what `agentbolt rollouts show` prints: turns numbered, rewards and states naming theirs
    console = Console(record=True, width=200, color_system=None)
    console.print(render_rollout(done, client.list_attempts(rollout.id), events))
    shown = console.export_text()
    assert f"llm_call #{first} turn 1 " in shown and f"llm_call #{second} turn 2 " in shown
    assert f"state room=2  (call #{second}, turn 2)" in shown
    assert f"reward 0.5  (name step, call #{second}, turn 2)" in shown


@pytest.fixture
def ctx():
    """A rollout context of its own (no server): what the emit functions record."""
    rollout = Rollout(
        id="r1",
        task=Task(id="t1", data={}),
        mode="train",
        status=RolloutStatus.RUNNING,
        resources_version=None,
        timeout_seconds=None,
        max_attempts=1,
        attempts=1,
        created_at=0,
        updated_at=0,
    )
    attempt = Attempt(
        id="a1",
        rollout_id="r1",
        number=1,
        worker_id="w",
        status=AttemptStatus.RUNNING,
        started_at=0,
        heartbeat_at=0,
        lease_expires_at=1,
    )
    context = RolloutContext(rollout, attempt, None)
    token = context.activate()
    try:
        yield context
    finally:
        token.var.reset(token)


def test_call_id_of_reads_every_shape():
    response = openai.types.chat.ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [],
            "agentbolt": {"call_id": 17},
        }
    )
    assert call_id_of(response) == 17
    assert call_id_of({"agentbolt": {"call_id": 3}}) == 3
    assert call_id_of(4) == 4 and call_id_of("42") == 42 and call_id_of(" 7 ") == 7
    assert call_id_of(SimpleNamespace(headers={"x-agentbolt-call-id": "9"})) == 9
    for nothing in (None, True, "abc", "", {}, {"agentbolt": {}}, {"agentbolt": {"call_id": "x"}}, object()):
        assert call_id_of(nothing) is None, nothing
    with pytest.raises(ValueError, match="non-negative"):
        call_id_of(-1)


def test_reward_and_state_validation(ctx):
    with pytest.raises(ValueError, match="did not come through the agentbolt gateway"):
        emit_reward(1.0, call={"choices": []})
    with pytest.raises(ValueError, match="give one"):
        emit_reward(1.0, call=3, llm_call_id=4)
    with pytest.raises(ValueError, match="not a call id"):
        emit_reward(1.0, llm_call_id="first")
    with pytest.raises(ValueError, match="non-empty string"):
        emit_state("", call=3)
    with pytest.raises(ValueError, match="at most 512"):
        emit_state("k" * 513, call=3)
    with pytest.raises(ValueError, match="needs the call"):
        emit_state("k", call=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty string"):
        agentbolt.emit_event("state", {"key": 5, "llm_call_id": 3})
    with pytest.raises(ValueError, match="needs the call"):
        agentbolt.emit_event("state", {"key": "k"})
    assert ctx.take_pending() == []  # nothing refused was recorded
    agentbolt.emit_event("state", {"key": "k", "llm_call_id": 3})
    assert [(e.type, e.data) for e in ctx.take_pending()] == [("state", {"key": "k", "llm_call_id": 3})]
    emit_reward(1.0, call=3, llm_call_id=3)  # both, naming the same call
    emit_reward(2.0)
    emit_state("k" * 512, call="5")
    recorded = [(e.type, e.data) for e in ctx.take_pending()]
    assert recorded == [
        ("reward", {"value": 1.0, "llm_call_id": 3}),
        ("reward", {"value": 2.0}),
        ("state", {"key": "k" * 512, "llm_call_id": 5}),
    ]
    assert ctx.rewards == [2.0]  # only the rollout-level reward counts for the rollout
