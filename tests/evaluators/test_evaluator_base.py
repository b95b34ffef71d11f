"""Evaluators as values: scoring functions, human review, names, fingerprints."""

from __future__ import annotations

import asyncio

import pytest

from agentbolt.errors import ConfigError
from agentbolt.evaluators import FunctionEvaluator, HumanReview, RolloutRecord
from agentbolt.schemas import RewardScale, RewardSource
from tests.evaluators.conftest import conversation_record


def _has_four(record: RolloutRecord) -> float:
    return 1.0 if record.output == "4" else 0.0


async def _async_length(record: RolloutRecord) -> float:
    await asyncio.sleep(0)
    return float(len(record.output or ""))


async def test_a_scoring_function_plain_or_async_scores_each_record_in_order() -> None:
    records = [conversation_record(0, answer="4"), conversation_record(0, answer="5")]
    plain = await FunctionEvaluator(_has_four, name="correct").judge(records)
    assert [j.score for j in plain] == [1.0, 0.0] and all(j.error is None for j in plain)
    lengths = FunctionEvaluator(_async_length, name="length", scale=RewardScale(low=0, high=10))
    assert [j.score for j in await lengths.judge(records)] == [1.0, 1.0]


async def test_a_failing_or_off_scale_function_gives_an_error_judgement_not_an_exception() -> None:
    def boom(record: RolloutRecord) -> float:
        raise RuntimeError("no gold answer")

    [failed] = await FunctionEvaluator(boom).judge([conversation_record(0)])
    assert failed.score is None and failed.error is not None
    assert "RuntimeError: no gold answer" in failed.error and "boom" in failed.error
    [off] = await FunctionEvaluator(lambda r: 7.0).judge([conversation_record(0)])
    assert off.score is None and off.error is not None and "outside the scale 0 to 1" in off.error


def test_awaited_slots_name_their_source_and_scale() -> None:
    judge = FunctionEvaluator(_has_four, name="correct")
    assert judge.automatic and not judge.group
    assert judge.awaited().source == RewardSource.EVALUATOR and judge.awaited().scale == RewardScale()
    human = HumanReview()
    assert not human.automatic
    awaited = human.awaited()
    assert (awaited.name, awaited.source) == ("human", RewardSource.REVIEWER)
    assert (awaited.scale.low, awaited.scale.high, awaited.scale.step) == (1, 5, 1)


async def test_human_review_is_never_run_by_code() -> None:
    with pytest.raises(TypeError, match="given by people"):
        await HumanReview().judge([conversation_record(0)])


@pytest.mark.parametrize("name", ["agent", "", "has space", "x" * 65])
def test_a_bad_reward_name_is_refused_when_the_evaluator_is_made(name: str) -> None:
    with pytest.raises(ConfigError, match="name"):
        FunctionEvaluator(_has_four, name=name)
    with pytest.raises(ConfigError, match="name"):
        HumanReview(name=name)


def test_the_fingerprint_follows_the_configuration() -> None:
    a = FunctionEvaluator(_has_four, name="correct")
    assert a.fingerprint() == FunctionEvaluator(_has_four, name="correct").fingerprint()
    assert a.fingerprint() != FunctionEvaluator(_has_four, name="other").fingerprint()
    assert a.fingerprint() != FunctionEvaluator(_async_length, name="correct").fingerprint()
    assert HumanReview(instructions="a").fingerprint() != HumanReview(instructions="b").fingerprint()
