"""Asynchronous GRPO end to end on a tiny random model: server, runner, gateway and engine, for real."""

from __future__ import annotations

import asyncio
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentbolt import LitAgent, Task, Trainer
from agentbolt.algorithms.grpo import GRPO
from agentbolt.engine import tiny_model_dir
from agentbolt.errors import ConfigError
from agentbolt.runner.llm import async_openai
from agentbolt.schemas import LLM, Mode, RolloutCreate, RolloutStatus
from agentbolt.store import open_store
from tests.conftest import tiny_grpo


class SleepyAgent(LitAgent):
    """One chat call, then a sleep of ``task.data["sleep"]`` seconds (a slow tool). Reward: the
    reply's length plus a little noise, so every group has a spread."""

    async def execute_rollout(self, task: Task) -> float:
        llm: LLM = self.get_resource("llm")
        response = await async_openai(llm).chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task.data["q"]}],
            max_tokens=8,
            temperature=1.0,
        )
        await asyncio.sleep(task.data.get("sleep", 0.0))
        return len(response.choices[0].message.content or "") / 40 + random.random() * 1e-3


@dataclass
class RecordingGRPO(GRPO):
    """GRPO that keeps the tasks of the groups each asynchronous update took."""

    taken: list[list[str]] = field(default_factory=list)

    def _async_rows(self, ctx: Any, batch: Any, taken: Any, synced: Any) -> Any:
        self.taken.append(sorted(g.task.id for g in taken))
        return super()._async_rows(ctx, batch, taken, synced)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _tasks(slow: float) -> list[dict[str, Any]]:
    return [{"id": f"fast{i}", "q": f"say something {i}"} for i in range(2)] + [
        {"id": f"slow{i}", "q": f"tell me {i}", "sleep": slow} for i in range(2)
    ]


def _run(
    tiny: str, tmp_path: Path, slow: float, console: Console | None = None, **overrides: Any
) -> tuple[RecordingGRPO, Any]:
    settings = vars(tiny_grpo(tiny, steps=3, asynchronous=True, max_groups_in_flight=4, **overrides))
    algo = RecordingGRPO(**settings)
    trainer = Trainer(algo, n_runners=1, runner_concurrency=16, run_dir=tmp_path / "run", console=console)
    return algo, trainer.fit(SleepyAgent(), _tasks(slow), [])


def _unfinished(run_dir: Path) -> list[Any]:
    store = open_store(str(run_dir / "agentbolt.db"))
    try:
        page = store.list_rollouts(limit=1000, mode=Mode.TRAIN)
        return [r for r in page.items if not r.status.is_final]
    finally:
        store.close()


def test_async_grpo_carries_slow_groups_over_and_leaves_no_rollout_running(tiny, tmp_path) -> None:
    out = io.StringIO()
    algo, result = _run(tiny, tmp_path, slow=4.0, console=Console(file=out, width=400), max_staleness=2)
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2, 3]
    # the first update took the two fast groups; the slow ones were carried over
    assert algo.taken[0] == ["fast0", "fast1"]
    assert steps[0]["carried_groups"] == 2
    assert any("slow0" in t for t in algo.taken[1:]) and any("slow1" in t for t in algo.taken[1:])
    for h in steps:
        assert h["rollouts"] == 8 and h["failed"] == 0
        assert h["train_tokens"] > 0  # every group has a spread
        assert 0.0 < h["is_weight_min"] <= h["is_weight_mean"] <= h["is_weight_max"] <= 2.0
        assert 0.0 <= h["is_clipped_fraction"] <= 1.0
        assert sum(h["staleness_hist"].values()) == h["samples"] + h["stale_dropped"] == 8
        assert h["t_trainer_wait"] >= 0.0 and h["t_engine_idle"] >= 0.0 and h["steps_per_hour"] > 0
    # three updates: no sample can be more than two versions behind, and none was dropped
    assert all(int(lag) <= 2 for h in steps for lag in h["staleness_hist"])
    assert all(h["stale_dropped"] == 0 and h["evicted_groups"] == 0 for h in steps)
    # the slow groups ran through the first update: their samples are one version behind
    assert any(h["staleness_hist"].get("1", 0) >= 4 for h in steps[1:])
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[1]["staleness_hist"] == steps[0]["staleness_hist"]
    assert _unfinished(tmp_path / "run") == []
    # off a terminal: one plain line per step, with the asynchronous columns
    [line] = [x for x in out.getvalue().splitlines() if x.startswith("GRPO step 1 |")]
    assert "| carried groups 2 | evicted groups 0 | stale dropped 0 |" in line
    assert f"| is weight max {steps[0]['is_weight_max']:.3f} |" in line and "| t engine idle " in line


def test_max_staleness_zero_evicts_the_stale_groups_and_trains_every_update_on_fresh_ones(
    tiny, tmp_path
) -> None:
    algo, result = _run(tiny, tmp_path, slow=3.0, max_staleness=0)
    steps = [h for h in result.history if h["step"] > 0]
    assert len(steps) == 3
    assert steps[0]["stale_dropped"] == 0 and steps[0]["evicted_groups"] == 0
    # the slow groups were generated by the first weights and could not finish before the
    # first update: they are evicted from the pool (their sleeping members cancelled) instead of
    # taking a later update's place, and replaced by groups at the current version
    assert sum(h["evicted_groups"] for h in steps) >= 2
    # every update trained, every sample generated by the policy it updated
    for h in steps:
        assert h["groups"] >= 1 and h["train_tokens"] > 0
        assert 0 < h["samples"] <= h["staleness_hist"].get("0", 0)
    assert all(set(h["staleness_hist"]) <= {"0", "1", "2"} for h in steps)
    assert _unfinished(tmp_path / "run") == []


