"""A multi-turn task: a chain of four operations, one calculator call per operation.

The environment gives the operations one at a time: "Start with 17. Add 25." - the model calls
the calculator (``CALC: 17 + 25``, one operation per call) - "RESULT: 42. Then multiply by 3." -
``CALC: 42 * 3`` - and so on, then "What is the final result?" - ``ANSWER: <number>``. Each
call must carry the last ``RESULT`` into the next operation: four tool turns with the
environment's answer between them, then the answer; an episode ends after ``len(ops) + 2``
model turns at most.

Rewards:

- each turn whose call is exactly the next step of the chain (the value reached so far, the
  next operation) earns a step reward of 0.1 from the environment, recorded on that call;
- the outcome (the rollout's reward) is 1.0 when every step was computed with the tool, in
  order, and the final reply is exactly ``ANSWER: <the result>``; else 0. Every reply must be
  exactly one command line: any other reply ends the episode.

The state the model answers from is (steps done, the last value it was shown): two turns with
the same key face the same situation, whatever was said before.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from agentbolt.schemas import Task
from agentbolt.tasks.base import Episode, Split, ToolUse, Turn, make_split

__all__ = ["STEP_REWARD", "ChainEpisode", "make_tasks", "one_operation"]

STEP_REWARD = 0.1
OPERATIONS = 4
SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator tool that does one operation per call. "
    "Reply with exactly one line each turn: 'CALC: <number> <+, - or *> <number>' to use it, "
    "or 'ANSWER: <number>' once you have the final result."
)
WORKED_EPISODE = [
    {"role": "user", "content": "Start with 12. Add 30."},
    {"role": "assistant", "content": "CALC: 12 + 30"},
    {"role": "user", "content": "RESULT: 42. Then multiply by 2."},
    {"role": "assistant", "content": "CALC: 42 * 2"},
    {"role": "user", "content": "RESULT: 84. Then subtract 5."},
    {"role": "assistant", "content": "CALC: 84 - 5"},
    {"role": "user", "content": "RESULT: 79. What is the final result?"},
    {"role": "assistant", "content": "ANSWER: 79"},
]
_WORDS = {"+": "add {b}", "-": "subtract {b}", "*": "multiply by {b}"}
CALC = re.compile(r"CALC:\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")
LONG_CALC = re.compile(r"CALC:\s*[-+*\d\s()]+")
ONE_OPERATION = "one operation per call, like CALC: 12 + 30"
ANSWER = re.compile(r"ANSWER:\s*(-?\d+)\s*")


def one_operation(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _draw(rng: random.Random) -> tuple[str, dict[str, Any]]:
    start = rng.randint(10, 99)
    ops: list[tuple[str, int]] = []
    for _ in range(OPERATIONS):
        op = rng.choice("+-*")
        ops.append((op, rng.randint(2, 9) if op == "*" else rng.randint(10, 99)))
    value = start
    for op, b in ops:
        value = one_operation(value, op, b)
    signature = f"{start}|" + "|".join(f"{op}{b}" for op, b in ops)
    return signature, {"start": start, "ops": [list(o) for o in ops], "answer": value}


def make_tasks(n: int, seed: int, split: Split = "train") -> list[Task]:
    """``n`` distinct chains of :data:`OPERATIONS` operations in ``split`` (held-out ones never in
    training)."""
    return make_split(n, seed, split, _draw, "chain")


@dataclass
class ChainEpisode(Episode):
    done: int = 0
    """Steps of the chain computed so far, in order."""
    value: int = 0
    """The value the chain has reached."""
    shown: str = "start"
    """The last value the environment showed the model."""
    answered: int | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        self.value = int(self.data["start"])

    @property
    def max_turns(self) -> int:
        return len(self.data["ops"]) + 2

    def opening(self) -> str:
        return f"Start with {self.data['start']}. {self._instruction(0).capitalize()}"

    def _instruction(self, index: int) -> str:
        """What the environment asks next after ``index`` calls: the next operation, or the answer."""
        ops = self.data["ops"]
        if index >= len(ops):
            return "What is the final result?"
        op, b = ops[index]
        return _WORDS[op].format(b=b) + "."

    def state(self) -> str:
        """What the model faces: the steps done, the value last shown and the instruction it was
        given (the same value can come with different instructions, after a wrong call)."""
        return f"done={self.done} shown={self.shown} asked={self._instruction(self._calls())}"

    def _calls(self) -> int:
        """Calculator calls so far (refused ones included): the next instruction's index."""
        return sum(1 for r in self.replies if r.strip().startswith("CALC:"))

    def step(self, reply: str) -> Turn:
        self.replies.append(reply)
        line = reply.strip()
        if (answer := ANSWER.fullmatch(line)) is not None:
            self.answered = int(answer.group(1))
            return Turn(None)
        call = CALC.fullmatch(line)
        if call is None and LONG_CALC.fullmatch(line):  # a well-formed call the tool refuses
            return self._refused(reply)
        if call is None:
            self.strict = False
            return Turn(None)
        a, op, b = int(call.group(1)), call.group(2), int(call.group(3))
        use = ToolUse.run("calculator", f"{a} {op} {b}", lambda _: one_operation(a, op, b))
        self.shown = use.shown
        reward = 0.0
        ops = self.data["ops"]
        if self.done < len(ops) and (a, op, b) == (self.value, ops[self.done][0], ops[self.done][1]):
            self.value = one_operation(a, op, b)
            self.done += 1
            reward = STEP_REWARD
        return Turn(self._next(use.shown), step_reward=reward, tool=use)

    def _next(self, shown: str) -> str | None:
        """The result and the next instruction; None once the model has had its turns."""
        if len(self.replies) >= self.max_turns:
            return None
        calls = self._calls()
        nxt = self._instruction(calls)
        return f"RESULT: {shown}. {'Then ' + nxt if calls < len(self.data['ops']) else nxt}"

    def _refused(self, reply: str) -> Turn:
        self.shown = "refused"
        use = ToolUse("calculator", reply.strip()[5:].strip(), None, ONE_OPERATION, 0.0)
        return Turn(self._next(use.shown), tool=use)

    def outcome(self) -> float:
        ok = self.strict and self.done == len(self.data["ops"]) and self.answered == self.data["answer"]
        return 1.0 if ok else 0.0
