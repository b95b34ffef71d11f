"""Model judges against a *recorded test double* of a hosted judge.

The double is an ``httpx.MockTransport`` injected into :class:`JudgeModel`: it replays
OpenAI-style chat completion answers stored in ``recorded/openai_chat.json`` (their shape is
that of OpenAI's API; they were written after its documented format, not captured from a live
model) and keeps every request it got, so the tests see exactly what a hosted judge would be
sent. The bundled model as a real judge is ``test_judge_smollm2.py``; a real slow HTTP server
tests the timeout here."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentbolt.errors import ConfigError
from agentbolt.evaluators import evaluate_rollouts
from agentbolt.evaluators.judge import (
    POINTWISE_EXAMPLES,
    POINTWISE_FORMAT,
    GroupJudge,
    JudgeBudget,
    JudgeModel,
    Malformed,
    PointwiseJudge,
    clear_cache,
    parse_group,
    parse_pointwise,
)
from agentbolt.schemas import RewardState
from tests.evaluators.conftest import RECORDED, MemoryWriter, conversation_record, llm_event, make_rollout

URL = "https://api.openai.com/v1"
KEY = "sk-test-secret-key"
RUBRIC = "The run answers the arithmetic question correctly, using the calculator when it helps."


class RecordedJudge:
    """Replays recorded answers in order (the last one again when they run out)."""

    def __init__(self, *names: str, delay: float = 0.0) -> None:
        self.answers = [RECORDED[n] for n in names]
        self.requests: list[httpx.Request] = []
        self.delay = delay
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
        return httpx.Response(answer["status"], json=answer["body"])

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def model(self, **options: Any) -> JudgeModel:
        return JudgeModel(URL, "gpt-4o-mini", KEY, transport=self.transport, **options)


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


# ---------------------------------------------------------------------------- strict formats


def test_the_pointwise_format_is_exactly_two_lines() -> None:
    assert parse_pointwise("SCORE: 0.8\nREASON: Correct.") == (0.8, "Correct.")
    assert parse_pointwise("  SCORE:1\r\nREASON:   fine  \n") == (1.0, "fine")
    assert parse_pointwise("SCORE: .5\nREASON: half") == (0.5, "half")
    bad = {
        "SCORE: 0.8": "1 lines instead of 2",
        "SCORE: 0.8\n\nREASON: x": "3 lines instead of 2",
        "Score: 0.8\nREASON: x": "first line",
        "SCORE: 0.8/1\nREASON: x": "first line",
        "SCORE: 1.5\nREASON: x": "score 1.5 is not between 0 and 1",
        "SCORE: 0.8\nREASON:": "second line",
        "SCORE: 0.8\nBecause it is right": "second line",
        "": "0 lines",
    }
    for answer, why in bad.items():
        with pytest.raises(Malformed, match=why):
            parse_pointwise(answer)


def test_the_group_format_scores_every_run_exactly_once() -> None:
    assert parse_group("1: 0.9\n2: 0.1\n3: 0.5\nREASON: run 1 is right", 3) == (
        [0.9, 0.1, 0.5],
        "run 1 is right",
    )
    assert parse_group("2: 0\n1: 1", 2) == ([1.0, 0.0], "")
    bad = {
        "1: 0.9\n3: 0.5": "no score for run 2",
        "1: 0.9\n2: 0.1\n2: 0.4\n3: 0.5": "run 2 is scored twice",
        "1: 0.9\n2: 0.1\n3: 0.5\n4: 0.2": "run 4 does not exist",
        "1: 0.9\n2: 1.2\n3: 0.5": "score 1.2 is not between 0 and 1",
        "Run 1: 0.9\n2: 0.1\n3: 0.5": "is not '<run number>: <score>'",
        "REASON: all good\n1: 0.9\n2: 0.1\n3: 0.5": "is not '<run number>: <score>'",
        "": "no score for runs 1, 2, 3",
    }
    for answer, why in bad.items():
        with pytest.raises(Malformed, match=why):
            parse_group(answer, 3)


# ---------------------------------------------------------------------------- pointwise


async def test_a_pointwise_judge_scores_and_records_its_call_without_the_key() -> None:
    double = RecordedJudge("pointwise_good")
    judge = PointwiseJudge(RUBRIC, double.model(price_per_1k_tokens=0.5))
    [judgement] = await judge.judge([conversation_record(2)])
    assert (judgement.score, judgement.error) == (0.8, None)
    assert judgement.reason == "The run computes 2+2 with the calculator and answers 4."
    [request] = double.requests
    assert str(request.url) == f"{URL}/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    body = double.bodies()[0]
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("gpt-4o-mini", 0.0, 200)
    assert (
        body["messages"][0]["role"] == "system"
        and "SCORE: <a number between 0 and 1>" in body["messages"][0]["content"]
    )
    assert (
        RUBRIC in body["messages"][-1]["content"] and "FIRST: what is 2+2?" in body["messages"][-1]["content"]
    )
    [call] = judgement.data["calls"]
    assert call["request"] == body["messages"] and call["answer"].startswith("SCORE: 0.8")
    assert call["usage"]["total_tokens"] == 250 and call["cost_usd"] == pytest.approx(0.125)
    assert call["cached"] is False and call["latency_s"] >= 0 and call["error"] is None
    assert judgement.data["judge"] == {"model": "gpt-4o-mini", "base_url": URL, "via_server": False}
    assert judgement.data["cut"] is None and judgement.data["reason"] == judgement.reason
    assert KEY not in json.dumps(judgement.data) and KEY not in json.dumps(judge.config())


async def test_a_worked_example_of_the_format_comes_first_unless_turned_off() -> None:
    double = RecordedJudge("pointwise_good")
    with_example = PointwiseJudge(RUBRIC, double.model())
    without = PointwiseJudge(RUBRIC, double.model(), examples=False)
    await with_example.judge([conversation_record(0, answer="10")])
    await without.judge([conversation_record(0, answer="10")])
    shown, plain = double.bodies()
    assert [m["role"] for m in shown["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert [(m["content"]) for m in shown["messages"][1:5]] == [
        part for pair in POINTWISE_EXAMPLES for part in pair
    ]
    assert shown["messages"][2]["content"] == "SCORE: 1\nREASON: The run greets Ada by her name."
    assert [m["role"] for m in plain["messages"]] == ["system", "user"]
    assert plain["messages"][-1] == shown["messages"][-1]
    assert with_example.fingerprint() != without.fingerprint()


async def test_a_malformed_answer_is_asked_again_with_a_reminder() -> None:
    double = RecordedJudge("pointwise_chatty", "pointwise_fixed")
    [judgement] = await PointwiseJudge(RUBRIC, double.model()).judge([conversation_record(0)])
    assert (judgement.score, judgement.error) == (0.7, None)
    first, second = double.bodies()
    asked = len(first["messages"])
    assert second["messages"][:asked] == first["messages"]
    assert second["messages"][asked] == {
        "role": "assistant",
        "content": RECORDED["pointwise_chatty"]["body"]["choices"][0]["message"]["content"],
    }
    assert "did not follow the format (3 lines instead of 2)" in second["messages"][asked + 1]["content"]
    assert len(judgement.data["calls"]) == 2


async def test_an_answer_malformed_after_every_retry_is_an_error_with_its_start() -> None:
    double = RecordedJudge("pointwise_chatty", "pointwise_out_of_range")
    [judgement] = await PointwiseJudge(RUBRIC, double.model(), retries=1).judge([conversation_record(0)])
    assert judgement.score is None and judgement.error == "malformed judge answer: SCORE: 8\nREASON: Good."
    assert len(double.requests) == 2 and len(judgement.data["calls"]) == 2
    no_retry = RecordedJudge("pointwise_chatty")
    [once] = await PointwiseJudge(RUBRIC, no_retry.model(max_tokens=50), retries=0).judge(
        [conversation_record(0)]
    )
    chatty = RECORDED["pointwise_chatty"]["body"]["choices"][0]["message"]["content"]
    assert once.error == f"malformed judge answer: {chatty[:200]}" and len(no_retry.requests) == 1


async def test_http_errors_are_judgements_naming_them_and_are_not_retried() -> None:
    double = RecordedJudge("rate_limited")
    [judgement] = await PointwiseJudge(RUBRIC, double.model()).judge([conversation_record(0)])
    assert judgement.score is None and judgement.error is not None
    assert judgement.error.startswith(
        f"judge model 'gpt-4o-mini' at {URL} answered HTTP 429: Rate limit reached"
    )
    assert len(double.requests) == 1 and judgement.data["calls"][0]["error"] == judgement.error


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        time.sleep(1.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


async def test_a_judge_that_times_out_gives_an_error_naming_the_timeout() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        model = JudgeModel(url, "slow-judge", timeout=0.3)
        [judgement] = await PointwiseJudge(RUBRIC, model).judge([conversation_record(0)])
    finally:
        server.shutdown()
        server.server_close()
    assert judgement.score is None
    assert judgement.error == f"judge model 'slow-judge' at {url} timed out after 0.3 s"


# ---------------------------------------------------------------------------- budget and cache


async def test_a_call_over_the_budget_is_not_made() -> None:
    double = RecordedJudge("pointwise_good")
    budget = JudgeBudget(max_calls=1)
    judge = PointwiseJudge(RUBRIC, double.model(), budget=budget)
    [scored] = await judge.judge([conversation_record(0, answer="4")])
    [refused] = await judge.judge([conversation_record(0, answer="5")])
    assert len(double.requests) == 1 and scored.score == 0.8
    assert refused.error == "judge budget exhausted (1 calls, 250 tokens)" and refused.data["calls"] == []
    # asked at once, the budget still lets one call through
    racing = RecordedJudge("pointwise_good", delay=0.05)
    both = await PointwiseJudge(RUBRIC, racing.model(), budget=JudgeBudget(max_calls=1)).judge(
        [conversation_record(0, answer="7"), conversation_record(0, answer="8")]
    )
    assert len(racing.requests) == 1 and sorted(j.error is None for j in both) == [False, True]
    # tokens: the prompt's characters / 4 + max_tokens must fit before a call is made
    tight = RecordedJudge("pointwise_good")
    [judgement] = await PointwiseJudge(RUBRIC, tight.model(), budget=JudgeBudget(max_tokens=150)).judge(
        [conversation_record(0, answer="6")]
    )
    assert judgement.error == "judge budget exhausted (0 calls, 0 tokens)" and tight.requests == []
    with pytest.raises(ConfigError):
        JudgeBudget(max_calls=-1)


async def test_identical_requests_are_answered_once_and_recorded_as_cached(tmp_path) -> None:
    double = RecordedJudge("pointwise_good", delay=0.05)
    judge = PointwiseJudge(RUBRIC, double.model(cache_path=tmp_path / "judge-cache.jsonl"))
    record = conversation_record(1)
    # twice at once (the second waits for the first) and once more later
    together = await judge.judge([record, record])
    [later] = await judge.judge([record])
    assert len(double.requests) == 1
    calls = [j.data["calls"][0] for j in [*together, later]]
    assert sorted(c["cached"] for c in calls) == [False, True, True]
    assert all(j.score == 0.8 for j in [*together, later])
    assert all(c["latency_s"] == 0.0 for c in calls if c["cached"])
    # another process: the file answers
    clear_cache()
    fresh = RecordedJudge("pointwise_good")
    [from_file] = await PointwiseJudge(RUBRIC, fresh.model(cache_path=tmp_path / "judge-cache.jsonl")).judge(
        [record]
    )
    assert fresh.requests == [] and from_file.data["calls"][0]["cached"] is True and from_file.score == 0.8
    # another rubric is another question
    await PointwiseJudge("Another rubric.", fresh.model()).judge([record])
    assert len(fresh.requests) == 1


async def test_a_long_run_is_cut_as_stated_and_the_cut_recorded() -> None:
    double = RecordedJudge("pointwise_good")
    judge = PointwiseJudge(RUBRIC, double.model(), max_transcript_chars=800)
    [judgement] = await judge.judge([conversation_record(20, turn_chars=120)])
    cut = judgement.data["cut"]
    assert cut is not None and cut["turns_cut"] > 0 and cut["chars_after"] <= 800
    sent = double.bodies()[0]["messages"][-1]["content"]
    assert f"[... {cut['turns_cut']} turns ({cut['chars_cut']} characters) cut ...]" in sent
    assert "FIRST: what is 2+2?" in sent and sent.endswith(
        f"FINAL ANSWER:\n[assistant] 4\n\n{POINTWISE_FORMAT}"
    )


def test_bad_judge_settings_are_refused_with_a_message() -> None:
    model = JudgeModel(URL, "m")
    with pytest.raises(ConfigError, match="rubric"):
        PointwiseJudge("  ", model)
    with pytest.raises(ConfigError, match="max_transcript_chars"):
        PointwiseJudge(RUBRIC, model, max_transcript_chars=10)
    with pytest.raises(ConfigError, match="base_url"):
        JudgeModel("api.openai.com", "m")
    with pytest.raises(ConfigError, match="name"):
        GroupJudge(RUBRIC, model, name="agent")


# ---------------------------------------------------------------------------- group


def _group(n: int) -> list:
    answers = ["4", "5", "four"]
    return [conversation_record(0, rid=f"g-{i}", answer=answers[i % 3]) for i in range(n)]


async def test_a_group_judge_scores_the_runs_of_a_group_relative_to_each_other() -> None:
    double = RecordedJudge("group_good")
    records = _group(3)
    judgements = await GroupJudge(RUBRIC, double.model()).judge(records)
    assert [j.score for j in judgements] == [0.9, 0.1, 0.5]
    assert len(double.requests) == 1
    sent = double.bodies()[0]["messages"]
    assert "1: <score>\n2: <score>\n3: <score>" in sent[0]["content"]
    user = sent[-1]["content"]
    assert user.count("THE TASK (the same for every run)") == 1 and user.count('"question"') == 1
    assert user.index("=== RUN 1 ===") < user.index("=== RUN 2 ===") < user.index("=== RUN 3 ===")
    for position, judgement in enumerate(judgements, 1):
        assert judgement.data["group"] == {
            "id": "g-0",
            "size": 3,
            "position": position,
            "rollouts": ["g-0", "g-1", "g-2"],
        }
        assert judgement.reason.startswith("Run 1 answers correctly")
        assert len(judgement.data["calls"]) == 1


async def test_a_group_answer_missing_a_run_or_scoring_one_twice_is_malformed() -> None:
    double = RecordedJudge("group_missing_run", "group_run_twice")
    judgements = await GroupJudge(RUBRIC, double.model()).judge(_group(3))
    assert len(double.requests) == 2
    assert "no score for run 2" in double.bodies()[1]["messages"][-1]["content"]
    assert all(j.score is None for j in judgements)
    assert all(j.error == "malformed judge answer: 1: 0.9\n2: 0.1\n2: 0.4\n3: 0.5" for j in judgements)


def test_judges_through_evaluate_rollouts_count_calls_tokens_and_cache_hits() -> None:
    double = RecordedJudge("pointwise_good")
    asked = [{"role": "user", "content": "2+2?"}]
    rollouts = [make_rollout("a"), make_rollout("b")]
    writer = MemoryWriter({rid: [llm_event(rid, asked, "4")] for rid in ("a", "b")})
    report = evaluate_rollouts(writer, rollouts, [PointwiseJudge(RUBRIC, double.model())])
    # the two runs read alike (same task, same answer): one call, one cache hit
    assert (report.scored, report.calls, report.cached, report.tokens) == (2, 1, 1, 250)
    assert all(c.state == RewardState.SCORED and c.score == 0.8 for _, c in writer.writes)
    assert writer.writes[0][1].data["judge"]["model"] == "gpt-4o-mini"
    group = RecordedJudge("group_good")
    rollouts = [make_rollout(f"r{i}", group_id="g") for i in range(3)]
    writer = MemoryWriter({r.id: [llm_event(r.id, asked, str(i))] for i, r in enumerate(rollouts)})
    report = evaluate_rollouts(writer, rollouts, [GroupJudge(RUBRIC, group.model())])
    assert (report.scored, report.calls, report.tokens) == (3, 1, 549)
    assert [c.score for _, c in sorted(writer.writes)] == [0.9, 0.1, 0.5]


async def test_a_sampled_judge_is_asked_every_time_and_nothing_is_kept(tmp_path) -> None:
    double = RecordedJudge("pointwise_good", delay=0.02)
    cache = tmp_path / "judge-cache.jsonl"
    judge = PointwiseJudge(RUBRIC, double.model(temperature=0.7, cache_path=cache))
    record = conversation_record(1)
    together = await judge.judge([record, record])  # at once: not shared either
    [later] = await judge.judge([record])
    assert len(double.requests) == 3 and not cache.exists()
    assert [j.data["calls"][0]["cached"] for j in [*together, later]] == [False, False, False]
    # the same judge asked greedily is cached: the temperature is part of its identity
    greedy = RecordedJudge("pointwise_good")
    await PointwiseJudge(RUBRIC, greedy.model(cache_path=cache)).judge([record, record])
    assert len(greedy.requests) == 1 and cache.exists()


async def test_a_malformed_answer_is_never_cached_and_a_cached_one_is_asked_again(tmp_path) -> None:
    cache = tmp_path / "judge-cache.jsonl"
    record = conversation_record(0)
    double = RecordedJudge("pointwise_chatty", "pointwise_fixed")
    [first] = await PointwiseJudge(RUBRIC, double.model(cache_path=cache)).judge([record])
    assert first.score == 0.7 and len(double.requests) == 2
    kept = [json.loads(line)["answer"] for line in cache.read_text().splitlines()]
    assert kept == [RECORDED["pointwise_fixed"]["body"]["choices"][0]["message"]["content"]]
    # the first question again: its answer was malformed, so it is asked again, not replayed
    again = RecordedJudge("pointwise_good")
    [second] = await PointwiseJudge(RUBRIC, again.model(cache_path=cache)).judge([record])
    assert len(again.requests) == 1 and second.score == 0.8 and second.data["calls"][0]["cached"] is False
    # a malformed answer in a cache file (an older version wrote it) is asked again too
    clear_cache()
    model = again.model(cache_path=cache)
    chatty = RECORDED["pointwise_chatty"]["body"]["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": "score this"}]
    with cache.open("a") as out:
        out.write(json.dumps({"key": model.cache_key(messages), "answer": chatty, "usage": {}}) + "\n")
    asked = await model.call(messages, valid=lambda answer: answer != chatty)
    assert asked.cached is False and len(again.requests) == 2 and asked.answer != chatty
    replayed = await model.call(messages, valid=lambda answer: answer != chatty)  # the new answer, kept
    assert replayed.cached is True and replayed.answer == asked.answer and len(again.requests) == 2


def test_the_cache_key_is_the_judges_whole_identity() -> None:
    messages = [{"role": "user", "content": "score this"}]
    base = JudgeModel(URL, "m").cache_key(messages)
    others = [
        JudgeModel(URL + "/other", "m").cache_key(messages),
        JudgeModel(URL, "m2").cache_key(messages),
        JudgeModel(URL, "m", max_tokens=10).cache_key(messages),
        JudgeModel(URL, "m", temperature=0.5).cache_key(messages),
        JudgeModel(URL, "m").cache_key([{"role": "user", "content": "score that"}]),
        JudgeModel(URL, "m").cache_key([{"role": "system", "content": "rubric"}, *messages]),
    ]
    assert base not in others and len(set(others)) == len(others)
    assert JudgeModel(URL, "m", api_key="another key", timeout=5).cache_key(messages) == base
