"""Human scoring in the dashboard, end to end in headless Chromium against a real server: a
person holding a reviewer token scores three rollouts in the review page while an algorithm
waits for those scores (``wait_for_rewards``, then ``resolve``, from agentbolt.algorithms.rewards)
and gets them; SFT (reward="human", reward_wait) waits for a person's scores of its batch, given
in the page, and keeps the runs the person passed; a rescore keeps the history; a score given meanwhile is refused with who gave it;
a read-only token gets no form, and a refused score says why. The rollout page shows every
named reward with its source, state, scale, a judge's reason, calls and cut, and its history."""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_browser import assert_contrast, expect, shoot
from dashboard_data import awaiting_review
from rich.console import Console

from agentbolt import Trainer
from agentbolt.algorithms.rewards import resolve, wait_for_rewards
from agentbolt.client import Client
from agentbolt.evaluators import HumanReview
from agentbolt.runner.worker import Runner
from agentbolt.schemas import (
    AttemptStatus,
    AwaitedReward,
    Mode,
    RewardCreate,
    RewardScale,
    RewardSource,
    RewardState,
    Rollout,
    RolloutCreate,
    Task,
)
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.algorithms.test_reward_training import BINARY, _sft, _sft_tasks
from tests.algorithms.training_agents import scripted

TOKENS = {"admintok": Role.ADMIN, "readtok": Role.READER, "alicetok": Role.REVIEWER, "runnertok": Role.RUNNER}
NAMES = {"alicetok": "alice"}
ANSWERS = ["The product is 391.", "It is 414, I think.", "437"]
SCORES = [5, 3, 1]  # on 1-5: values 1, 0.5 and 0 (a real 0, not a pending one)


@pytest.fixture
def review_server(tmp_path: Path) -> Iterator[ServerThread]:
    config = ServerConfig(
        db=str(tmp_path / "review.db"), tokens=TOKENS, token_names=NAMES, lease_seconds=3600
    )
    server = ServerThread(config).start()
    try:
        yield server
    finally:
        server.stop()
        server.app.state.store.close()


def _selected(page: Any, rollout_id: str) -> Any:
    selected = page.locator(f"[data-testid=review-selected][data-rollout='{rollout_id}']")
    expect(selected).to_be_visible()
    return selected


def _score(page: Any, score: int, comment: str, *, double: bool = False) -> None:
    form = page.get_by_test_id("score-form-human")
    form.get_by_role("button", name=str(score), exact=True).click()
    expect(form.get_by_role("button", name=str(score), exact=True)).to_have_attribute("aria-pressed", "true")
    form.get_by_label("Comment (optional)").fill(comment)
    submit = form.get_by_role("button", name=re.compile("^Submit"))
    if double:
        submit.dblclick()
    else:
        submit.click()


def test_a_reviewer_scores_three_rollouts_and_the_algorithm_picks_the_rewards_up(
    open_page: Any, review_server: ServerThread
) -> None:
    ids = awaiting_review(review_server.url, "admintok", ANSWERS)
    waited: list[Rollout] = []
    with Client(review_server.url, token="readtok") as reader:
        batch = [reader.get_rollout(i) for i in ids]
        assert all(resolve(r, "human").state == "pending" for r in batch)  # pending, not 0

    def algorithm() -> None:  # what SFT / APO do with reward_wait: wait for the human scores
        with Client(review_server.url, token="readtok") as client:
            waited.extend(wait_for_rewards(client, batch, ["human"], timeout=120, poll=0.5))

    waiting = threading.Thread(target=algorithm, daemon=True)
    waiting.start()

    page = open_page(token="alicetok")
    posts: list[tuple[str, str | None]] = []
    page.on(
        "request",
        lambda r: posts.append((r.url, r.headers.get("idempotency-key"))) if r.method == "POST" else None,
    )
    page.goto(f"{review_server.url}/#/review")
    expect(page.get_by_test_id("review-count")).to_have_text("3 awaiting a score")
    expect(page.locator("#server-info")).to_contain_text("alice")
    assert page.locator("[data-nav=review][aria-current=page]").count() == 1

    for i, (rid, answer, score) in enumerate(zip(ids, ANSWERS, SCORES, strict=True)):
        selected = _selected(page, rid)
        expect(selected.get_by_test_id("review-answer")).to_have_text(answer)
        expect(selected.locator("#trace li.ev-llm_call")).to_have_count(
            1
        )  # the trace, as on the rollout page
        if i == 0:
            shoot(page, "review-queue")
            assert_contrast(page)
        _score(page, score, f"reviewed #{i + 1}", double=i == 0)  # a double click on the first
        expect(page.get_by_test_id("review-flash")).to_contain_text(
            f"Scored {score} for “human” of {rid} (revision 1)"
        )
        if i == 0:
            assert_contrast(page)  # the note that it was stored
    expect(page.get_by_text("Nothing to review")).to_be_visible()
    expect(page.get_by_test_id("review-count")).to_have_text("0 awaiting a score")

    waiting.join(60)
    assert not waiting.is_alive()
    resolved = [resolve(r, "human") for r in waited]
    assert [(r.state, r.value) for r in resolved] == [("ok", 1.0), ("ok", 0.5), ("ok", 0.0)]
    for r, score, i in zip(waited, SCORES, range(3), strict=True):
        slot = r.rewards["human"]
        assert (slot.score, slot.author, slot.comment, slot.revision) == (
            score,
            "alice",
            f"reviewed #{i + 1}",
            1,
        )
    # one key per form: the double click sent nothing new, and each rollout had a key of its own
    assert len({key for _, key in posts}) == 3 and all(key for _, key in posts)
    with Client(review_server.url, token="readtok") as reader:
        assert [len(reader.reward_history(i, "human")) for i in ids] == [1, 1, 1]


