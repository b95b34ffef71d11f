"""The bundled SmolLM2-135M as a judge, through the real engine server, the real agentbolt
server and store: the mechanism only (calls made, recorded and written), not how well a 135M
model judges — ``benchmarks/judge_agreement.py`` measures that. Three model calls in all."""

from __future__ import annotations

import pytest

from agentbolt.client import Client
from agentbolt.evaluators import GroupJudge, JudgeModel, PointwiseJudge, evaluate_rollouts
from agentbolt.schemas import RewardState
from tests.conftest import serve_smollm2
from tests.evaluators.conftest import ADMIN, EVALUATOR, run_rollouts

pytestmark = pytest.mark.model

RUBRIC = "The question is 2+2. A good run answers 4. Score 1 for the answer 4, 0 for any other answer."


def test_smollm2_judges_pointwise_and_as_a_group_and_every_call_is_recorded(served) -> None:
    with serve_smollm2() as smollm2:
        model = JudgeModel(smollm2.base_url, "smollm2", max_tokens=24, timeout=120)
        pointwise = PointwiseJudge(RUBRIC, model, retries=0)
        group = GroupJudge(RUBRIC, model, retries=0)
        with Client(served.url, ADMIN) as admin, Client(served.url, EVALUATOR) as client:
            done = run_rollouts(admin, ["4", "5"], [pointwise.awaited(), group.awaited()], group_id="g")
            report = evaluate_rollouts(client, done, [pointwise, group], concurrency=2)
            stored = [admin.get_rollout(r.id) for r in done]
    assert report.calls == 3 and report.cached == 0 and report.tokens > 0
    assert report.scored + report.errors == 4 and report.conflicts == 0
    for rollout in stored:
        for name in ("judge", "group_judge"):
            slot = rollout.rewards[name]
            assert slot.state in (RewardState.SCORED, RewardState.ERROR), slot
            if slot.state == RewardState.SCORED:
                assert slot.score is not None and 0.0 <= slot.score <= 1.0
            else:  # a tiny model often misses the strict format: said, never scored as 0
                assert slot.value is None and (slot.error or "").startswith("malformed judge answer:")
            [call] = slot.data["calls"]
            assert isinstance(call["answer"], str) and call["usage"]["prompt_tokens"] > 0
            assert call["latency_s"] > 0 and call["cached"] is False
            assert call["request"][-1]["content"].startswith("RUBRIC:\n" + RUBRIC)
            assert slot.data["judge"] == {
                "model": "smollm2",
                "base_url": smollm2.base_url,
                "via_server": False,
            }
    # the group's one call is recorded with both members
    assert stored[0].rewards["group_judge"].data["calls"] == stored[1].rewards["group_judge"].data["calls"]
    assert [r.rewards["group_judge"].data["group"]["position"] for r in stored] == [1, 2]
