"""Algorithms turn run records into better resources. Each talks to the store only.

``APO``, ``SFT`` and ``GRPO`` are imported on first use, so ``import agentbolt`` stays fast for
runners that only run agents. ``SFT`` and ``GRPO`` train weights: on an install without the
``train`` extra (``pip install agentbolt``) touching them raises one
:class:`~agentbolt.errors.MissingExtra` naming it, instead of torch's ``ModuleNotFoundError``;
the rest (``APO``, ``Evaluate``, the base classes) need no extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentbolt.algorithms.base import Algorithm, BatchResult, TrainContext, run_rollouts
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate
from agentbolt.extras import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes("agentbolt.algorithms", globals(), _LAZY)
