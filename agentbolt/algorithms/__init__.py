"""Algorithms turn run records into better resources. Each talks to the store only.

``APO``, ``SFT`` and ``GRPO`` are imported on first use (they pull in torch or the optimizer
client), so ``import agentbolt`` stays fast for runners that only run agents.
"""

from __future__ import annotations

from typing import Any

from agentbolt.algorithms.base import Algorithm, BatchResult, TrainContext, run_rollouts
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate

__all__ = [
    "APO",
    "GRPO",
    "SFT",
    "Algorithm",
    "BatchResult",
    "EvalSummary",
    "Evaluate",
    "TrainContext",
    "run_rollouts",
]


def __getattr__(name: str) -> Any:
    # imported here, on first use: each pulls in torch or the optimizer client
    if name == "APO":
        from agentbolt.algorithms.apo import APO

        return APO
    if name == "SFT":
        from agentbolt.algorithms.sft import SFT

        return SFT
    if name == "GRPO":
        from agentbolt.algorithms.grpo import GRPO

        return GRPO
    raise AttributeError(f"module 'agentbolt.algorithms' has no attribute {name!r}")
