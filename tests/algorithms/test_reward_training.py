"""Training on a reward the agent does not give: a scoring function run by the algorithm
(FunctionEvaluator) and a person's score (HumanReview) that arrives while a batch waits or in a
later round. Real server, runners, gateway and store; GRPO on a tiny random model, SFT on a
scripted agent (as in test_sft), APO with the scripted optimizer (as in test_apo)."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentbolt import Task, Trainer
from agentbolt.algorithms.apo_optimizer import score_of
from agentbolt.algorithms.base import Algorithm, TrainContext
from agentbolt.algorithms.grpo import GRPO
from agentbolt.algorithms.policy import EnginePolicy
from agentbolt.algorithms.sft import SFT
from agentbolt.algorithms.train_state import TrainConfig
from agentbolt.client import Client
from agentbolt.engine import tiny_model_dir
from agentbolt.errors import ConfigError
from agentbolt.evaluators import FunctionEvaluator, HumanReview, RolloutRecord
from agentbolt.runner.worker import Runner
from agentbolt.schemas import Mode, RewardCreate, RewardScale, Rollout, RolloutStatus
from agentbolt.server import ServerThread
from tests.algorithms.test_apo import KeywordAgent, ScriptedOptimizer, _fast, _fit, _tasks, rig  # noqa: F401
from tests.algorithms.test_reward_choice import rollout, slot
from tests.algorithms.test_sft import _FakeEngine, runner_thread, tiny_model  # noqa: F401
from tests.algorithms.training_agents import SilentVowelAgent, scripted, vowel_share
from tests.conftest import tiny_grpo

BINARY = RewardScale(low=0, high=1, step=1)


class Reviewer:
    """A person working through the review queue in a thread: every pending ``name`` reward of
    a rollout that ``ready`` accepts gets ``score(rollout)``, given as the dashboard gives it
    (``replaces`` = the revision shown)."""

    def __init__(
        self,
        url: str,
        score: Callable[[Rollout], float],
        name: str = "human",
        ready: Callable[[Client], bool] = lambda _: True,
    ) -> None:
        self.url, self.score, self.name, self.ready = url, score, name, ready
        self.scored: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Reviewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with Client(self.url) as client:
            while not self._stop.wait(0.1):
                try:
                    self._pass(client)
                except Exception as exc:  # kept for the report, and tried again: a person would
                    self.errors.append(repr(exc))

    def _pass(self, client: Client) -> None:
        if not self.ready(client):
            return
        for r in client.pending_rewards(name=self.name).items:
            create = RewardCreate(
                name=self.name,
                score=self.score(r),
                replaces=r.rewards[self.name].revision,
                author="alice",
            )
            client.add_reward(r.id, create)
            self.scored.append(r.id)


# ---------------------------------------------------------------------------- GRPO


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _grpo(model: str, **kw: Any) -> GRPO:
    return tiny_grpo(model, validate_before=False, **kw)


TRAIN = [{"id": f"t{i}", "q": f"say something {i}"} for i in range(2)]


def _step_rollouts(server: ServerThread) -> list[Rollout]:
    with Client(server.url) as client:
        return client.list_rollouts(mode=Mode.TRAIN, limit=100).items


def test_grpo_trains_on_a_scoring_function_for_an_agent_without_a_reward(
    tiny: str, server: ServerThread, tmp_path: Path
) -> None:
    # the vowel share, plus 1 for every second member of a group: a group of the tiny random
    # model's outputs may all score alike, and then there would be nothing to train on
    seen: dict[str | None, int] = {}

    def spread_score(record: RolloutRecord) -> float:
        group = record.rollout.group_id
        seen[group] = seen.get(group, 0) + 1
        return (vowel_share(record) + seen[group] % 2) / 2

    score = FunctionEvaluator(spread_score, name="score")
    algo = _grpo(tiny, reward="score", evaluators=[score])
    trainer = Trainer(algo, n_runners=1, runner_concurrency=8, server_url=server.url, run_dir=tmp_path)
    result = trainer.fit(SilentVowelAgent(), TRAIN)

    [step] = [h for h in result.history if h["step"] == 1]
    rollouts = _step_rollouts(server)
    assert len(rollouts) == 8 and all(r.reward is None for r in rollouts)  # the agent gave none
    values = [r.rewards["score"].value for r in rollouts]
    assert all(v is not None for v in values)
    # every sample trained on, with the function's scores (with the agent's reward: none)
    assert (step["samples"], step["reward_pending"], step["reward_errors"]) == (8, 0, 0)
    assert step["reward_mean"] == pytest.approx(sum(v or 0.0 for v in values) / 8)
    assert step["train_tokens"] > 0
    assert step["judge_calls"] == 0 and step["t_judge"] >= 0  # a function: no model calls


def test_grpo_waits_for_a_persons_scores_and_trains_on_them(
    tiny: str, server: ServerThread, tmp_path: Path
) -> None:
    given: list[float] = []

    def alternate(_: Rollout) -> float:
        given.append(float(len(given) % 2))
        return given[-1]

    algo = _grpo(tiny, reward="human", evaluators=[HumanReview("human", BINARY)], reward_wait=120)
    out = io.StringIO()
    trainer = Trainer(
        algo, n_runners=0, server_url=server.url, run_dir=tmp_path, console=Console(file=out, width=200)
    )
    # the runner in a thread, not a process the Trainer forks: a fork with the reviewer's thread
    # running left the forked runner without a claim (no rollout ran; in CI once, and every
    # time this test ran alone)
    runner = Runner(SilentVowelAgent(), server.url, concurrency=8)
    thread = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        with Reviewer(server.url, alternate) as reviewer:
            result = trainer.fit(SilentVowelAgent(), TRAIN)
    finally:
        runner.stop()
        thread.join(20)

    [step] = [h for h in result.history if h["step"] == 1]
    assert len(reviewer.scored) == 8, reviewer.errors
    assert (step["samples"], step["reward_pending"], step["reward_mean"]) == (8, 0, 0.5)
    assert "| reward pending 0 | reward errors 0 |" in out.getvalue()


# ---------------------------------------------------------------------------- SFT


def _sft(**kw: Any) -> SFT:
    engine = _FakeEngine()
    return SFT(
        rollouts_per_task=2,
        epochs=1,
        batch_size=2,
        bf16=False,
        train=TrainConfig(lr=1e-2, lora_r=4),
        round_timeout=60,
        policy=EnginePolicy(engine, "http://127.0.0.1:9/v1", ""),  # type: ignore[arg-type]
        policy_model=tiny_model(),
        validate_before=False,
        **kw,
    )


def _sft_tasks() -> list[Task]:
    return [
        Task(id=f"t{i}", data={"prompt": [1, 2, 3], "completion": [10 + i, 11, 12], "reward": i % 2})
        for i in range(4)
    ]


def test_sft_selects_by_the_chosen_reward_not_the_agents(
    server: ServerThread,
    runner_thread: Any,  # noqa: F811 (the fixture of test_sft)
    tmp_path: Path,
) -> None:
    """The agent rewards odd tasks; the scoring function rewards even ones: SFT keeps those."""
    inverse = FunctionEvaluator(lambda record: 1.0 - record.task["reward"], name="score")
    algo = _sft(rounds=1, reward="score", evaluators=[inverse])
    result = Trainer(
        algo, n_runners=0, server_url=server.url, run_dir=tmp_path, console=Console(file=io.StringIO())
    ).fit(scripted, _sft_tasks())
    [first] = result.rounds
    assert (first.rollouts, first.kept, first.reward_pending, first.train_reward) == (8, 4, 0, 0.5)
    with Client(server.url) as client:
        train = client.list_rollouts(mode=Mode.TRAIN, limit=100).items
    assert {r.rewards["score"].value for r in train if r.task.id in ("t0", "t2")} == {1.0}
    assert first.rows == 2 and first.train is not None and first.evaluation["judge_calls"] == 0


def test_sft_takes_scores_given_after_selection_into_the_next_round(
    server: ServerThread,
    runner_thread: Any,  # noqa: F811 (the fixture of test_sft)
    tmp_path: Path,
) -> None:
    """Round 1's batch waits 2 s for a person who is not there yet: nothing is kept and the 8
    rollouts are counted pending (not read as zeros). The person scores them while round 2
    runs; round 2 selects from its own runs and round 1's, scored since."""

    def round_two_started(client: Client) -> bool:
        return any(":sft2:" in (r.group_id or "") for r in client.list_rollouts(limit=100).items)

    algo = _sft(rounds=2, reward="human", evaluators=[HumanReview("human", BINARY)], reward_wait=2.0)
    trainer = Trainer(
        algo, n_runners=0, server_url=server.url, run_dir=tmp_path, console=Console(file=io.StringIO())
    )
    with Reviewer(server.url, lambda r: float(r.task.data["reward"]), ready=round_two_started) as reviewer:
        result = trainer.fit(scripted, _sft_tasks())

    first, second = result.rounds
    assert (first.kept, first.reward_pending, first.train_reward, first.train) == (0, 8, None, None)
    assert len(reviewer.scored) == 16
    # round 2: its own 4 passing runs and round 1's 4, arrived since; 2 distinct completions
    assert (second.arrived, second.reward_pending, second.kept, second.rows) == (8, 0, 8, 2)
    assert second.train is not None and second.train_reward == 0.5


