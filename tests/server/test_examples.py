"""Each integration example end to end: server, runner and gateway on 127.0.0.1, the upstream
test double as the model server. The agents only read their base URL from the LLM resource."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import LLM, PromptTemplate, RolloutCreate, RolloutStatus, Task

EXAMPLES = Path(__file__).parents[2] / "examples"
NAMES = ["openai_agent", "langchain_agent", "openai_agents_sdk_agent", "autogen_agent"]
SECRET = "sk-example-upstream-secret"


def _truth(upstream, request: dict) -> dict:
    """The double's answer to a recorded request, asked directly with every extra."""
    body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    body |= {"return_token_ids": True, "logprobs": True}
    return httpx.post(f"{upstream.base_url}/chat/completions", json=body, timeout=10).json()


@pytest.mark.parametrize("name", NAMES)
def test_example_end_to_end(name, rig, upstream):
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from calculator_task import SYSTEM_PROMPT, TASKS

    agent = load_agent(f"{EXAMPLES / name}.py:{name}")
    rig.client.publish_resources(
        {
            "llm": LLM(base_url=upstream.base_url, model="double", api_key=SECRET),
            "system_prompt": PromptTemplate(template=SYSTEM_PROMPT),
        }
    )
    rollouts = rig.client.enqueue([RolloutCreate(task=Task(id=t["id"], data=t)) for t in TASKS])
    runner = Runner(agent, rig.server.url, concurrency=2, max_rollouts=len(TASKS), flush_interval=0.1)
    asyncio.run(asyncio.wait_for(runner.run(), 120))
    done = rig.client.wait([r.id for r in rollouts], 10)
    through_gateway = list(upstream.calls)
    assert done.done and [r.status for r in done.rollouts] == [RolloutStatus.SUCCEEDED] * len(TASKS), [
        r.error for r in done.rollouts
    ]
    assert [r.reward for r in done.rollouts] == [1.0] * len(TASKS)  # the tool was called and used
    for rollout, task in zip(done.rollouts, TASKS, strict=True):
        events = rig.client.all_events(rollout.id)
        calls = [e.data for e in events if e.type == "llm_call"]
        assert len(calls) == 2, [c["request"] for c in calls]  # a tool call, then the answer
        first, second = calls
        # the Agents SDK's default model speaks the Responses API; the gateway asked the chat model
        assert [c["endpoint"] for c in calls] == [
            "responses" if name == "openai_agents_sdk_agent" else "chat.completions"
        ] * 2
        asked = [c.get("chat_request") or c["request"] for c in calls]
        assert [c["stream"] for c in calls] == [name == "autogen_agent"] * 2  # AutoGen's client streams
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        [tool_call] = first["choices"][0]["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "calculator"
        assert task["question"] in json.dumps(asked[0]["messages"])
        tool_results = [m for m in asked[1]["messages"] if m.get("role") == "tool"]
        assert [m["tool_call_id"] for m in tool_results] == [tool_call["id"]]
        assert "42" in json.dumps(tool_results[0]["content"])
        for call, request in zip(calls, asked, strict=True):  # recorded exactly: the upstream's ids
            truth = _truth(upstream, request)
            assert call["prompt_token_ids"] == truth["prompt_token_ids"]
            assert call["choices"][0]["token_ids"] == truth["choices"][0]["token_ids"]
            assert call["choices"][0]["logprobs"] == [
                t["logprob"] for t in truth["choices"][0]["logprobs"]["content"]
            ]
            assert call["error"] is None and call["model"] == "double"
        assert SECRET not in json.dumps([e.data for e in events])
    assert len(through_gateway) == 2 * len(TASKS)
    for seen in through_gateway:
        assert seen.headers["authorization"] == f"Bearer {SECRET}"
