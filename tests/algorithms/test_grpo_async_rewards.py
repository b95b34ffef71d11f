"""Asynchronous GRPO on rewards the agent does not give: a scoring function run per group once
its members are final, and a person's score awaited per group (issue #20's reward plans)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbolt import Trainer
from agentbolt.client import Client
from agentbolt.engine import tiny_model_dir
from agentbolt.evaluators import FunctionEvaluator, HumanReview, RolloutRecord
from agentbolt.runner.worker import Runner
from agentbolt.schemas import Mode, RewardScale, Rollout
from agentbolt.server import ServerThread
from tests.algorithms.test_reward_training import Reviewer
from tests.algorithms.training_agents import SilentVowelAgent, vowel_share
from tests.conftest import tiny_grpo

TRAIN = [{"id": f"t{i}", "q": f"say something {i}"} for i in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _grpo(model: str, **kw: Any) -> Any:
    return tiny_grpo(model, steps=2, validate_before=False, asynchronous=True, max_groups_in_flight=3, **kw)


@contextlib.contextmanager
def _runner(server: ServerThread) -> Iterator[None]:
    """A runner in a thread, as in test_reward_training (no fork beside a reviewer's thread)."""
    runner = Runner(SilentVowelAgent(), server.url, concurrency=12)
    thread = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        runner.stop()
        thread.join(20)


class _Alternating:
    """Every second member of a group scores one more: each group has a spread."""

    def __init__(self) -> None:
        self.seen: dict[str | None, int] = {}
        self.lock = threading.Lock()

    def __call__(self, group: str | None) -> int:
        with self.lock:
            self.seen[group] = self.seen.get(group, 0) + 1
            return self.seen[group] % 2


def test_async_grpo_trains_on_a_scoring_function_run_per_group(
    tiny: str, server: ServerThread, tmp_path: Path
) -> None:
    alternate = _Alternating()

    def spread_score(record: RolloutRecord) -> float:
        return (vowel_share(record) + alternate(record.rollout.group_id)) / 2

    algo = _grpo(tiny, reward="score", evaluators=[FunctionEvaluator(spread_score, name="score")])
    with _runner(server):
        result = Trainer(algo, n_runners=0, server_url=server.url, run_dir=tmp_path).fit(
            SilentVowelAgent(), TRAIN
        )
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 2
    for h in steps:
        assert (h["samples"], h["reward_pending"], h["reward_errors"]) == (8, 0, 0)
        assert h["train_tokens"] > 0 and h["judge_calls"] == 0
    with Client(server.url) as client:
        rollouts = client.list_rollouts(mode=Mode.TRAIN, limit=100).items
    # four groups enqueued (the pool of 3, one topped up), every one scored, none left running
    assert len(rollouts) == 16 and all(r.status.is_final for r in rollouts)
    assert all(r.rewards["score"].value is not None for r in rollouts)


def test_async_grpo_waits_for_a_persons_scores_per_group(
    tiny: str, server: ServerThread, tmp_path: Path
) -> None:
    alternate = _Alternating()

    def score(r: Rollout) -> float:
        return float(alternate(r.group_id))

    binary = RewardScale(low=0, high=1, step=1)
    algo = _grpo(tiny, reward="human", evaluators=[HumanReview("human", binary)], reward_wait=120)
    trainer = Trainer(algo, n_runners=0, server_url=server.url, run_dir=tmp_path)
    with _runner(server), Reviewer(server.url, score) as reviewer:
        result = trainer.fit(SilentVowelAgent(), TRAIN)
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 2, reviewer.errors
    for h in steps:
        assert (h["samples"], h["reward_pending"], h["reward_mean"]) == (8, 0, 0.5)
        assert h["train_tokens"] > 0
