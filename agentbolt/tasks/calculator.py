"""The quick task (``agentbolt demo``'s default): one calculator call, then the answer.

The model is asked a two-digit arithmetic question. It must call the calculator with exactly the
question's expression (``CALC: <expression>``), read the ``RESULT`` and answer ``ANSWER: <number>``.
SmolLM2-135M cannot do two-digit arithmetic itself, so success depends on using the tool. One
worked episode in the prompt (chat turns) makes the untrained model succeed sometimes: RL needs
that spread to learn anything.

Reward, strict: 1.0 when the first reply is exactly the call (one line, the question's
expression; spacing free) and the second exactly ``ANSWER: <the right number>``; 0.2 when the
call was exactly right but the answer was not; else 0. A right number without the tool call,
or with extra text around either line, scores 0.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from agentbolt.schemas import Task
from agentbolt.tasks.base import Episode, Split, ToolUse, Turn, make_split

__all__ = ["CalculatorEpisode", "calculator", "make_tasks", "score"]

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator tool. To use it, reply with one line "
    "'CALC: <expression>'. After the RESULT comes back, reply with one line 'ANSWER: <number>'."
)
WORKED_EPISODE = [
    {"role": "user", "content": "What is 23 * 41?"},
    {"role": "assistant", "content": "CALC: 23 * 41"},
    {"role": "user", "content": "RESULT: 943"},
    {"role": "assistant", "content": "ANSWER: 943"},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
CALC = re.compile(r"CALC:\s*([0-9+\-*\s()]+?)\s*")
ANSWER = re.compile(r"ANSWER:\s*(-?\d+)\s*")


def calculator(expression: str) -> int:
    """Evaluate + - * over integers (no names, no calls); raises ValueError otherwise."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > 64:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc


def _draw(rng: random.Random) -> tuple[str, dict[str, Any]]:
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
    expr = f"{a} {op} {b}"
    return expr, {"question": f"What is {expr}?", "expression": expr, "answer": calculator(expr)}


def make_tasks(n: int, seed: int, split: Split = "train") -> list[Task]:
    """``n`` distinct two-digit questions of ``split`` (held-out ones never occur in training)."""
    return make_split(n, seed, split, _draw, "calc")


def _norm(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def score(task_data: dict[str, Any], replies: list[str]) -> float:
    """The reward for one episode from the model's replies in order (see the module doc)."""
    call = CALC.fullmatch(replies[0].strip()) if replies else None
    if call is None or _norm(call.group(1)) != _norm(task_data["expression"]):
        return 0.0
    answer = ANSWER.fullmatch(replies[1].strip()) if len(replies) == 2 else None
    return 1.0 if answer is not None and int(answer.group(1)) == task_data["answer"] else 0.2


@dataclass
class CalculatorEpisode(Episode):
    """The environment: runs the first reply's call, then ends after the second reply."""

    @property
    def max_turns(self) -> int:
        return 2

    def opening(self) -> str:
        return str(self.data["question"])

    def state(self) -> str:
        return f"turn{len(self.replies)}"

    def step(self, reply: str) -> Turn:
        self.replies.append(reply)
        call = CALC.fullmatch(reply.strip())
        if len(self.replies) > 1 or call is None:
            return Turn(None)
        use = ToolUse.run("calculator", call.group(1), calculator)
        return Turn(f"RESULT: {use.shown}", tool=use)

    def outcome(self) -> float:
        return score(self.data, self.replies)