def test_rescore_keeps_history_and_a_score_given_meanwhile_is_refused_with_who(
    open_page: Any, review_server: ServerThread
) -> None:
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1])
    with Client(review_server.url, token="alicetok") as alice:
        alice.add_reward(rid, RewardCreate(name="human", score=2, comment="first look", replaces=0))
    page = open_page(token="alicetok")
    page.goto(f"{review_server.url}/#/review?rollout={rid}&name=human")
    form = page.get_by_test_id("score-form-human")
    expect(form).to_contain_text("Rescore “human”")
    expect(form).to_contain_text("revision 1")
    _score(page, 4, "on second reading")
    expect(page.get_by_test_id("review-flash")).to_contain_text("(revision 2)")
    history = page.locator("#review-slot-human [data-testid=reward-history] tbody tr")
    expect(history).to_have_count(2)
    expect(history.first).to_contain_text("on second reading")
    expect(history.nth(1)).to_contain_text("first look")

    # Someone else scores while this page shows revision 2 (updates paused, so it cannot know).
    page.get_by_role("button", name="Pause updates").click()
    with Client(review_server.url, token="admintok") as admin:
        admin.add_reward(rid, RewardCreate(name="human", score=1, replaces=2, author="bob"))
    _score(page, 5, "too late")
    flash = page.get_by_test_id("review-flash")
    expect(flash).to_contain_text("scored meanwhile")
    expect(flash).to_contain_text("revision 3 by bob")
    expect(form).to_contain_text("revision 3")  # reloaded: bob's score is shown
    with Client(review_server.url, token="readtok") as reader:
        assert [r.score for r in reader.reward_history(rid, "human")] == [2, 4, 1]  # nothing lost or doubled


