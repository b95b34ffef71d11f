"""Environments other projects wrote, as task sources: reasoning-gym's datasets scored by their
own scorers, Gymnasium's toy-text environments stepped through their own API; specs, splits,
scoring, episodes and errors, without a model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbolt.cli.main import app
from agentbolt.errors import MissingExtra
from agentbolt.tasks import get_task, split_of
from agentbolt.tasks.base import TextGameAgent
from agentbolt.tasks.external import parse_spec, spec_tasks
from tests.conftest import IN_CI

if not all(importlib.util.find_spec(m) for m in ("reasoning_gym", "gymnasium")):
    if IN_CI:  # the envs extra is a test dependency (scripts/install.sh): missing is a failure
        raise ImportError("reasoning-gym and gymnasium are required in CI: pip install 'agentbolt[envs]'")
    pytest.skip("needs pip install 'agentbolt[envs]'", allow_module_level=True)

import gymnasium  # noqa: E402
import reasoning_gym  # noqa: E402

from agentbolt.tasks.gymnasium_text import GymEpisode  # noqa: E402
from agentbolt.tasks.reasoning_gym import extract_answer, score  # noqa: E402

SPELL = "reasoning_gym:spell_backward?max_word_len=4"
SUMS = "reasoning_gym:chain_sum?max_terms=2&max_digits=2"
LAKE = "gymnasium:FrozenLake-v1"
# gymnasium's own 4x4 map: DOWN DOWN RIGHT RIGHT DOWN RIGHT walks from S to G on frozen cells
CLASSIC = ["SFFF", "FHFH", "FFFH", "HFFG"]


def _content(task_data: dict) -> str:
    return f"{task_data['question']}\n{task_data['answer']}"


# ---------------------------------------------------------------------------- specs


def test_a_spec_names_source_task_options_and_the_draw() -> None:
    spec = parse_spec("reasoning_gym:spell_backward?max_word_len=4&size=10&seed=3&max_tokens=20")
    assert (spec.source, spec.name, spec.options) == ("reasoning_gym", "spell_backward", {"max_word_len": 4})
    assert (spec.size, spec.seed, spec.max_tokens) == (10, 3, 20)
    assert spec.label == "reasoning_gym:spell_backward?max_word_len=4&max_tokens=20"
    lake = parse_spec("gymnasium:FrozenLake-v1?p=0.9&is_slippery=true")
    assert lake.options == {"p": 0.9, "is_slippery": True} and lake.size is None
    task = get_task("reasoning_gym:spell_backward?max_word_len=4&max_tokens=20")
    assert task.max_tokens == 20 and task.name == "reasoning_gym:spell_backward?max_word_len=4&max_tokens=20"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reasoning_gym:", "name the reasoning_gym task"),
        ("reasoning_gym:spell_backward?size=0", "size must be a whole number of at least 1"),
        ("reasoning_gym:spell_backward?seed=x", "seed must be a whole number"),
        ("reasoning_gym:spell_backward?max_word_len", "write the options as ?name=value"),
        ("reasoning_gym:spell_backward?max_word_len=3&max_word_len=4", "given twice"),
        (
            "reasoning_gym:spel_backward",
            "unknown reasoning-gym dataset 'spel_backward'; did you mean spell_backward",
        ),
        (
            "reasoning_gym:spell_backward?max_len=4",
            "no option 'max_len'; its options: data_file, max_word_len",
        ),
        ("reasoning_gym:spell_backward?max_word_len=long", "max_word_len expects a whole number, got 'long'"),
        (
            "reasoning_gym:spell_backward?min_word_len=5&max_word_len=4",
            "max_word_len must be >= min_word_len",
        ),
        ("gymnasium:CartPole-v1", "not an environment agentbolt plays as text; choose one of: FrozenLake-v1"),
        ("gymnasium:FrozenLake-v2", "did you mean FrozenLake-v1"),
        ("gymnasium:FrozenLake-v1?is_slippery=1", "is_slippery expects true or false"),
        ("gymnasium:Blackjack-v1?max_turns=0", "max_turns must be at least 1"),
        ("agentbolt:calculater", "no such task; agentbolt's own: calculator, chain, guess"),
        ("agentbolt:calculator?digits=3", "take size, seed and max_tokens only"),
    ],
)
def test_a_bad_spec_says_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        get_task(spec)
    assert message in str(caught.value)


def test_a_task_name_that_is_neither_built_in_nor_a_spec_lists_both() -> None:
    with pytest.raises(ValueError, match=r"calculator, chain, guess, or a spec: reasoning_gym:<dataset>"):
        get_task("reasoning-gym:spell_backward")


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gymnasium" else real(name, *a)
    )
    with pytest.raises(MissingExtra, match=r"gymnasium is not installed\): pip install 'agentbolt\[envs\]'"):
        get_task(LAKE)


# ---------------------------------------------------------------------------- splits


@pytest.mark.parametrize("spec", [SPELL, LAKE])
def test_heldout_items_never_occur_in_training_whatever_the_seeds(spec: str) -> None:
    task = get_task(spec)
    train = [t for seed in range(3) for t in task.make_tasks(64, seed, "train")]
    heldout = [t for seed in range(3) for t in task.make_tasks(32, seed, "heldout")]
    assert not {t.id for t in train} & {t.id for t in heldout}
    key = _content if spec == SPELL else (lambda data: "/".join(data["make"]["desc"]))
    assert not {key(t.data) for t in train} & {key(t.data) for t in heldout}
    # generators repeat items: within one draw every item is distinct anyway
    assert all(len({key(t.data) for t in task.make_tasks(64, s, "train")}) == 64 for s in range(3))


def test_splits_hold_across_configs_and_are_reproducible() -> None:
    small, large = get_task(SPELL), get_task("reasoning_gym:spell_backward?max_word_len=5")
    small_heldout = {_content(t.data) for t in small.heldout_tasks(48, seed=2)}
    assert not small_heldout & {_content(t.data) for t in large.train_tasks(256, seed=1)}
    assert all(split_of(c) == "heldout" for c in small_heldout)
    first, again, other = (small.heldout_tasks(32, seed=s) for s in (2, 2, 3))
    assert [t.id for t in first] == [t.id for t in again] and [t.id for t in first] != [t.id for t in other]
    # one word under two configs is two tasks: a server keeps a task id's data for good
    small_ids = {_content(t.data): t.id for t in small.heldout_tasks(48, seed=2)}
    large_ids = {_content(t.data): t.id for t in large.heldout_tasks(120, seed=2)}
    common = small_ids.keys() & large_ids.keys()
    assert common and all(small_ids[c] != large_ids[c] for c in common)


def test_the_same_seed_draws_the_same_items_in_every_process() -> None:
    """isomorphic_strings' generator iterates over sets, whose order follows the per-process
    string hashing: two interpreters with different hash seeds still get the same tasks."""
    script = (
        "from agentbolt.tasks.reasoning_gym import make_tasks; "
        "print([t.id for t in make_tasks('isomorphic_strings', {}, 8, 2, 'heldout')])"
    )
    drawn = [
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(Path(__file__).parents[2])},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("1", "2", "random")
    ]
    assert drawn[0] == drawn[1] == drawn[2] and drawn[0].count("rg-isomorphic_strings-heldout-") == 8


def test_the_worked_example_is_from_the_training_split() -> None:
    task = get_task(SPELL)
    question, answer = task.worked[0]["content"], task.worked[1]["content"].removeprefix("ANSWER: ")
    assert split_of(f"{question}\n{answer}") == "train"
    lake = get_task(LAKE)
    opening = lake.worked[0]["content"].replace("P", "S", 1)
    assert split_of("FrozenLake-v1 " + "/".join(opening.replace(" ", "").splitlines())) == "train"


def test_spec_tasks_draws_size_from_seed_and_the_data_travels_as_json() -> None:
    task, tasks = spec_tasks(f"{SPELL}&size=5&seed=7", "heldout")
    again = spec_tasks(f"{SPELL}&seed=7&size=5", "heldout")[1]
    assert len(tasks) == 5 and [t.id for t in tasks] == [t.id for t in again]
    assert all(t.id.startswith("rg-spell_backward-") and "-heldout-" in t.id for t in tasks)
    for t in [*tasks, *spec_tasks(f"{LAKE}?size=3", "train")[1]]:
        assert json.loads(json.dumps(t.data)) == t.data


def test_agentbolts_own_tasks_are_specs_too() -> None:
    """``agentbolt:calculator?size=N`` draws the built-in task's own tasks, as its methods do."""
    task, tasks = spec_tasks("agentbolt:calculator?size=6&seed=3", "train")
    assert task is get_task("calculator") and get_task("agentbolt:calculator") is task
    assert [t.id for t in tasks] == [t.id for t in task.train_tasks(6, seed=3)]
    held = spec_tasks("agentbolt:calculator?size=4", "heldout")[1]
    assert [t.id for t in held] == [t.id for t in task.heldout_tasks(4, seed=2)]
    assert not {t.id for t in held} & {t.id for t in task.train_tasks(256, seed=1)}