# ---------------------------------------------------------------------------- APO


def test_apo_scores_candidates_by_the_chosen_reward(rig: ServerThread, tmp_path: Path) -> None:  # noqa: F811
    """The agent rewards prompts naming the keyword; the scoring function rewards prompts that
    do not. Trained on the function, the rewrite without it beats the seed."""

    def no_keyword(record: RolloutRecord) -> float:
        system = next(m["content"] for m in record.messages if m["role"] == "system")
        return 0.0 if record.task["kw"] in system else 1.0

    apo = _fast(
        rounds=1,
        beam_width=1,
        branch_factor=1,
        reward="score",
        evaluators=[FunctionEvaluator(no_keyword, "score")],
    )
    with ScriptedOptimizer(rewrite=lambda current, n: "<prompt>Answer briefly.</prompt>") as double:
        result, _ = _fit(apo, rig.url, double, "Mention apple.", _tasks("apple", "apple"), n_runners=0)
    assert (result.seed_val, result.best_val, result.best_prompt) == (0.0, 1.0, "Answer briefly.")
    assert result.stats.reward_pending == result.stats.reward_errors == 0


def test_apo_leaves_pending_rewards_out_and_counts_them(rig: ServerThread, tmp_path: Path) -> None:  # noqa: F811
    apo = _fast(rounds=0, reward="human", evaluators=[HumanReview("human", BINARY)])
    with ScriptedOptimizer(rewrite=lambda current, n: "<prompt>x</prompt>") as double:
        result, out = _fit(apo, rig.url, double, "Mention apple.", _tasks("apple", "apple"), n_runners=0)
    # 2 training runs and 2 validation runs (the training tasks), none scored: no value, not 0
    assert result.seed_val is None and result.stats.reward_pending == 4
    assert "(seed -)" in out


