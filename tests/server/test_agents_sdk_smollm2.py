"""The OpenAI Agents SDK example with its default model (the Responses API) end to end against the
bundled SmolLM2: a runner, the server's per-attempt gateway translating to chat completions, and
the embedded engine. Every model call is recorded as a responses call with the exact token ids
the engine gives for the chat request it became."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.engine import EngineServer
from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import LLM, PromptTemplate, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread
from tests.conftest import serve_smollm2

pytestmark = pytest.mark.model

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def smollm2() -> Iterator[EngineServer]:
    # replies end at the engine's own limit, kept short for a CPU run: a Response cut at a
    # max_output_tokens the agent set would be incomplete, which the SDK raises on
    with serve_smollm2(dtype="float32", max_batch=4, default_max_tokens=48) as served:
        yield served


def test_agents_sdk_example_default_model_against_smollm2(tmp_path, smollm2):
    sys.path.insert(0, str(EXAMPLES))
    from calculator_task import SYSTEM_PROMPT, TASKS

    agent = load_agent(f"{EXAMPLES / 'openai_agents_sdk_agent.py'}:openai_agents_sdk_agent")
    with ServerThread(ServerConfig(db=str(tmp_path / "s.db"))) as server, Client(server.url) as client:
        client.publish_resources(
            {
                "llm": LLM(
                    base_url=smollm2.base_url, model="smollm2", sampling_parameters={"temperature": 0.0}
                ),
                "system_prompt": PromptTemplate(template=SYSTEM_PROMPT),
            }
        )
        [rollout] = client.enqueue([RolloutCreate(task=Task(id=TASKS[0]["id"], data=TASKS[0]))])
        asyncio.run(asyncio.wait_for(Runner(agent, server.url, max_rollouts=1).run(), 300))
        [done] = client.wait([rollout.id], 10).rollouts
        assert done.status == RolloutStatus.SUCCEEDED, done.error
        calls = [e.data for e in client.all_events(rollout.id) if e.type == "llm_call"]
    assert calls and all(c["endpoint"] == "responses" and c["error"] is None for c in calls)
    for call in calls:
        body = {**call["chat_request"], "return_token_ids": True}
        truth = httpx.post(f"{smollm2.base_url}/chat/completions", json=body, timeout=120).json()
        assert call["token_ids"] is True and call["prompt_token_ids"] == truth["prompt_token_ids"]
        assert call["choices"][0]["token_ids"] == truth["choices"][0]["token_ids"]
        assert len(call["choices"][0]["token_ids"]) > 0