# ---------------------------------------------------------------------------- reasoning-gym


def test_the_answer_line_goes_exactly_to_the_datasets_own_scorer() -> None:
    task = get_task(SPELL)
    [item] = task.heldout_tasks(1, seed=4)
    data = json.loads(json.dumps(item.data))
    right = task.episode(data)
    right.step(f"Let me think.\nANSWER: {data['answer']}\n")
    assert right.outcome() == 1.0
    silent = task.episode(data)
    silent.step(f"{data['answer']}")  # no ANSWER line: the scorer sees None
    assert silent.answer is None and silent.outcome() == 0.0
    near = data["answer"][:-1] + "#"  # spell_backward gives partial credit: the dataset decides
    ours = task.episode(data)
    ours.step(f"ANSWER: {near}")
    dataset = reasoning_gym.create_dataset("spell_backward", max_word_len=4)
    theirs = dataset.score_answer(near, {k: data[k] for k in ("question", "answer", "metadata")})
    assert 0.0 < theirs < 1.0 and ours.outcome() == pytest.approx(theirs)


def test_a_wrong_answer_scores_zero_and_a_raising_scorer_too() -> None:
    task = get_task(SUMS)
    [item] = task.train_tasks(1, seed=0)
    wrong = task.episode(item.data)
    wrong.step(f"ANSWER: {int(item.data['answer']) + 1000}")
    assert wrong.outcome() == 0.0
    [factor] = get_task("reasoning_gym:prime_factorization").train_tasks(1)
    assert score(factor.data, "not a number") == 0.0  # its scorer raises ValueError on this
    assert score(factor.data, factor.data["answer"]) == 1.0


