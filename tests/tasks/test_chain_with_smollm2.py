"""The multi-turn task with the bundled SmolLM2, through a real runner, server and gateway: the
agent learns each call's id from the gateway and records the environment's state and step
reward against it, so the adapters see one turn per call with its own reward and state."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentbolt.adapters import latest_attempt, to_trajectories
from agentbolt.client import Client
from agentbolt.engine import EngineServer
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, EventType, PromptTemplate, RolloutCreate, RolloutStatus
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.tasks import TASKS
from agentbolt.tasks.chain import STEP_REWARD, ChainEpisode
from tests.conftest import serve_smollm2

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm2() -> Iterator[EngineServer]:
    with serve_smollm2(dtype="float32", max_batch=8) as served:
        yield served


def test_chain_episodes_record_a_turn_per_call_with_its_state_and_step_reward(
    tmp_path, smollm2: EngineServer
) -> None:
    task = TASKS["chain"]
    tasks = task.heldout_tasks(8, seed=5)
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server, Client(server.url) as client:
        client.publish_resources(
            {
                "llm": LLM(
                    base_url=smollm2.base_url, model="smollm2", sampling_parameters={"temperature": 0}
                ),
                "system_prompt": PromptTemplate(template=task.system_prompt, engine="plain"),
            }
        )
        rollouts = client.enqueue([RolloutCreate(task=t) for t in tasks])
        runner = Runner(task.agent(), server.url, max_rollouts=len(tasks), concurrency=8, flush_interval=0.1)
        asyncio.run(asyncio.wait_for(runner.run(), 300))
        done = client.wait([r.id for r in rollouts], 30).rollouts
        events = client.events_of([r.id for r in done])
    assert all(r.status == RolloutStatus.SUCCEEDED for r in done)
    turns_seen = 0
    for rollout in done:
        evs = latest_attempt(events[rollout.id])
        calls = [e for e in evs if e.type == EventType.LLM_CALL]
        states = [e for e in evs if e.type == EventType.STATE]
        steps = [e for e in evs if e.type == EventType.REWARD and e.data.get("llm_call_id") is not None]
        # one state per call, naming that call; step rewards name calls of this attempt
        assert sorted(e.data["llm_call_id"] for e in states) == sorted(e.id for e in calls)
        assert {e.data["llm_call_id"] for e in steps} <= {e.id for e in calls}
        assert all(e.data["value"] == STEP_REWARD for e in steps)
        opening = ChainEpisode(dict(rollout.task.data)).state()
        assert states[0].data["key"] == opening and opening.startswith("done=0 shown=start asked=")
        rows, _ = to_trajectories(evs, reward=rollout.reward)
        spans = [span for row in rows for span in row.calls]
        assert [s.state for s in spans] == [
            e.data["key"] for e in sorted(states, key=lambda e: e.data["llm_call_id"])
        ]
        assert sum(s.step_reward or 0.0 for s in spans) == pytest.approx(STEP_REWARD * len(steps))
        # a strict success computed every step with the tool: a step reward per operation
        if rollout.reward == 1.0:
            assert len(steps) == len(rollout.task.data["ops"])
        turns_seen = max(turns_seen, len(calls))
    # SmolLM2 greedy plays several turns on these (the task measured 36% greedy success)
    assert turns_seen >= 3
