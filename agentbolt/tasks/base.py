"""What the built-in tasks share: a text environment played turn by turn by a model.

An episode: the environment opens with a question, the model replies, the environment reads
the reply and answers (a tool result, a hint) or ends the episode, and so on for at most
``max_turns`` model turns. Every model call goes through the gateway, so the agent knows each
call's id: the environment's step reward for a turn and the state the model answered from are
recorded against that call (:func:`~agentbolt.runner.agent.emit_reward` with ``call=`` and
:func:`~agentbolt.runner.agent.emit_state`); the outcome, 1 for a strict success and 0 otherwise,
is the rollout's own reward. GRPO's ``advantage="turn"`` and ``"gigpo"`` use the first two.

Held-out tasks are disjoint from the training pool by construction: :func:`split_of` puts every
problem in exactly one split from a hash of its content, so no amount of sampling can put a
held-out problem into training.
"""

from __future__ import annotations

import hashlib
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbolt.runner.agent import LitAgent, emit_reward, emit_state, emit_tool_call
from agentbolt.runner.llm import async_openai
from agentbolt.schemas import LLM, Task

__all__ = ["Episode", "Split", "TextGameAgent", "ToolUse", "Turn", "make_split", "split_of"]

Split = Literal["train", "heldout"]
HELDOUT_SHARE = 4
"""One problem in this many is held out."""


def split_of(signature: str) -> Split:
    """The split a problem belongs to, from its content alone (a stable hash, not Python's)."""
    digest = hashlib.sha256(signature.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_SHARE == 0 else "train"


def make_split(
    n: int, seed: int, split: Split, draw: Callable[[random.Random], tuple[str, dict[str, Any]]], prefix: str
) -> list[Task]:
    """``n`` distinct problems of ``split``: draws ``(signature, data)`` from ``seed`` and keeps
    those that hash into the split. Raises when the problem space runs out."""
    rng = random.Random(seed)
    tasks: list[Task] = []
    if n == 0:
        return tasks
    seen: set[str] = set()
    for _ in range(200 * n + 1000):
        signature, data = draw(rng)
        if signature in seen or split_of(signature) != split:
            continue
        seen.add(signature)
        tasks.append(
            Task(id=f"{prefix}-{split}-{hashlib.sha256(signature.encode()).hexdigest()[:12]}", data=data)
        )
        if len(tasks) == n:
            return tasks
    raise ValueError(f"only {len(tasks)} distinct {split} problems could be drawn, {n} asked")


@dataclass
class ToolUse:
    """One tool call the environment made for the model (recorded as a ``tool_call`` event)."""

    name: str
    expression: str
    result: Any
    error: str | None
    duration_ms: float

    @classmethod
    def run(cls, name: str, expression: str, tool: Callable[[str], Any]) -> ToolUse:
        t0 = time.perf_counter()
        try:
            result, error = tool(expression), None
        except ValueError as exc:
            result, error = None, str(exc)
        return cls(name, expression, result, error, (time.perf_counter() - t0) * 1000)

    @property
    def shown(self) -> str:
        """What the model reads back."""
        return f"error: {self.error}" if self.error is not None else str(self.result)


@dataclass
class Turn:
    """What the environment says after one model reply."""

    observation: str | None
    """The next user message; None ends the episode."""
    step_reward: float = 0.0
    """This turn's reward from the environment (0: none recorded)."""
    tool: ToolUse | None = None


@dataclass
class Episode(ABC):
    """One play of a task: the environment's state and the transcript."""

    data: dict[str, Any]
    replies: list[str] = field(default_factory=list)

    @property
    def max_turns(self) -> int:
        """Model turns at most; the agent stops asking after this many."""
        return 6

    @abstractmethod
    def opening(self) -> str:
        """The first user message."""

    @abstractmethod
    def state(self) -> str:
        """The environment's state now, as a key: equal keys mean the same situation for the
        model (step-level grouping compares turns by it)."""

    @abstractmethod
    def step(self, reply: str) -> Turn:
        """Read the model's reply; say what comes back."""

    @abstractmethod
    def outcome(self) -> float:
        """The episode's reward once it ended: 1.0 for a strict success, else 0."""


class TextGameAgent(LitAgent):
    """Plays an :class:`Episode` against the ``llm`` resource, one chat message per turn. The
    system prompt is the ``system_prompt`` resource; without one, ``system_prompt`` given here
    (``agentbolt train`` on a task spec publishes none)."""

    max_tokens = 24

    def __init__(
        self,
        episode: Callable[[dict[str, Any]], Episode],
        worked: list[dict[str, str]],
        system_prompt: str | None = None,
    ) -> None:
        super().__init__()
        self.episode = episode
        self.worked = worked
        self.system_prompt = system_prompt

    async def tool_latency(self, use: Any) -> float:
        """The tool call's duration in milliseconds; the game computes the answer at once. A
        subclass may wait here to stand in for a slow tool (``benchmarks/grpo_async.py``)."""
        return float(use.duration_ms)

    async def execute_rollout(self, task: Task) -> float:  # type: ignore[override]
        llm: LLM = self.get_resource("llm")
        published = self.rollout.resources
        own = self.system_prompt is not None and (
            published is None or "system_prompt" not in published.resources
        )
        prompt = self.system_prompt if own else self.get_resource("system_prompt")
        client = async_openai(llm, timeout=600)
        episode = self.episode(task.data)
        messages = [
            {"role": "system", "content": prompt},
            *self.worked,
            {"role": "user", "content": episode.opening()},
        ]
        for _turn in range(episode.max_turns):
            state = episode.state()
            response = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                max_tokens=self.max_tokens,
                **{"temperature": 1.0, **llm.sampling_parameters},
            )
            reply = (response.choices[0].message.content or "").strip()
            emit_state(state, call=response)
            turn = episode.step(reply)
            if turn.tool is not None:
                use = turn.tool
                duration_ms = await self.tool_latency(use)
                emit_tool_call(use.name, {"expression": use.expression}, use.result, use.error, duration_ms)
            if turn.step_reward:
                emit_reward(turn.step_reward, name="step", call=response)
            messages.append({"role": "assistant", "content": reply})
            if turn.observation is None:
                break
            messages.append({"role": "user", "content": turn.observation})
        return episode.outcome()
