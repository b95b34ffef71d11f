"""The task the integration examples share: arithmetic questions, a calculator tool, a reward.

Each example (``openai_agent.py``, ``langchain_agent.py``, ``openai_agents_sdk_agent.py``,
``autogen_agent.py``) is the same agent written with a different framework; only this file's
definitions are common. ``main(agent)`` evaluates an agent against any OpenAI-compatible server.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from agentbolt import LLM

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic, then state the result."
TASKS = [
    {"id": "add", "question": "What is 12+30?", "answer": "42"},
    {"id": "mul", "question": "What is 6*7?", "answer": "42"},
    {"id": "sub", "question": "What is 100-58?", "answer": "42"},
]
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
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers (no names, no calls); an error message otherwise."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    match = re.search(r"[-+*/().\d\s]*\d[-+*/().\d\s]*", expression)
    try:
        value = ev(ast.parse((match.group(0) if match else expression).strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value) if float(value).is_integer() else round(value, 6))


def score(answer: str | None, gold: str) -> float:
    """1.0 when the gold number appears as a number in the answer."""
    return 1.0 if answer and re.search(rf"(?<![\d.]){re.escape(gold)}(?![\d])", answer) else 0.0


def parse_arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def main(agent: Any) -> None:
    import argparse

    from agentbolt import Evaluate, PromptTemplate, Trainer

    parser = argparse.ArgumentParser(description="evaluate an example agent")
    parser.add_argument(
        "--base-url", required=True, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None, help="kept by the server, never shown to the agent")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        sampling_parameters={"max_tokens": args.max_tokens, "temperature": 0.7},
    )
    summary = Trainer(
        algorithm=Evaluate(),
        n_runners=1,
        resources={"llm": llm, "system_prompt": PromptTemplate(template=SYSTEM_PROMPT)},
    ).fit(agent, val_tasks=TASKS)
    print(f"{summary.succeeded}/{summary.count} rollouts succeeded, mean reward {summary.mean_reward}")
