"""The calculator agent written with LangChain (``langchain-openai``). The only link to agentbolt
is where the chat model's ``base_url`` and ``api_key`` come from: the ``LLM`` resource, which
points at the per-attempt gateway while a runner runs the rollout.

Run: ``python examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 --model smollm2``
"""

from __future__ import annotations

import sys
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agentbolt import LLM, Task, rollout

sys.path.insert(0, str(Path(__file__).parent))  # the shared task, next to this file
from calculator_task import SYSTEM_PROMPT, main, score  # noqa: E402
from calculator_task import calculator as evaluate  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 12*(3+4)."""
    return evaluate(expression)


@rollout
def langchain_agent(task: Task, llm: LLM, system_prompt: str = SYSTEM_PROMPT) -> float:
    model = ChatOpenAI(
        model=llm.model, base_url=llm.base_url, api_key=llm.api_key or "none", **llm.sampling_parameters
    ).bind_tools([calculator])
    messages = [SystemMessage(system_prompt), HumanMessage(task.data["question"])]
    reply = model.invoke(messages)
    for _ in range(2):  # at most two tool rounds
        if not reply.tool_calls:
            break
        messages.append(reply)
        messages += [
            ToolMessage(calculator.invoke(call["args"]), tool_call_id=call["id"]) for call in reply.tool_calls
        ]
        reply = model.invoke(messages)
    return score(reply.text if isinstance(reply.content, list) else reply.content, task.data["answer"])


if __name__ == "__main__":
    main(langchain_agent)
