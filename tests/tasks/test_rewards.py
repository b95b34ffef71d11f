"""Each built-in task's reward on hand-made transcripts: the right play, and near misses that a
lenient scorer would pass (extra text, a right number without the tool, a skipped step)."""

from __future__ import annotations

import pytest

from agentbolt.tasks import TASKS
from agentbolt.tasks.calculator import score
from agentbolt.tasks.chain import STEP_REWARD, ChainEpisode
from agentbolt.tasks.guess import GuessEpisode

CALC_TASK = {"question": "What is 23 + 19?", "expression": "23 + 19", "answer": 42}


@pytest.mark.parametrize(
    ("replies", "reward"),
    [
        (["CALC: 23 + 19", "ANSWER: 42"], 1.0),
        (["CALC:23+19", "ANSWER:  42"], 1.0),  # spacing is free
        (["  CALC: 23 + 19\n", "ANSWER: 42 "], 1.0),  # surrounding whitespace is not text
        (["CALC: 23 + 19", "ANSWER: 41"], 0.2),  # the tool call was right, the answer not
        (["CALC: 23 + 19"], 0.2),  # no answer
        (["CALC: 23 + 19", "The answer is 42"], 0.2),  # not the answer format
        (["CALC: 23 + 19", "ANSWER: 42 because 23 + 19 = 42"], 0.2),  # extra text
        (["ANSWER: 42"], 0.0),  # the right number without the tool
        (["CALC: 19 + 23", "ANSWER: 42"], 0.0),  # not the question's expression
        (["Let me compute. CALC: 23 + 19", "ANSWER: 42"], 0.0),  # text before the call
        (["CALC: 23 + 19\nRESULT: 42", "ANSWER: 42"], 0.0),  # an invented tool result
        ([], 0.0),
    ],
)
def test_calculator_score_is_strict(replies: list[str], reward: float) -> None:
    assert score(CALC_TASK, replies) == reward


def test_calculator_episode_ends_after_a_reply_that_is_not_a_call() -> None:
    episode = TASKS["calculator"].episode(CALC_TASK)
    turn = episode.step("The answer is 42")
    assert turn.observation is None
    assert episode.outcome() == 0.0


def test_calculator_episode_runs_the_call_and_ends_after_the_answer() -> None:
    episode = TASKS["calculator"].episode(CALC_TASK)
    first = episode.step("CALC: 23 + 19")
    assert first.observation == "RESULT: 42"
    assert first.tool is not None and first.tool.result == 42
    assert episode.step("ANSWER: 42").observation is None
    assert episode.outcome() == 1.0


CHAIN_TASK = {"start": 74, "ops": [["-", 14], ["+", 56], ["*", 2]], "answer": 232}


def _play(replies: list[str]) -> tuple[ChainEpisode, list[str | None], list[float]]:
    episode = ChainEpisode(dict(CHAIN_TASK))
    observations, rewards = [], []
    for reply in replies:
        turn = episode.step(reply)
        observations.append(turn.observation)
        rewards.append(turn.step_reward)
        if turn.observation is None:
            break
    return episode, observations, rewards


def test_chain_right_play_earns_a_step_reward_per_call_and_the_outcome() -> None:
    episode, observations, rewards = _play(["CALC: 74 - 14", "CALC: 60 + 56", "CALC: 116 * 2", "ANSWER: 232"])
    assert episode.opening() == "Start with 74. Subtract 14."
    assert observations == [
        "RESULT: 60. Then add 56.",
        "RESULT: 116. Then multiply by 2.",
        "RESULT: 232. What is the final result?",
        None,
    ]
    assert rewards == [STEP_REWARD, STEP_REWARD, STEP_REWARD, 0.0]
    assert episode.outcome() == 1.0


