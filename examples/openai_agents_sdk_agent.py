"""The calculator agent written with the OpenAI Agents SDK and a function tool. The SDK talks to
the ``LLM`` resource's endpoint (the per-attempt gateway inside a rollout) with its default
model, which speaks the Responses API (the gateway serves it, also for model servers that only
speak chat completions); its own trace export to openai.com is switched off.

Run: ``python examples/openai_agents_sdk_agent.py --base-url http://127.0.0.1:8000/v1 --model smollm2``
"""

from __future__ import annotations

import sys
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from agentbolt import LLM, Task, rollout

sys.path.insert(0, str(Path(__file__).parent))  # the shared task, next to this file
from calculator_task import SYSTEM_PROMPT, main, score  # noqa: E402
from calculator_task import calculator as evaluate  # noqa: E402

set_tracing_disabled(True)  # the SDK would otherwise upload its traces to openai.com


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12*(3+4)."""
    return evaluate(expression)


@rollout
async def openai_agents_sdk_agent(task: Task, llm: LLM, system_prompt: str = SYSTEM_PROMPT) -> float:
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none")
    agent = Agent(
        name="calculator",
        instructions=system_prompt,
        tools=[calculator],
        model=llm.model,
        model_settings=ModelSettings(**llm.sampling_parameters),
    )
    # the SDK's default provider and model, pointed at this rollout's endpoint
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    try:
        result = await Runner.run(agent, task.data["question"], max_turns=4, run_config=config)
    finally:
        await client.close()
    return score(str(result.final_output), task.data["answer"])


if __name__ == "__main__":
    main(openai_agents_sdk_agent)
