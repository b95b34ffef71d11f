"""The evaluator worker and ``agentbolt judge`` against the real server, the judge being the
recorded hosted-judge double served over HTTP on 127.0.0.1 (see ``conftest.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from agentbolt.client import Client
from agentbolt.evaluators import Evaluator, FunctionEvaluator, Judgement, RolloutRecord
from agentbolt.evaluators.worker import EvaluatorWorker
from agentbolt.schemas import (
    AttemptStatus,
    AwaitedReward,
    EventCreate,
    RewardScale,
    RewardSource,
    RewardState,
    RolloutCreate,
    Task,
)
from tests.evaluators.conftest import ADMIN, EVALUATOR, RUNNER, recorded_judge_server, run_rollouts

RUBRIC = "The run answers the arithmetic question correctly."


def answer_is_four(record: RolloutRecord) -> float:
    return 1.0 if record.output == "4" else 0.0


class Longest(Evaluator):
    """A group evaluator: the longest answer of the group scores 1. Keeps the groups it saw."""

    group = True

    def __init__(self) -> None:
        self.name, self.scale, self.seen = "longest", RewardScale(), []

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        self.seen.append(sorted(r.rollout.id for r in records))
        top = max(len(r.output or "") for r in records)
        return [Judgement(score=float(len(r.output or "") == top)) for r in records]


def test_one_pass_scores_the_pending_queue_and_a_second_finds_nothing(served) -> None:
    evaluator = FunctionEvaluator(answer_is_four, name="correct")
    with Client(served.url, ADMIN) as admin, Client(served.url, EVALUATOR) as client:
        done = run_rollouts(admin, ["4", "5", "4"], [evaluator.awaited()])
        worker = EvaluatorWorker(client, [evaluator], batch=2)  # two pages of the queue
        report = worker.run(once=True)
        assert (report.scored, report.errors) == (3, 0)
        assert [admin.get_rollout(r.id).rewards["correct"].value for r in done] == [1.0, 0.0, 1.0]
        assert client.pending_rewards(name="correct").items == []
        assert EvaluatorWorker(client, [evaluator]).run(once=True).scored == 0


def test_a_group_is_judged_once_all_its_rollouts_are_final(served) -> None:
    evaluator = Longest()
    awaited = [evaluator.awaited()]
    with Client(served.url, ADMIN) as admin, Client(served.url, EVALUATOR) as client:
        first = run_rollouts(admin, ["4", "four"], awaited, group_id="g1")
        [straggler] = admin.enqueue(
            [RolloutCreate(task=Task(data={"q": 1}), await_rewards=awaited, group_id="g1")]
        )
        runner = Client(served.url, RUNNER)
        claim = runner.dequeue("worker-1")
        assert claim is not None and claim.rollout.id == straggler.id
        worker = EvaluatorWorker(client, [evaluator])
        assert worker.run(once=True).scored == 0 and evaluator.seen == []  # g1 still running
        call = {
            "endpoint": "chat.completions",
            "request": {"messages": [{"role": "user", "content": "2+2?"}]},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "the answer is 4"}}],
        }
        # posted as the runner's tracer does: evaluators read only model calls the system wrote
        runner.add_events(claim.attempt.id, [EventCreate(sequence=0, type="llm_call", data=call)], "worker-1")
        runner.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, worker_id="worker-1")
        runner.close()
        assert worker.run(once=True).scored == 3
        assert evaluator.seen == [sorted([first[0].id, first[1].id, straggler.id])]
        assert admin.get_rollout(straggler.id).rewards["longest"].score == 1.0
        assert admin.get_rollout(first[1].id).rewards["longest"].score == 0.0


def test_a_running_worker_scores_rollouts_as_they_finish_and_stops_when_told(served) -> None:
    evaluator = FunctionEvaluator(answer_is_four, name="correct")
    with Client(served.url, ADMIN) as admin, Client(served.url, EVALUATOR) as client:
        worker = EvaluatorWorker(client, [evaluator])
        thread = threading.Thread(target=worker.run, kwargs={"poll": 0.1})
        thread.start()
        try:
            [done] = run_rollouts(admin, ["4"], [evaluator.awaited()])
            deadline = time.monotonic() + 10
            while admin.get_rollout(done.id).rewards["correct"].state == RewardState.PENDING:
                assert time.monotonic() < deadline, "the worker did not score the finished rollout"
                time.sleep(0.05)
        finally:
            worker.stop()
            thread.join(5)
        assert not thread.is_alive() and worker.total.scored == 1
        assert admin.get_rollout(done.id).rewards["correct"].score == 1.0


# ---------------------------------------------------------------------------- agentbolt judge


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentbolt", "judge", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_agentbolt_judge_once_scores_pending_rollouts_with_the_judge_model(served, tmp_path) -> None:
    judge = AwaitedReward(name="judge", source=RewardSource.EVALUATOR)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text(RUBRIC)
    with (
        Client(served.url, ADMIN) as admin,
        recorded_judge_server("pointwise_chatty", "pointwise_good") as model,
    ):
        [done] = run_rollouts(admin, ["4"], [judge])
        options = {
            "--server": served.url,
            "--token": EVALUATOR,
            "--judge-rubric-file": str(rubric),
            "--judge-url": model.base_url,
            "--judge-model": "gpt-4o-mini",
            "--judge-key": "sk-judge",
            "--max-calls": "5",
        }
        out = cli(*[part for item in options.items() for part in item], "--once")
        assert out.returncode == 0, out.stderr
        assert "judge: 1 scored, 0 errors" in out.stdout and "2 judge calls" in out.stdout
        slot = admin.get_rollout(done.id).rewards["judge"]
        assert (slot.score, slot.author, slot.revision) == (0.8, "judge", 1)
        assert len(slot.data["calls"]) == 2 and slot.data["reason"].startswith("The run computes")
        assert [r["headers"].get("authorization") for r in model.requests] == ["Bearer sk-judge"] * 2
        assert RUBRIC in model.requests[0]["body"]["messages"][-1]["content"]


def test_agentbolt_judge_refuses_bad_options_in_one_line(served, tmp_path) -> None:
    common = ("--server", served.url, "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m", "--once")
    cases = {
        (
            "--token",
            EVALUATOR,
        ): "give the rubric as exactly one of --judge-rubric TEXT or --judge-rubric-file PATH",
        ("--token", EVALUATOR, "--judge-rubric", "a", "--judge-rubric-file", "r.txt"): "exactly one of",
        (
            "--token",
            EVALUATOR,
            "--judge-rubric-file",
            str(tmp_path / "none.txt"),
        ): "cannot read the rubric file",
        (
            "--token",
            EVALUATOR,
            "--judge-rubric",
            "a",
            "--judge-via-server",
            "--judge-key",
            "k",
        ): "drop --judge-key",
        (
            "--token",
            EVALUATOR,
            "--judge-rubric",
            "a",
            "--name",
            "agent",
        ): "'agent' names the rollout's own reward",
    }
    for args, message in cases.items():
        out = cli(*common, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    bad_url = cli(
        "--server", served.url, "--judge-url", "not a url", "--judge-model", "m", "--judge-rubric", "a"
    )
    assert bad_url.returncode == 2 and "must be an http(s) URL" in bad_url.stderr
    # a token the server does not know: one line, before any work
    refused = cli(*common, "--token", "wrong", "--judge-rubric", "a")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "401" in refused.stderr


def test_agentbolt_judge_stops_at_its_budget_and_the_unjudged_rewards_say_why(served) -> None:
    judge = AwaitedReward(name="group_judge", source=RewardSource.EVALUATOR)
    with Client(served.url, ADMIN) as admin, recorded_judge_server("group_good") as model:
        group_a = run_rollouts(admin, ["4", "5", "four"], [judge], group_id="a")
        group_b = run_rollouts(admin, ["6", "7", "8"], [judge], group_id="b")
        options = ["--server", served.url, "--token", EVALUATOR, "--judge-rubric", RUBRIC, "--group-judge"]
        options += ["--judge-url", model.base_url, "--judge-model", "m", "--max-calls", "1", "--poll", "0.2"]
        out = cli(*options)  # not --once: the exhausted budget stops it
        assert out.returncode == 0, out.stderr
        assert "group_judge: 3 scored, 3 errors" in out.stdout and "1 judge calls" in out.stdout
        assert "judge budget exhausted (1 calls, 549 tokens): 1 judgements not made" in out.stdout
        assert len(model.requests) == 1
        slots = [admin.get_rollout(r.id).rewards["group_judge"] for r in [*group_a, *group_b]]
        scored = [s for s in slots if s.state == RewardState.SCORED]
        errors = [s for s in slots if s.state == RewardState.ERROR]
        assert sorted(s.score for s in scored) == [0.1, 0.5, 0.9]
        # the refused group was asked while the first call ran: its tokens were not counted yet
        assert len(errors) == 3 and all(
            re.fullmatch(r"judge budget exhausted \(1 calls, \d+ tokens\)", s.error or "") for s in errors
        )
        assert all(s.data["group"]["size"] == 3 for s in slots)


def test_agentbolt_judge_stops_cleanly_on_ctrl_c(served) -> None:
    import signal

    args = ["--server", served.url, "--token", EVALUATOR, "--judge-rubric", RUBRIC, "--poll", "0.2"]
    args += ["--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbolt", "judge", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        assert proc.stdout is not None
        assert "judging pending 'judge' rewards" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopping after the batch in hand" in out and "judge: 0 scored" in out
    assert "Traceback" not in err
