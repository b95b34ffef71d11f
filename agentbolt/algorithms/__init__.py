"""Algorithms turn run records into better resources. Each talks to the store only."""

from agentbolt.algorithms.base import Algorithm, BatchResult, TrainContext, run_rollouts
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate

__all__ = ["Algorithm", "BatchResult", "EvalSummary", "Evaluate", "TrainContext", "run_rollouts"]
