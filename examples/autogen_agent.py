"""The calculator agent written with AutoGen (``autogen-agentchat``): an ``AssistantAgent`` with a
calculator tool, its model client pointed at the ``LLM`` resource (the per-attempt gateway inside
a rollout). The model client streams, so the gateway's streaming path is exercised too.

Run: ``python examples/autogen_agent.py --base-url http://127.0.0.1:8000/v1 --model smollm2``
"""

from __future__ import annotations

import sys
from pathlib import Path

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agentbolt import LLM, Task, rollout

sys.path.insert(0, str(Path(__file__).parent))  # the shared task, next to this file
from calculator_task import SYSTEM_PROMPT, main, score  # noqa: E402
from calculator_task import calculator as evaluate  # noqa: E402

# AutoGen must be told what an unknown model can do.
MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12*(3+4)."""
    return evaluate(expression)


@rollout
async def autogen_agent(task: Task, llm: LLM, system_prompt: str = SYSTEM_PROMPT) -> float:
    client = OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key or "none",
        model_info=MODEL_INFO,
        **llm.sampling_parameters,
    )
    agent = AssistantAgent(
        "calculator",
        model_client=client,
        tools=[calculator],
        system_message=system_prompt,
        reflect_on_tool_use=True,
        model_client_stream=True,
    )
    try:
        result = await agent.run(task=task.data["question"])
    finally:
        await client.close()
    final = result.messages[-1]
    return score(final.to_text(), task.data["answer"])


if __name__ == "__main__":
    main(autogen_agent)