def test_chain_states_name_the_situation_not_the_wording() -> None:
    a, b = ChainEpisode(dict(CHAIN_TASK)), ChainEpisode(dict(CHAIN_TASK))
    assert a.state() == b.state()
    a.step("CALC: 74 - 14")
    b.step("CALC:74-14")
    assert a.state() == b.state() == "done=1 shown=60 asked=add 56."
    b2 = ChainEpisode(dict(CHAIN_TASK))
    b2.step("CALC: 74 + 14")  # a wrong step leads elsewhere
    assert b2.state() != a.state()
    # the same value shown with another instruction is another situation: 60 shown after one
    # wrong call (asked for step 2) or after two (asked for step 3)
    c, d = ChainEpisode(dict(CHAIN_TASK)), ChainEpisode(dict(CHAIN_TASK))
    c.step("CALC: 30 + 30")
    d.step("CALC: 1 + 1")
    d.step("CALC: 30 + 30")
    assert c.state() == "done=0 shown=60 asked=add 56."
    assert d.state() == "done=0 shown=60 asked=multiply by 2."


@pytest.mark.parametrize(
    ("replies", "rewards"),
    [
        # the right number without the last tool call
        (["CALC: 74 - 14", "CALC: 60 + 56", "ANSWER: 232"], [STEP_REWARD, STEP_REWARD, 0.0]),
        # a wrong middle step: the later calls compute from the wrong value, no reward
        (["CALC: 74 - 14", "CALC: 60 - 56", "CALC: 4 * 2", "ANSWER: 232"], [STEP_REWARD, 0.0, 0.0, 0.0]),
        # extra text in the answer
        (
            ["CALC: 74 - 14", "CALC: 60 + 56", "CALC: 116 * 2", "ANSWER: 232."],
            [STEP_REWARD, STEP_REWARD, STEP_REWARD, 0.0],
        ),
        # two operations in one call: refused by the tool, the episode goes on, no reward
        (["CALC: 74 - 14 + 56", "CALC: 74 - 14"], [0.0, STEP_REWARD]),
        # text around a call ends the episode
        (["Sure! CALC: 74 - 14"], [0.0]),
        # the same right call twice earns once
        (["CALC: 74 - 14", "CALC: 74 - 14"], [STEP_REWARD, 0.0]),
    ],
)
def test_chain_near_misses_fail(replies: list[str], rewards: list[float]) -> None:
    episode, _, got = _play(replies)
    assert got == rewards
    assert episode.outcome() == 0.0


def test_chain_refused_call_says_why_and_the_episode_ends_after_its_turns() -> None:
    episode, observations, _ = _play(["CALC: 74 - 14 + 56"] * 10)
    assert observations[0] is not None and "one operation per call" in observations[0]
    assert len(episode.replies) == episode.max_turns == 5
    assert observations[-1] is None


GUESS_TASK = {"low": 10, "high": 30, "secret": 17}


def test_guess_bisection_wins_with_a_step_reward_per_consistent_guess() -> None:
    episode = GuessEpisode(dict(GUESS_TASK))
    assert episode.opening() == "Find the hidden number from 10 to 30."
    turns = [episode.step(r) for r in ("GUESS: 20", "GUESS: 15", "GUESS: 17")]
    assert [t.observation for t in turns] == ["LOWER", "HIGHER", None]
    assert [t.step_reward for t in turns] == [0.1, 0.1, 0.1]
    assert episode.state() == "16-19"
    assert episode.outcome() == 1.0


def test_guess_near_misses() -> None:
    episode = GuessEpisode(dict(GUESS_TASK))
    episode.step("GUESS: 20")  # LOWER: the open range is 10-19
    assert episode.step("GUESS: 25").step_reward == 0.0  # inconsistent with the hint
    assert episode.step("GUESS: 20").step_reward == 0.0  # a repeat
    assert episode.step("GUESS: 12").step_reward == 0.1
    last = episode.step("GUESS: 13")
    assert last.observation is None  # five guesses used
    assert episode.outcome() == 0.0
    chatty = GuessEpisode(dict(GUESS_TASK))
    assert chatty.step("I guess 17").observation is None
    assert chatty.outcome() == 0.0
    found_with_text = GuessEpisode(dict(GUESS_TASK))
    found_with_text.step("GUESS: 17 is my guess")
    assert found_with_text.outcome() == 0.0
