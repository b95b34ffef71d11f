"""Algorithms turn run records into better resources. Each talks to the store only.

``APO``, ``SFT`` and ``GRPO`` are imported on first use, so ``import agentbolt`` stays fast for
runners that only run agents. ``SFT`` and ``GRPO`` train weights: on an install without the
``train`` extra (``pip install agentbolt``) touching them raises one
:class:`~agentbolt.errors.MissingExtra` naming it, instead of torch's ``ModuleNotFoundError``;
the rest (``APO``, ``Evaluate``, the base classes) need no extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentbolt.algorithms.base import Algorithm, BatchResult, TrainContext, run_rollouts
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate
from agentbolt.extras import needs_extra

if TYPE_CHECKING:
    from agentbolt.algorithms.apo import APO
    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.algorithms.sft import SFT

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

# name -> (module, the extras it needs): imported on first use
_LAZY: dict[str, tuple[str, tuple[str, ...]]] = {
    "APO": ("agentbolt.algorithms.apo", ()),
    "SFT": ("agentbolt.algorithms.sft", ("train",)),
    "GRPO": ("agentbolt.algorithms.grpo", ("train",)),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'agentbolt.algorithms' has no attribute {name!r}")
    module, extras = _LAZY[name]
    with needs_extra(name, *extras):
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
