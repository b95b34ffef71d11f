"""Evaluators writing through the real server and store on 127.0.0.1, with an evaluator token
(``served`` and ``run_rollouts`` are in this folder's conftest)."""

from __future__ import annotations

from agentbolt.client import Client
from agentbolt.evaluators import (
    FunctionEvaluator,
    HumanReview,
    JudgeModel,
    PointwiseJudge,
    RolloutRecord,
    evaluate_rollouts,
)
from agentbolt.schemas import RewardSource, RewardState
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.evaluators.conftest import ADMIN, EVALUATOR, RUNNER, recorded_judge_server, run_rollouts


def answer_is_four(record: RolloutRecord) -> float:
    return 1.0 if record.output == "4" else 0.0


def test_an_evaluator_token_writes_the_rewards_once_and_a_rerun_stores_nothing_new(served) -> None:
    judge, human = FunctionEvaluator(answer_is_four, name="correct"), HumanReview()
    with Client(served.url, ADMIN) as admin, Client(served.url, EVALUATOR) as evaluator_client:
        done = run_rollouts(admin, ["4", "5", None], [judge.awaited(), human.awaited()])
        report = evaluate_rollouts(evaluator_client, done, [judge, human])
        assert (report.scored, report.errors, report.skipped, report.conflicts) == (2, 0, 1, 0)
        right, wrong, failed = (admin.get_rollout(r.id) for r in done)
        assert (right.rewards["correct"].score, wrong.rewards["correct"].score) == (1.0, 0.0)
        slot = right.rewards["correct"]
        assert (slot.state, slot.source, slot.author, slot.revision) == (
            RewardState.SCORED,
            RewardSource.EVALUATOR,
            "correct",
            1,
        )
        # the person's reward and the failed rollout's are left pending
        assert right.pending_rewards == ["human"]
        assert failed.rewards["correct"].state == RewardState.PENDING
        # the same (stale) rollouts again: the server refuses the repeat, nothing is stored
        stale = evaluate_rollouts(evaluator_client, done, [judge])
        assert (stale.scored, stale.conflicts) == (0, 2)
        # fresh reads: scored rewards are skipped, not judged twice
        fresh = evaluator_client.wait([r.id for r in done], timeout=5).rollouts
        again = evaluate_rollouts(evaluator_client, fresh, [judge])
        assert (again.scored, again.conflicts, again.skipped) == (0, 0, 3)
        assert len(admin.reward_history(right.id, "correct")) == 1
        assert len(admin.reward_history(wrong.id, "correct")) == 1


def test_an_error_reward_is_stored_as_an_error_and_scored_by_a_later_run(served) -> None:
    def unsure(record: RolloutRecord) -> float:
        raise LookupError("no gold answer for this task")

    with Client(served.url, EVALUATOR) as client, Client(served.url, ADMIN) as admin:
        [done] = run_rollouts(admin, ["4"], [FunctionEvaluator(unsure, name="correct").awaited()])
        report = evaluate_rollouts(client, [done], [FunctionEvaluator(unsure, name="correct")])
        assert report.errors == 1
        errored = client.get_rollout(done.id)
        slot = errored.rewards["correct"]
        assert slot.state == RewardState.ERROR and slot.value is None
        assert slot.error is not None and "no gold answer" in slot.error
        fixed = evaluate_rollouts(client, [errored], [FunctionEvaluator(answer_is_four, name="correct")])
        assert fixed.scored == 1
        history = client.reward_history(done.id, "correct")
        assert [h.state for h in history] == [RewardState.ERROR, RewardState.SCORED]
        assert client.get_rollout(done.id).rewards["correct"].value == 1.0


def test_a_judge_via_the_server_never_holds_the_key_and_an_unlisted_model_is_refused(tmp_path) -> None:
    rubric = "The run answers 2+2 correctly."
    with recorded_judge_server("pointwise_good") as upstream:
        config = ServerConfig(
            db=str(tmp_path / "store.db"),
            tokens={ADMIN: Role.ADMIN, EVALUATOR: Role.EVALUATOR, RUNNER: Role.RUNNER},
            upstream_api_keys={upstream.base_url: "sk-held-by-the-server"},
        )
        with ServerThread(config) as server, Client(server.url, ADMIN) as admin:
            judge = PointwiseJudge(rubric, JudgeModel(upstream.base_url, "gpt-4o-mini", via_server=True))
            elsewhere = JudgeModel("http://127.0.0.1:9/v1", "other", via_server=True)
            unlisted = PointwiseJudge(rubric, elsewhere, name="other_judge")
            [done] = run_rollouts(admin, ["4"], [judge.awaited(), unlisted.awaited()])
            with Client(server.url, EVALUATOR) as client:  # the judge reaches the server the run writes to
                report = evaluate_rollouts(client, [done], [judge, unlisted])
            stored = admin.get_rollout(done.id)
    assert (report.scored, report.errors) == (1, 1)
    [request] = upstream.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["authorization"] == "Bearer sk-held-by-the-server"
    slot = stored.rewards["judge"]
    assert slot.score == 0.8 and slot.data["judge"]["via_server"] is True
    assert "sk-held-by-the-server" not in str(stored.model_dump())
    refused = stored.rewards["other_judge"]
    assert refused.state == RewardState.ERROR and refused.error is not None
    assert "via the agentbolt server answered HTTP 403" in refused.error
    assert "holds no key for 'http://127.0.0.1:9/v1'" in refused.error
