"""External tasks with the bundled SmolLM2, through a real runner, server and gateway: the task's
own agent (its own system prompt: none is published) plays a reasoning-gym dataset and a
Gymnasium environment, and what the server recorded replays to the same rewards, states and
step rewards through the dataset's scorer and the environment."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentbolt.adapters import latest_attempt
from agentbolt.client import Client
from agentbolt.engine import EngineServer
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, EventType, RolloutCreate, RolloutStatus
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.tasks import get_task
from tests.conftest import serve_smollm2

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2() -> Iterator[EngineServer]:
    with serve_smollm2(dtype="float32", max_batch=8) as served:
        yield served


def _play(tmp_path, smollm2: EngineServer, spec: str, n: int) -> tuple[list, dict]:
    task = get_task(spec)
    tasks = task.heldout_tasks(n, seed=3)
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server, Client(server.url) as client:
        llm = LLM(base_url=smollm2.base_url, model="smollm2", sampling_parameters={"temperature": 0})
        client.publish_resources({"llm": llm})
        rollouts = client.enqueue([RolloutCreate(task=t) for t in tasks])
        runner = Runner(task.agent(), server.url, max_rollouts=n, concurrency=n, flush_interval=0.1)
        asyncio.run(asyncio.wait_for(runner.run(), 300))
        done = client.wait([r.id for r in rollouts], 30).rollouts
        events = {rid: latest_attempt(evs) for rid, evs in client.events_of([r.id for r in done]).items()}
    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * n
    for rollout in done:
        calls = [e for e in events[rollout.id] if e.type == EventType.LLM_CALL]
        assert calls and calls[0].data["request"]["messages"][0]["content"] == task.system_prompt
    return done, events


def _replies(events: list) -> list[str]:
    calls = [e for e in events if e.type == EventType.LLM_CALL]  # in the order recorded: turn by turn
    return [(c.data["response"]["choices"][0]["message"]["content"] or "").strip() for c in calls]


def test_a_reasoning_gym_rollout_is_rewarded_by_the_datasets_scorer(tmp_path, smollm2: EngineServer) -> None:
    from agentbolt.tasks.reasoning_gym import extract_answer, score

    done, events = _play(tmp_path, smollm2, "reasoning_gym:spell_backward?max_word_len=4", 4)
    for rollout in done:
        [reply] = _replies(events[rollout.id])
        assert rollout.reward == score(dict(rollout.task.data), extract_answer(reply))


def test_a_gymnasium_rollout_replays_to_the_same_states_and_step_rewards(
    tmp_path, smollm2: EngineServer
) -> None:
    spec = "gymnasium:FrozenLake-v1?p=0.9"
    done, events = _play(tmp_path, smollm2, spec, 4)
    longest = 0
    for rollout in done:
        evs = events[rollout.id]
        replies = _replies(evs)
        states = [e.data["key"] for e in evs if e.type == EventType.STATE]
        steps = [e.data["value"] for e in evs if e.type == EventType.REWARD and e.data.get("llm_call_id")]
        episode = get_task(spec).episode(dict(rollout.task.data))
        seen, rewards = [], []
        for reply in replies:
            seen.append(episode.state())
            turn = episode.step(reply)
            rewards += [turn.step_reward] if turn.step_reward else []
        assert states == seen and steps == rewards and rollout.reward == episode.outcome()
        longest = max(longest, len(replies))
    assert longest >= 2  # greedy SmolLM2 walks several steps on these maps (34% greedy success measured)