def test_the_rollout_page_shows_every_named_reward_and_its_history(
    open_page: Any, review_server: ServerThread
) -> None:
    judge = AwaitedReward(name="judge", source=RewardSource.EVALUATOR)
    later = AwaitedReward(name="group_judge", source=RewardSource.EVALUATOR)
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1], extra=[judge, later])
    call = {
        "request": [{"role": "user", "content": "Rate this answer: The product is 391."}],
        "answer": "SCORE: 0.8\nREASON: correct and clearly stated.",
        "usage": {"prompt_tokens": 120, "completion_tokens": 14},
        "latency_s": 0.42,
        "cost_usd": None,
        "cached": False,
    }
    data = {
        "reason": "correct and clearly stated.",
        "calls": [call],
        "judge": {"model": "judge-model", "base_url": "http://127.0.0.1:9/v1"},
        "cut": {"chars_before": 9000, "chars_after": 6000, "turns_cut": 3, "chars_cut": 3000},
    }
    with Client(review_server.url, token="admintok") as admin:
        admin.add_reward(
            rid, RewardCreate(name="judge", score=0.8, replaces=0, data=data, author="pointwise")
        )
    with Client(review_server.url, token="alicetok") as alice:
        alice.add_reward(rid, RewardCreate(name="human", score=3, replaces=0, comment="fine"))
        alice.add_reward(
            rid, RewardCreate(name="human", score=4, replaces=1, comment="better than I thought")
        )

    page = open_page(token="readtok", color_scheme="light")
    page.goto(f"{review_server.url}/#/rollouts/{rid}")
    rewards = page.locator("#rewards")
    rows = {
        n: rewards.locator(f"tr[data-key='reward-{n}'] td")
        for n in ("agent", "human", "judge", "group_judge")
    }
    expect(rows["agent"].nth(2)).to_have_text("none")  # the agent gave no reward of its own
    expect(rows["human"]).to_have_text(["human", "reviewer", "Scored", "4 of 1–5", "0.75", "alice", "2"])
    expect(rows["judge"]).to_have_text(
        ["judge", "evaluator", "Scored", "0.8 of 0–1", "0.8", "pointwise", "1"]
    )
    # pending is shown as pending, never as 0
    expect(rows["group_judge"]).to_have_text(
        ["group_judge", "evaluator", "Pending", "pending", "—", "—", "0"]
    )

    slot = page.get_by_test_id("reward-slot-judge")
    slot.locator(":scope > summary").click()
    expect(slot.get_by_test_id("reward-reason")).to_contain_text("correct and clearly stated.")
    expect(slot.get_by_test_id("reward-cut")).to_contain_text(
        "cut from 9,000 to 6,000 characters; 3 middle turns"
    )
    calls = slot.get_by_test_id("reward-calls")
    expect(calls).to_contain_text("120 → 14 (134)")
    expect(calls).to_contain_text("0.42 s")
    expect(calls).to_contain_text("unknown")  # no price given: the cost is not made up
    calls.locator("summary").click()
    expect(calls).to_contain_text("SCORE: 0.8")
    expect(slot).to_contain_text("judge-model at http://127.0.0.1:9/v1")

    human = page.get_by_test_id("reward-slot-human")
    human.locator(":scope > summary").click()
    expect(human.locator("[data-testid=reward-history] tbody tr")).to_have_count(2)
    expect(human.get_by_role("link", name="Rescore in the review page")).to_have_attribute(
        "href", f"#/review?rollout={rid}&name=human"
    )
    shoot(page, "rollout-rewards")
    assert_contrast(page)

    # the page keeps polling while a reward is pending: a late judge score appears by itself
    with Client(review_server.url, token="admintok") as admin:
        admin.add_reward(rid, RewardCreate(name="group_judge", score=0.25, replaces=0))
    expect(rows["group_judge"].nth(2)).to_have_text("Scored", timeout=8000)


def test_a_failed_run_s_awaited_reward_reads_not_scored_not_pending(
    open_page: Any, review_server: ServerThread
) -> None:
    """A run that failed keeps its awaited slot pending (nothing to judge): the page says it will
    not be scored instead of showing it as pending, and it is not in the review queue."""
    awaited = AwaitedReward(name="human", source=RewardSource.REVIEWER)
    with Client(review_server.url, token="admintok") as admin:
        [ro] = admin.enqueue([RolloutCreate(task=Task(data={"question": "2+2?"}), await_rewards=[awaited])])
        claim = admin.dequeue("review-runner")
        assert claim is not None and claim.rollout.id == ro.id
        admin.finish(claim.attempt.id, AttemptStatus.FAILED, error="boom", worker_id=claim.attempt.worker_id)
        assert admin.get_rollout(ro.id).rewards["human"].state == "pending"
        assert ro.id not in {r.id for r in admin.pending_rewards(name="human").items}

    page = open_page(token="readtok")
    page.goto(f"{review_server.url}/#/rollouts/{ro.id}")
    row = page.locator("#rewards tr[data-key='reward-human'] td")
    expect(row.nth(2)).to_have_text("not scored: the run did not succeed")
    expect(page.locator("#rewards")).not_to_contain_text("pending (not counted as 0)")