@dataclass
class FailingGRPO(RecordingGRPO):
    """Fails its first update, with groups still in flight."""

    def _update(self, state: Any, rows: Any, proximal: bool = False) -> Any:
        raise RuntimeError("the update failed")


def test_a_failed_run_leaves_no_rollout_queued_or_running(tiny, tmp_path) -> None:
    """The first update fails while the slow groups sleep and new ones were topped up: the run
    raises, and every rollout it enqueued is final (the unfinished ones cancelled)."""
    settings = vars(tiny_grpo(tiny, steps=3, asynchronous=True, max_groups_in_flight=4))
    algo = FailingGRPO(**settings)
    trainer = Trainer(algo, n_runners=1, runner_concurrency=16, run_dir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="the update failed"):
        trainer.fit(SleepyAgent(), _tasks(slow=60.0), [])
    assert algo.taken == [["fast0", "fast1"]]
    assert _unfinished(tmp_path / "run") == []
    store = open_store(str(tmp_path / "run" / "agentbolt.db"))
    try:
        rollouts = store.list_rollouts(limit=1000).items
    finally:
        store.close()
    assert len(rollouts) == 6 * 4  # four groups at first, two topped up after the first take
    slow = [r for r in rollouts if r.task.id.startswith("slow") and r.group_id and ":g" in r.group_id]
    assert any(r.status == RolloutStatus.CANCELLED for r in slow)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"max_staleness": -1}, "max_staleness must be"),
        ({"importance_cap": 1.0}, "importance_cap must be"),
        ({"importance": "tokens"}, "importance must be one of"),
        ({"max_groups_in_flight": 1, "tasks_per_step": 2}, "max_groups_in_flight must be at least"),
    ],
)
def test_bad_async_settings_are_refused(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        GRPO(asynchronous=True, **overrides)


def test_asynchronous_is_the_default() -> None:
    algo = GRPO()
    assert algo.asynchronous is True and algo.max_staleness == 2 and algo.importance == "token"
    assert algo.importance_cap == 2.0 and algo.groups_in_flight == 2 * algo.tasks_per_step


def test_an_async_run_resumes_from_its_checkpoint(tiny, tmp_path) -> None:
    """Resume continues the steps and the count of groups enqueued (the task order follows it),
    and cancels the training rollouts an interrupted run left queued, not another run's."""
    out = io.StringIO()

    def fit(steps: int, resume: bool) -> Any:
        algo = tiny_grpo(tiny, steps=steps, asynchronous=True, checkpoint_every=1, resume=resume)
        console = Console(file=out, width=200)
        trainer = Trainer(algo, n_runners=1, runner_concurrency=16, run_dir=tmp_path / "run", console=console)
        return trainer.fit(SleepyAgent(), _tasks(slow=0.0), [])

    first = fit(2, resume=False)
    assert [h["groups_enqueued"] for h in first.history[1:]] == [4, 4]  # none enqueued past the run's needs
    # what a run killed after its checkpoint leaves behind: a group of its own still queued
    # (a long tool call, should a runner claim it), and one of another run on the same store
    store = open_store(str(tmp_path / "run" / "agentbolt.db"))
    try:
        slow = Task(id="orphan", data={"q": "tell me", "sleep": 120.0})
        orphans = store.enqueue([RolloutCreate(task=slow, group_id="run:g4:orphan") for _ in range(2)])
        quick = Task(id="x", data={"q": "hi"})
        other = store.enqueue([RolloutCreate(task=quick, group_id="run2:g0:x")])[0]
        # and validation: one of its own, one of another run, one that names no run
        val = [
            RolloutCreate(task=task, mode=Mode.VAL, metadata={"decoding": "greedy", **meta})
            for task, meta in ((slow, {"run": "run"}), (quick, {"run": "run2"}), (quick, {}))
        ]
        own_val, other_val, unnamed_val = store.enqueue(val)
    finally:
        store.close()
    resumed = fit(3, resume=True)
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3]
    assert resumed.history[:3] == first.history[:3]
    assert resumed.history[3]["groups_enqueued"] == 6 and resumed.history[3]["rollouts"] == 8
    assert (
        "cancelled 2 training and 1 validation rollout(s) the interrupted run had left queued or running"
        in out.getvalue()
    )
    store = open_store(str(tmp_path / "run" / "agentbolt.db"))
    try:
        assert [store.get_rollout(r.id).status for r in orphans] == [RolloutStatus.CANCELLED] * 2
        assert store.get_rollout(own_val.id).status == RolloutStatus.CANCELLED
        for kept in (other, other_val, unnamed_val):  # not this run's, or not known to be
            assert store.get_rollout(kept.id).status != RolloutStatus.CANCELLED
    finally:
        store.close()
    left = {r.id for r in _unfinished(tmp_path / "run")}
    assert left <= {other.id, other_val.id, unnamed_val.id}
