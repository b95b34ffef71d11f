"""Evaluators: rewards for finished rollouts from outside the agent — a scoring function, a
model judge (pointwise or group-relative), or a person. See ``docs/evaluators.md``."""

from agentbolt.evaluators.base import Evaluator, FunctionEvaluator, HumanReview, Judgement
from agentbolt.evaluators.judge import GroupJudge, JudgeBudget, JudgeModel, PointwiseJudge
from agentbolt.evaluators.record import CallRecord, RolloutRecord, record_of, transcript
from agentbolt.evaluators.run import EvaluationReport, evaluate_rollouts

__all__ = [
    "CallRecord",
    "EvaluationReport",
    "Evaluator",
    "FunctionEvaluator",
    "GroupJudge",
    "HumanReview",
    "JudgeBudget",
    "JudgeModel",
    "Judgement",
    "PointwiseJudge",
    "RolloutRecord",
    "evaluate_rollouts",
    "record_of",
    "transcript",
]