def test_extract_answer_takes_the_first_answer_line() -> None:
    assert extract_answer("ANSWER:  enoc  \nANSWER: x") == "enoc"
    assert extract_answer("so the answer is\nANSWER:\n") == ""
    assert extract_answer("no line here") is None


# ---------------------------------------------------------------------------- Gymnasium


def _lake(desc: list[str], **options: object) -> GymEpisode:
    return GymEpisode({"env": "FrozenLake-v1", "options": options, "seed": 0, "make": {"desc": desc}})


def test_a_scripted_frozen_lake_episode_reaches_the_goal_with_the_envs_rewards() -> None:
    episode = _lake(CLASSIC)
    assert episode.opening() == "P F F F\nF H F H\nF F F H\nH F F G" == episode.state()
    turns = [episode.step(f"ACTION: {a}") for a in ("DOWN", "down", "RIGHT", "RIGHT", "DOWN", "RIGHT")]
    assert [t.step_reward for t in turns] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert turns[0].observation == "S F F F\nP H F H\nF F F H\nH F F G"
    assert turns[-1].observation is None and all(t.observation for t in turns[:-1])
    assert episode.outcome() == 1.0


def test_a_hole_an_illegal_reply_and_running_out_of_turns_score_zero() -> None:
    hole = _lake(CLASSIC)
    hole.step("ACTION: DOWN")
    end = hole.step("ACTION: RIGHT")  # (1, 1) is a hole: the environment terminates
    assert end.observation is None and end.step_reward == 0.0 and hole.outcome() == 0.0
    for reply in ("ACTION: JUMP", "I will go right", "ACTION: RIGHT\nACTION: DOWN"):
        illegal = _lake(CLASSIC)
        assert illegal.step(reply).observation is None and illegal.outcome() == 0.0
    short = _lake(CLASSIC, max_turns=2)
    assert short.max_turns == 2
    assert short.step("ACTION: LEFT").observation is not None
    assert short.step("ACTION: LEFT").observation is None and short.outcome() == 0.0


