"""A calculator agent on the plain ``openai`` client, trained by agentbolt with no agentbolt code
in its LLM calls: the client's ``base_url`` and ``api_key`` come from the ``LLM`` resource,
which points at the per-attempt gateway while a runner runs the rollout. Every call (prompt and
completion token ids, logprobs) is recorded by the gateway.

Run against any OpenAI-compatible server (vLLM, the embedded engine, ...):
``python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1 --model smollm2``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai

from agentbolt import LLM, Task, emit_tool_call, rollout

sys.path.insert(0, str(Path(__file__).parent))  # the shared task, next to this file
from calculator_task import SYSTEM_PROMPT, TOOLS, calculator, main, parse_arguments, score  # noqa: E402


@rollout
def openai_agent(task: Task, llm: LLM, system_prompt: str = SYSTEM_PROMPT) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=2)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": task.data["question"]},
    ]
    answer = None
    for _ in range(3):  # at most two tool rounds, then an answer
        reply = client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, **llm.sampling_parameters
        )
        message = reply.choices[0].message
        answer = message.content
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            arguments = parse_arguments(call.function.arguments)
            result = calculator(str(arguments.get("expression", "")))
            emit_tool_call("calculator", arguments, result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    client.close()
    return score(answer, task.data["answer"])


if __name__ == "__main__":
    main(openai_agent)
