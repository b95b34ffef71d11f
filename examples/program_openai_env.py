"""A calculator agent as a plain program: no agentbolt import, nothing but ``openai.OpenAI()``.

agentbolt trains it unmodified. The client reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from
the environment like any OpenAI client; under a runner those name this attempt's gateway and a
key valid for this attempt only, so every call is recorded with its token ids. The program
reads its task from the JSON file named by ``AGENTBOLT_TASK_FILE`` (or the question from its
arguments) and reports its reward by writing ``{"reward": x}`` to ``AGENTBOLT_RESULT_FILE``.

Train or evaluate it with a runner that starts it once per rollout:
``agentbolt runner --command 'python examples/program_openai_env.py'``

Or run it by hand against any OpenAI-compatible server:
``OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x OPENAI_MODEL=smollm2
python examples/program_openai_env.py "What is 6*7?"``
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
from typing import Any

import openai

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic, then state the result."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as 12*(3+4).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """+ - * / on numbers only; an error message for anything else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def read_task(argv: list[str]) -> dict[str, Any]:
    """The task from ``AGENTBOLT_TASK_FILE`` when set, else the question from the arguments."""
    path = os.environ.get("AGENTBOLT_TASK_FILE")
    task: dict[str, Any] = {}
    if path:
        with open(path, encoding="utf-8") as f:
            task = json.load(f)  # the task's fields: {"question": ..., "answer": ...}
    if argv:
        task["question"] = " ".join(argv)
    if not task.get("question"):
        sys.exit("no task: set AGENTBOLT_TASK_FILE or pass the question as arguments")
    return task


def solve(client: openai.OpenAI, model: str, question: str) -> tuple[str, int]:
    """The model's last answer, and how many calls it took."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    answer, calls = "", 0
    for _ in range(3):  # at most two tool rounds, then an answer
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=64, temperature=0.0
        )
        calls += 1
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments or "{}").get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(expression)})
    return answer, calls


def score(answer: str, gold: str | None) -> float:
    """1.0 when the gold number appears as a number in the answer."""
    if gold is None:
        return 0.0
    return 1.0 if re.search(rf"(?<![\d.]){re.escape(str(gold))}(?![\d])", answer) else 0.0


def main() -> None:
    task = read_task(sys.argv[1:])
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    answer, calls = solve(client, os.environ.get("OPENAI_MODEL", "gpt-4o-mini"), task["question"])
    reward = score(answer, task.get("answer"))
    print(json.dumps({"answer": answer, "reward": reward, "calls": calls}))
    result_file = os.environ.get("AGENTBOLT_RESULT_FILE")
    if result_file:
        with open(result_file, "w", encoding="utf-8") as f:
            json.dump({"reward": reward}, f)


if __name__ == "__main__":
    main()