def test_blackjack_rewards_and_wins_are_the_environments_own() -> None:
    env = gymnasium.make("Blackjack-v1")
    outcomes = set()
    for seed in range(8):
        _, _ = env.reset(seed=seed)
        _, reward, terminated, _, _ = env.step(0)
        episode = GymEpisode({"env": "Blackjack-v1", "options": {}, "seed": seed})
        turn = episode.step("ACTION: STICK")
        assert terminated and turn.observation is None and turn.step_reward == reward
        assert episode.outcome() == (1.0 if reward > 0 else 0.0)
        outcomes.add(episode.outcome())
    assert outcomes == {0.0, 1.0}


def test_taxi_plays_through_gymnasium_and_its_worked_episode_delivers() -> None:
    task = get_task("gymnasium:Taxi-v4")
    assert "ACTION: PICKUP" in [m["content"] for m in task.worked]
    assert task.worked[-2]["content"] == "ACTION: DROPOFF" and task.worked[-1]["content"].startswith(
        "You succeeded"
    )
    env = gymnasium.make("Taxi-v4")
    for item in task.heldout_tasks(4, seed=0):
        episode = task.episode(item.data)
        assert "Passenger: waiting at" in episode.opening() and episode.max_turns == 20
        env.reset(seed=item.data["seed"])
        _, reward, _, _, _ = env.step(4)  # PICKUP: -10 unless at the passenger
        turn = episode.step("ACTION: PICKUP")
        assert turn.step_reward == reward and turn.observation is not None


def test_the_agent_keeps_its_own_prompt_and_reply_length() -> None:
    agent = get_task(LAKE).agent()
    assert isinstance(agent, TextGameAgent) and agent.max_tokens == 16
    assert agent.system_prompt is not None and "'ACTION: <name>'" in agent.system_prompt
    assert "LEFT, DOWN, RIGHT, UP" in agent.system_prompt


# ---------------------------------------------------------------------------- the command line


def test_train_takes_a_spec_as_tasks_and_its_agent(tmp_path: Path) -> None:
    from agentbolt.cli.train import _agent, _tasks

    tasks = _tasks(Path(f"{SPELL}&size=6&seed=3"), "heldout", "--val")
    assert len(tasks) == 6 and all("-heldout-" in t.id for t in tasks)
    params = {"agent": None, "command": None, "train_file": Path(LAKE), "val_file": None}
    agent = _agent(params, {})
    assert isinstance(agent, TextGameAgent) and agent.episode is GymEpisode


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "evaluate", "--val", "reasoning_gym:nope"], "unknown reasoning-gym dataset 'nope'"),
        (
            ["train", "evaluate", "--command", "echo", "--val", "reasoning-gym:x"],
            "neither a task file nor a task spec",
        ),
        (["demo", "--task", "gymnasium:CartPole-v1"], "not an environment agentbolt plays as text"),
    ],
)
def test_the_commands_report_a_bad_spec_in_one_message(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())  # rich's box, if any


def test_train_grpo_on_specs_alone_runs_the_specs_agent_in_a_runner_process(tmp_path: Path) -> None:
    """No --agent, no published system prompt: the spec's own agent is sent to a runner process
    and plays every rollout (a tiny random model: the mechanism, not the gain)."""
    import subprocess
    import sys

    from agentbolt.engine import tiny_model_dir

    tiny = tiny_model_dir(tmp_path / "tiny")
    args = ["--train", f"{SPELL}&size=8", "--val", f"{SPELL}&size=2", "--model", str(tiny), "--steps", "1"]
    args += [
        "--group-size",
        "2",
        "--tasks-per-step",
        "2",
        "--runners",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "agentbolt", "train", "grpo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = rows[-1]
    assert (step["step"], step["rollouts"], step["failed"], step["turns_mean"]) == (1, 4, 0, 1.0)
    assert "val_success" in rows[0]  # the held-out spec was played before training
