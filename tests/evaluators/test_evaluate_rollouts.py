"""evaluate_rollouts: who is judged, what is written, what is counted.

Most tests here write to an in-memory writer that keeps the server's rule for ``replaces`` (a
score given meanwhile is a 409 ``Conflict``); ``test_evaluator_server.py`` runs the same through
the real server and store."""

from __future__ import annotations

from collections.abc import Sequence

from agentbolt.evaluators import Evaluator, FunctionEvaluator, Judgement, RolloutRecord, evaluate_rollouts
from agentbolt.schemas import (
    Event,
    RewardScale,
    RewardState,
    RolloutStatus,
)
from tests.evaluators.conftest import MemoryWriter, llm_event, make_rollout, slot


def answer_is_four(record: RolloutRecord) -> float:
    return 1.0 if record.output == "4" else 0.0


def _events(rid: str, answer: str) -> list[Event]:
    return [llm_event(rid, [{"role": "user", "content": "2+2?"}], answer)]


def test_succeeded_rollouts_with_a_pending_slot_are_scored_and_written() -> None:
    pending = {"correct": slot("correct", RewardState.PENDING, 0)}
    rollouts = [
        make_rollout("a", rewards=pending),
        make_rollout("b", rewards=pending),
        make_rollout("c"),  # no slot: the write creates it
        make_rollout("d", status=RolloutStatus.FAILED, rewards=pending),
        make_rollout("e", rewards={"correct": slot("correct", RewardState.SCORED, 1)}),
    ]
    writer = MemoryWriter({"a": _events("a", "4"), "b": _events("b", "5"), "c": _events("c", "4")})
    report = evaluate_rollouts(writer, rollouts, [FunctionEvaluator(answer_is_four, name="correct")])
    written = {rid: create for rid, create in writer.writes}
    assert sorted(written) == ["a", "b", "c"]
    assert (written["a"].score, written["b"].score, written["c"].score) == (1.0, 0.0, 1.0)
    assert all(c.author == "correct" and c.state == RewardState.SCORED for c in written.values())
    assert written["a"].replaces == 0 and written["c"].replaces is None
    assert (report.scored, report.errors, report.skipped, report.conflicts) == (3, 0, 2, 0)


def test_an_error_is_written_as_a_reward_in_state_error_and_a_later_run_retries_it() -> None:
    def broken(record: RolloutRecord) -> float:
        raise ValueError("cannot read the answer")

    writer = MemoryWriter({"a": _events("a", "4")})
    report = evaluate_rollouts(writer, [make_rollout("a")], [FunctionEvaluator(broken, name="correct")])
    [(rid, create)] = writer.writes
    assert create.state == RewardState.ERROR and create.score is None
    assert create.error is not None and "cannot read the answer" in create.error
    assert (report.scored, report.errors) == (0, 1)
    errored = make_rollout("a", rewards={"correct": slot("correct", RewardState.ERROR, 1)})
    again = evaluate_rollouts(writer, [errored], [FunctionEvaluator(answer_is_four, name="correct")])
    assert again.scored == 1 and writer.writes[-1][1].replaces == 1 and writer.writes[-1][1].score == 1.0


def test_a_rerun_on_the_same_rollouts_stores_nothing_new_and_counts_the_conflicts() -> None:
    rollouts = [make_rollout("a", rewards={"correct": slot("correct", RewardState.PENDING, 0)})]
    writer = MemoryWriter({"a": _events("a", "4")})
    evaluator = FunctionEvaluator(answer_is_four, name="correct")
    assert evaluate_rollouts(writer, rollouts, [evaluator]).scored == 1
    rerun = evaluate_rollouts(writer, rollouts, [evaluator])  # the same (stale) rollouts
    assert (rerun.scored, rerun.conflicts) == (0, 1) and len(writer.writes) == 1


class RankByLength(Evaluator):
    """A group evaluator: the longest answer of the group scores 1, the others 0."""

    group = True

    def __init__(self) -> None:
        self.name, self.scale, self.seen = "rank", RewardScale(), []

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        self.seen.append(sorted(r.rollout.id for r in records))
        longest = max(len(r.output or "") for r in records)
        return [Judgement(score=float(len(r.output or "") == longest), reason="longest") for r in records]


def test_a_group_evaluator_sees_each_group_together_and_writes_only_unscored_members() -> None:
    pending = {"rank": slot("rank", RewardState.PENDING, 0)}
    rollouts = [
        make_rollout("g1a", group_id="g1", rewards=pending),
        make_rollout("g1b", group_id="g1", rewards={"rank": slot("rank", RewardState.SCORED, 1)}),
        make_rollout("g1c", group_id="g1", status=RolloutStatus.FAILED, rewards=pending),
        make_rollout("g2a", group_id="g2", rewards=pending),
        make_rollout("g2b", group_id="g2", rewards=pending),
        make_rollout("solo", rewards=pending),
    ]
    answers = {"g1a": "4", "g1b": "four", "g2a": "4", "g2b": "44", "solo": "4"}
    writer = MemoryWriter({rid: _events(rid, a) for rid, a in answers.items()})
    evaluator = RankByLength()
    report = evaluate_rollouts(writer, rollouts, [evaluator])
    assert sorted(evaluator.seen) == [["g1a", "g1b"], ["g2a", "g2b"], ["solo"]]
    written = {rid: c.score for rid, c in writer.writes}
    assert written == {"g1a": 0.0, "g2a": 0.0, "g2b": 1.0, "solo": 1.0}
    assert writer.writes[0][1].data == {"reason": "longest", "fingerprint": evaluator.fingerprint()}
    assert (report.scored, report.skipped) == (4, 2)


def test_only_automatic_evaluators_run_and_a_broken_evaluator_fails_its_judgements_only() -> None:
    from agentbolt.evaluators import HumanReview

    class Broken(RankByLength):
        group = False

        async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
            return []  # one judgement short

    writer = MemoryWriter({"a": _events("a", "4")})
    evaluators = [HumanReview(), Broken(), FunctionEvaluator(answer_is_four, name="correct")]
    report = evaluate_rollouts(writer, [make_rollout("a")], evaluators)
    by_name = {c.name: c for _, c in writer.writes}
    assert sorted(by_name) == ["correct", "rank"]
    assert by_name["rank"].state == RewardState.ERROR
    assert by_name["rank"].error == "evaluator 'rank' gave 0 judgements for 1 rollouts"
    assert (report.scored, report.errors) == (1, 1)


async def test_it_also_runs_from_code_that_is_inside_an_event_loop() -> None:
    writer = MemoryWriter({"a": _events("a", "4")})
    report = evaluate_rollouts(
        writer, [make_rollout("a")], [FunctionEvaluator(answer_is_four, name="correct")]
    )
    assert report.scored == 1 and writer.writes[0][1].score == 1.0


def test_progress_shows_on_the_console_or_on_a_display_the_caller_runs() -> None:
    import io

    from rich.console import Console
    from rich.progress import Progress

    evaluator = FunctionEvaluator(answer_is_four, name="correct")
    out = io.StringIO()
    writer = MemoryWriter({"a": _events("a", "4"), "b": _events("b", "4")})
    console = Console(file=out, force_terminal=True, width=100)
    assert evaluate_rollouts(writer, [make_rollout("a")], [evaluator], console=console).scored == 1
    assert "judging" in out.getvalue() and "1 scored" in out.getvalue()
    shared = Progress(console=Console(file=io.StringIO()))
    with shared:
        report = evaluate_rollouts(writer, [make_rollout("b")], [evaluator], progress=shared)
        assert shared.tasks == []  # its bar is removed when done
    assert report.scored == 1
