"""What a rollout's run amounts to: the reward of the agent's result, the outcome the runner
reports (succeeded, or failed with its reason), and which errors say the content sent was at
fault (so sending it again cannot help)."""

from __future__ import annotations

import math
from typing import Any

from agentbolt.errors import AgentboltError, LeaseLost, NotFound
from agentbolt.runner.agent import RolloutContext
from agentbolt.schemas import AttemptStatus, EventType, Trajectory

__all__ = ["clip", "content_at_fault", "judge", "record_failure", "reward_of"]

# Statuses with which the server refuses what was sent (bad data, a body over its limit):
# sending the same bytes again cannot succeed.
REFUSED = frozenset({400, 413, 422})
MAX_ERROR = 10_000
"""Characters of an error message sent with a finish (the server takes up to 100,000)."""


def reward_of(result: Any, ctx: RolloutContext) -> float | None:
    """The rollout's reward: a returned number, a Trajectory's total_reward, else the sum of
    the rollout-level rewards the agent emitted (None if it emitted none)."""
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, int | float):
        try:
            return float(result)
        except OverflowError:  # an int beyond any float: not finite, and said so by the caller
            return math.inf if result > 0 else -math.inf
    if isinstance(result, Trajectory) and result.total_reward is not None:
        return float(result.total_reward)
    return float(sum(ctx.rewards)) if ctx.rewards else None


def clip(text: str | None) -> str | None:
    return text if text is None or len(text) <= MAX_ERROR else text[: MAX_ERROR - 1] + "…"


def content_at_fault(exc: BaseException) -> bool:
    """The request's content is at fault (not the attempt, not the transport): the server
    refused it, or it could not even be encoded (an event holding an object JSON cannot carry)."""
    if isinstance(exc, LeaseLost | NotFound):
        return False
    if isinstance(exc, AgentboltError):
        return getattr(exc, "status_code", None) in REFUSED
    return isinstance(exc, ValueError | TypeError)  # pydantic's serialization error is a ValueError


def judge(ctx: RolloutContext, result: Any) -> tuple[AttemptStatus, float | None, str | None]:
    """The outcome of an agent that returned ``result``: its reward, or a failure when that is
    not a finite number (decided here: the server would refuse it, and the attempt would then
    wait out its lease)."""
    reward = reward_of(result, ctx)
    if isinstance(result, Trajectory):
        ctx.emit("trajectory", result.model_dump(mode="json"))
    if reward is not None and not math.isfinite(reward):
        error = f"reward is not a finite number: {reward}"
        record_failure(ctx, "InvalidReward", error)
        return AttemptStatus.FAILED, None, error
    if reward is not None:
        ctx.emit(EventType.REWARD, {"value": reward, "final": True})
    return AttemptStatus.SUCCEEDED, reward, None


def record_failure(ctx: RolloutContext, kind: str, message: str) -> None:
    """An ``exception`` event saying why the runner failed the attempt (not the agent's raise)."""
    ctx.emit(EventType.EXCEPTION, {"type": kind, "message": clip(message), "traceback": ""})