def test_a_reader_sees_no_form_and_a_refused_score_says_why(
    open_page: Any, review_server: ServerThread
) -> None:
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1])
    reader = open_page(token="readtok", color_scheme="light")
    reader.goto(f"{review_server.url}/#/review")
    _selected(reader, rid)
    expect(reader.get_by_test_id("review-readonly")).to_contain_text("reader token")
    assert reader.locator("form.score-form").count() == 0
    assert_contrast(reader)

    # A page opened with a reviewer token whose token is swapped for a reader's: the server refuses.
    page = open_page(token="alicetok")
    page.goto(f"{review_server.url}/#/review")
    _selected(page, rid)
    page.evaluate("localStorage.setItem('agentbolt.token', 'readtok')")
    _score(page, 4, "")
    flash = page.get_by_test_id("review-flash")
    expect(flash).to_contain_text("Not a reviewer token")
    expect(flash).to_contain_text("not a reviewer token, so it cannot score")
    assert_contrast(page)
    with Client(review_server.url, token="readtok") as client:
        assert client.get_rollout(rid).rewards["human"].state == RewardState.PENDING


def test_a_scale_without_steps_takes_a_number_checked_before_it_is_sent(
    open_page: Any, review_server: ServerThread
) -> None:
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1], name="quality", scale=RewardScale())
    page = open_page(token="alicetok")
    page.goto(f"{review_server.url}/#/review?name=quality")
    _selected(page, rid)
    field = page.get_by_test_id("score-form-quality").get_by_label("Score", exact=True)
    field.fill("1.5")
    field.press("Enter")
    expect(page.get_by_test_id("review-flash")).to_contain_text("Score 1.5 is outside the scale 0 to 1.")
    field.fill("0.7")
    field.press("Enter")
    expect(page.get_by_test_id("review-flash")).to_contain_text("Scored 0.7 for “quality”")
    with Client(review_server.url, token="readtok") as reader:
        slot = reader.get_rollout(rid).rewards["quality"]
    assert (slot.score, slot.value, slot.author, slot.revision) == (0.7, 0.7, "alice", 1)


def test_sft_trains_on_the_scores_a_reviewer_gives_in_the_review_page(
    open_page: Any, review_server: ServerThread, tmp_path: Path
) -> None:
    """SFT (reward="human", reward_wait) runs a batch of 8 rollouts of a scripted agent and waits;
    a person scores each in the review page, the opposite of the agent's own reward; SFT then
    keeps the runs the person passed, not those the agent rewarded."""
    algo = _sft(rounds=1, reward="human", evaluators=[HumanReview("human", BINARY)], reward_wait=120)
    trainer = Trainer(
        algo,
        n_runners=0,
        server_url=review_server.url,
        token="admintok",
        run_dir=tmp_path / "run",
        console=Console(file=io.StringIO()),
    )
    runner = Runner(scripted, review_server.url, token="admintok", concurrency=4)
    running = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
    results: list[Any] = []
    training = threading.Thread(
        target=lambda: results.append(trainer.fit(scripted, _sft_tasks())), daemon=True
    )
    running.start()
    training.start()
    try:
        page = open_page(token="alicetok")
        page.goto(f"{review_server.url}/#/review")
        selected = page.get_by_test_id("review-selected")
        done: list[str] = []
        with Client(review_server.url, token="readtok") as reader:
            for _ in range(8):
                expect(selected).to_be_visible(timeout=60_000)
                for rid in done[-1:]:
                    expect(selected).not_to_have_attribute("data-rollout", rid, timeout=15_000)
                rid = selected.get_attribute("data-rollout")
                assert rid is not None and rid not in done
                score = 1 - reader.get_rollout(rid).task.data["reward"]  # the agent's reward, inverted
                _score(page, score, "")
                expect(page.get_by_test_id("review-flash")).to_contain_text(
                    f"Scored {score} for “human” of {rid}"
                )
                done.append(rid)
        expect(page.get_by_text("Nothing to review")).to_be_visible()
        training.join(120)
        assert not training.is_alive() and results
    finally:
        runner.stop()
        running.join(20)

    [first] = results[0].rounds
    assert (first.rollouts, first.reward_pending, first.kept, first.train_reward) == (8, 0, 4, 0.5)
    assert first.rows == 2 and first.train is not None  # trained on the runs the person passed
    with Client(review_server.url, token="readtok") as reader:
        train = reader.list_rollouts(mode=Mode.TRAIN, limit=100).items
    assert {(r.task.id, r.rewards["human"].value, r.rewards["human"].author) for r in train} == {
        ("t0", 1.0, "alice"),
        ("t1", 0.0, "alice"),
        ("t2", 1.0, "alice"),
        ("t3", 0.0, "alice"),
    }
