"""Algorithms turn run records into better resources. Each talks to the store only.

``APO``, ``SFT`` and ``GRPO`` are imported on first use (they pull in torch or the optimizer
client), so ``import agentbolt`` stays fast for runners that only run agents.
"""

from __future__ import annotations

import importlib
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

_LAZY = {
    "APO": "agentbolt.algorithms.apo",
    "SFT": "agentbolt.algorithms.sft",
    "GRPO": "agentbolt.algorithms.grpo",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentbolt.algorithms' has no attribute {name!r}")