def test_a_straggler_or_a_pending_reward_is_no_score_a_failure_is_zero() -> None:
    assert score_of(rollout("s", 1.0, status=RolloutStatus.CANCELLED)) is None
    assert score_of(rollout("f", None, status=RolloutStatus.FAILED)) == 0.0
    assert score_of(rollout("n", None)) == 0.0  # the run reported no reward: as before
    assert score_of(rollout("p", 1.0, slot("human")), "human") is None
    assert score_of(rollout("e", 1.0, slot("human", error=True)), "human") is None
    assert score_of(rollout("ok", 0.0, slot("judge", 0.25)), "judge") == 0.25


# ---------------------------------------------------------------------------- Evaluate and Trainer


def test_the_trainer_gives_evaluate_a_weighted_reward_and_its_evaluators(tmp_path: Path) -> None:
    """Trainer(reward=..., evaluators=...) sets the algorithm's own; the mean is the weighted
    sum of the agent's reward and the function's, a failing function an error left out."""
    from agentbolt.algorithms.evaluate import Evaluate
    from tests.sample_agents import echo

    def half_or_raise(record: RolloutRecord) -> float:
        if record.task.get("bad"):
            raise ValueError("cannot score this one")
        return 0.5

    trainer = Trainer(
        Evaluate(timeout=60),
        n_runners=1,
        run_dir=tmp_path,
        console=Console(file=io.StringIO()),
        reward={"agent": 0.5, "half": 0.5},
        evaluators=[FunctionEvaluator(half_or_raise, name="half")],
    )
    tasks = [{"id": "a", "reward": 1.0}, {"id": "b", "reward": 0.0}, {"id": "c", "reward": 1.0, "bad": True}]
    summary = trainer.fit(echo, tasks)
    # a: 0.5 * 1 + 0.5 * 0.5 = 0.75, b: 0.25, c: its function raised (an error, left out)
    assert (summary.count, summary.reward_errors, summary.reward_pending) == (3, 1, 0)
    assert summary.mean_reward == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="takes no reward settings"):
        Trainer(_NoRewards(), reward="judge")


class _NoRewards(Algorithm):
    def run(self, ctx: TrainContext) -> None:
        return None
