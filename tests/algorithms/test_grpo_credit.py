"""GRPO with per-turn credit end to end on a tiny random model: a three-turn agent rewards each
of its calls and declares each turn's state by the call ids the gateway returns; the step rows
carry the per-turn figures, and the collapse warning is printed and recorded."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from agentbolt import Trainer
from agentbolt.engine import tiny_model_dir
from tests.algorithms.training_agents import TURNS, ThreeTurnAgent
from tests.conftest import tiny_grpo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("advantage", ["turn", "gigpo"])
def test_grpo_trains_on_per_turn_credit(tiny, tmp_path, advantage: str) -> None:
    algo = tiny_grpo(
        tiny,
        steps=2,
        advantage=advantage,  # type: ignore[arg-type]
        gamma=0.9,
        collapse_entropy=1e9,  # every step is "below": warned once, on the first step only
    )
    out = io.StringIO()
    run_dir = tmp_path / "run"
    train = [{"id": f"t{i}", "q": f"say something {i}"} for i in range(2)]
    trainer = Trainer(
        algo, n_runners=1, runner_concurrency=8, run_dir=run_dir, console=Console(file=out, width=140)
    )
    result = trainer.fit(ThreeTurnAgent(), train, [{"id": "v0", "q": "val"}])

    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    assert all(h["rollouts"] == 8 and h["failed"] == 0 for h in steps)
    for h in steps:
        assert h["turns_mean"] == TURNS  # every call of every sample is a turn
        assert len(h["turn_reward_by_index"]) == TURNS
        # the step reward of a turn is the share of 'a': in [0, 1], its mean that of the turns
        assert all(0.0 <= x <= 1.0 for x in h["turn_reward_by_index"])
        assert h["step_reward_mean"] == pytest.approx(sum(h["turn_reward_by_index"]) / TURNS)
    # random replies differ in length and letters: some group has a spread and is trained on
    assert any(h["train_tokens"] > 0 for h in steps)
    trained = [h for h in steps if h["train_tokens"] > 0]
    assert all(h["turn_adv_std"] > 0 for h in trained)  # per-token advantages, not one number
    if advantage == "gigpo":
        # each (task, turn) state holds the group's 4 samples' turns: anchors with a spread
        assert any(h["anchor_groups"] > 0 for h in steps)
    else:
        assert all(h["anchor_groups"] == 0 for h in steps)

    assert "possible collapse" in steps[0]["warning"] and "entropy" in steps[0]["warning"]
    assert "warning" not in steps[1]  # the same stretch: warned once
    printed = [x for x in out.getvalue().splitlines() if x.startswith("warning: possible collapse")]
    assert len(printed) == 1
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[1]["turn_reward_by_index"] == steps[0]["turn_reward_by_index"]
    assert logged[1]["warning"] == steps[0]["warning"]


def test_the_collapse_watch_warns_once_per_stretch_of_flat_groups() -> None:
    from agentbolt.algorithms.collapse import CollapseWatch

    watch = CollapseWatch(min_entropy=0.05, steps=3)

    def step(zero_spread: int, groups: int = 4, entropy: float = 1.0) -> str | None:
        return watch.check(
            {"reward_mean": 0.0, "groups": groups, "zero_spread_groups": zero_spread, "entropy": entropy}
        )

    assert watch.check({"step": 0, "val_success": 0.5}) is None  # a validation row is no step
    # 4 of 4 flat twice, then 3 of 4 (75%: not more than 75%) resets the count
    assert [step(4), step(4), step(3)] == [None, None, None]
    assert [step(4), step(4)] == [None, None]
    warning = step(4)  # the third in a row
    assert warning is not None and "zero reward spread for 3 steps" in warning
    assert step(4) is None  # the same stretch: once
    assert step(0) is None and step(4) is None  # a step with signal ends it
    low = step(0, entropy=0.01)
    assert low is not None and "entropy 0.010" in low and "spread" not in low
    assert (
        CollapseWatch(min_entropy=0.0, steps=0).check(
            {"reward_mean": 0, "groups": 1, "zero_spread_groups": 1, "entropy": 0.0}
        )
        is None
    )
