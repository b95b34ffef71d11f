"""GRPO's correctness fixes on a tiny random model, end to end (server, runners, gateway, engine):
KL to the frozen initial weights, the device reaching the engine, resume restoring exactly
what was saved (and no duplicate metrics rows), stragglers, minimum group size, and greedy
next to sampled evaluation."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from agentbolt import Trainer
from agentbolt.algorithms.evaluate import Evaluate
from agentbolt.algorithms.grpo import GRPO
from agentbolt.algorithms.train_state import merged_state_dict
from agentbolt.engine import EngineServer, ModelEngine, tiny_model_dir
from agentbolt.schemas import LLM, RolloutStatus
from tests.algorithms.training_agents import SamplingAgent
from tests.conftest import tiny_grpo

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _grpo(model: str, steps: int, **overrides: Any) -> GRPO:
    return tiny_grpo(model, **{"steps": steps, "success_threshold": 0.3, **overrides})


def _train(n: int = 2) -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "q": f"say something {i}"} for i in range(n)]


# ---------------------------------------------------------------------------- KL and device


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kl_to_the_initial_weights_starts_at_zero_and_grows(tiny, tmp_path, monkeypatch, lora):
    """Full fine-tuning keeps a frozen copy of the initial model (before: the reference pass
    ran on the trained model itself, so KL was always 0); LoRA disables its adapter. Either
    way the first update sees KL 0 and later ones a positive KL. The engine is started on the
    device given to GRPO, and validation reports greedy next to sampled success."""
    started: list[tuple[Any, ModelEngine]] = []
    original = ModelEngine.from_pretrained

    def recording(cls: type[ModelEngine], *args: Any, **kwargs: Any) -> ModelEngine:
        engine = original(*args, **kwargs)
        started.append((kwargs.get("device"), engine))
        return engine

    monkeypatch.setattr(ModelEngine, "from_pretrained", classmethod(recording))
    algo = _grpo(tiny, 3, lora=lora, kl_coef=0.1, lr=3e-3, device="cpu")
    val = [{"id": f"v{i}", "q": f"val {i}"} for i in range(2)]
    result = Trainer(algo, n_runners=1, runner_concurrency=8, run_dir=tmp_path / "run").fit(
        SamplingAgent(), _train(), val
    )

    assert [(device, engine.device) for device, engine in started] == [("cpu", torch.device("cpu"))]
    trained = [h for h in result.history if h["step"] > 0 and h["train_tokens"] > 0]
    assert trained and trained[0]["step"] == 1, "the random policy gives every group a spread"
    assert trained[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert len(trained) >= 2 and trained[-1]["kl"] > 1e-6
    assert result.val_before is not None and result.val_greedy_before is not None
    assert result.val_greedy_after is not None
    assert "val_greedy" in result.history[0] and "val_greedy" in result.history[-1]


# ---------------------------------------------------------------------------- resume


def _snapshot(state: Any) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad},
        "optimizer": copy.deepcopy(state.optimizer.state_dict()),
        "step": state.step,
    }


@dataclass
class RecordingGRPO(GRPO):
    """GRPO that keeps a copy of its train state when it resumes and when it ends."""

    seen: dict[str, Any] = field(default_factory=dict)

    def _maybe_resume(self, ctx: Any, state: Any, policy: Any) -> tuple[int, list[dict[str, Any]]]:
        start, history = super()._maybe_resume(ctx, state, policy)
        served = dict(policy.engine.model.state_dict())
        self.seen["resumed"] = {**_snapshot(state), "start": start, "engine_version": policy.engine.version}
        self.seen["served_matches"] = all(
            torch.allclose(served[k].float(), v.float(), atol=1e-5)
            for k, v in merged_state_dict(state.model).items()
            if k in served
        )
        return start, history

    def _loop(self, ctx: Any, policy: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._loop(ctx, policy, state, *args, **kwargs)
        self.seen["final"] = _snapshot(state)
        return result


def _assert_same_state(resumed: dict[str, Any], saved: dict[str, Any]) -> None:
    assert resumed["step"] == saved["step"]
    assert resumed["params"].keys() == saved["params"].keys()
    for name, tensor in saved["params"].items():
        assert torch.equal(resumed["params"][name], tensor), name
    opt_resumed, opt_saved = resumed["optimizer"], saved["optimizer"]
    assert opt_saved["state"], "the first run took optimizer steps"
    assert opt_resumed["state"].keys() == opt_saved["state"].keys()
    for index, slots in opt_saved["state"].items():
        for slot, value in slots.items():  # exp_avg, exp_avg_sq, step
            assert torch.equal(opt_resumed["state"][index][slot], value), (index, slot)
    assert opt_resumed["param_groups"] == opt_saved["param_groups"]


def test_resume_restores_weights_optimizer_and_step_and_drops_rows_past_the_checkpoint(tiny, tmp_path):
    run_dir = tmp_path / "run"
    first = RecordingGRPO(**vars(_grpo(tiny, 2, checkpoint_every=1)))
    done = Trainer(first, n_runners=1, runner_concurrency=8, run_dir=run_dir).fit(SamplingAgent(), _train())
    assert [h["step"] for h in done.history] == [0, 1, 2]
    assert any(h["train_tokens"] > 0 for h in done.history[1:])
    # a crash after the step-2 checkpoint: rows of steps the resumed run redoes, a line cut short
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "stale": True}) + "\n" + json.dumps({"step": 4, "stale": True}) + "\n")
        f.write('{"step": 5, "rew')

    second = RecordingGRPO(**vars(_grpo(tiny, 3, checkpoint_every=1, resume=True)))
    resumed = Trainer(second, n_runners=1, runner_concurrency=8, run_dir=run_dir).fit(
        SamplingAgent(), _train()
    )

    state = second.seen["resumed"]
    assert state["start"] == 2 and state["step"] == 2
    _assert_same_state(state, first.seen["final"])
    assert state["engine_version"] == 2 and second.seen["served_matches"]  # the engine serves them
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3]
    assert resumed.history[:3] == done.history
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert not any(r.get("stale") for r in rows)
    assert rows[3]["resources_version"] > rows[2]["resources_version"]
    assert second.seen["final"]["step"] == 3


# ---------------------------------------------------------------------------- stragglers and group size


@dataclass
class BatchKeepingGRPO(GRPO):
    """GRPO that keeps each step's rollouts, and waits (runners still up) for the stalled agent
    to report its cancellation."""

    batches: list[Any] = field(default_factory=list)
    folder: str = ""

    def _sample(self, ctx: Any, step: int, version: int, progress: Any) -> Any:
        tasks, batch = super()._sample(ctx, step, version, progress)
        self.batches.append(batch)
        deadline = time.monotonic() + 20
        while not list(Path(self.folder).glob("*.cancelled")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return tasks, batch


def test_a_straggler_is_cancelled_and_small_groups_are_dropped(tiny, tmp_path):
    """Three groups of 4 with ``min_group_size=2``: one member of ``slow`` never finishes (it is
    cancelled after ``step_timeout``, its agent is cancelled, the group trains on 3), ``few``
    finishes 1 (dropped, counted), ``two`` finishes exactly 2 (kept)."""
    folder = str(tmp_path)
    train = [
        {"id": "slow", "q": "one", "stall": True, "dir": folder},
        {"id": "few", "q": "two", "ok": 1, "dir": folder},
        {"id": "two", "q": "three", "ok": 2, "dir": folder},
    ]
    # synchronous: the step waits for its own groups (asynchronous mode: test_grpo_async_pool)
    settings = vars(_grpo(tiny, 1, tasks_per_step=3, step_timeout=15, min_group_size=2, asynchronous=False))
    algo = BatchKeepingGRPO(**settings, folder=folder)
    t0 = time.monotonic()
    # a 10 s lease: a 3 s one can lapse on a loaded machine, and the stalled attempt then
    # fails instead of being cancelled at step_timeout
    result = Trainer(
        algo, n_runners=1, runner_concurrency=12, run_dir=tmp_path / "run", lease_seconds=10
    ).fit(SamplingAgent(), train)
    row = result.history[1]
    assert (row["rollouts"], row["timed_out"], row["failed"]) == (12, 1, 1 + 3 + 2)
    assert row["dropped_groups"] == 1
    assert row["samples"] == 3 + 2  # slow's 3 and two's 2; few's one finished rollout is not trained on
    assert 15 <= row["t_rollouts"] < 60  # the step waited for the straggler as long as it was told, no longer
    (batch,) = algo.batches
    cancelled = [r for r in batch.rollouts if r.status == RolloutStatus.CANCELLED]
    assert [r.task.id for r in cancelled] == ["slow"]
    assert batch.timed_out == 1
    # the runner learns of the cancellation (at its next heartbeat) and cancels the agent
    deadline = time.monotonic() + 20
    while not (tmp_path / "slow.cancelled").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert float((tmp_path / "slow.cancelled").read_text()) < time.time()
    assert time.monotonic() - t0 < 120


def test_asynchronous_mode_cancels_a_straggler_at_step_timeout_and_drops_small_groups(tiny, tmp_path):
    """The same three groups in asynchronous mode (the default): the update waits for its three
    groups; ``slow``'s stalled member is cancelled when the group is ``step_timeout`` old and
    the group trains on 3, ``few`` (1 finished) is dropped, ``two`` trains on 2."""
    folder = str(tmp_path)
    train = [
        {"id": "slow", "q": "one", "stall": True, "dir": folder},
        {"id": "few", "q": "two", "ok": 1, "dir": folder},
        {"id": "two", "q": "three", "ok": 2, "dir": folder},
    ]
    algo = _grpo(tiny, 1, tasks_per_step=3, step_timeout=15, min_group_size=2)
    assert algo.asynchronous
    t0 = time.monotonic()
    result = Trainer(
        algo, n_runners=1, runner_concurrency=12, run_dir=tmp_path / "run", lease_seconds=10
    ).fit(SamplingAgent(), train)
    row = result.history[1]
    assert row["retried"] == 0  # the stalled attempt held its lease until cancelled
    assert row["groups_enqueued"] == 3  # no group that no update would take
    assert row["dropped_groups"] == 1
    assert row["samples"] == 3 + 2
    assert 15 <= row["t_rollouts"] < 60  # it waited for the straggler as long as it was told, no longer
    deadline = time.monotonic() + 20  # the runner learns of the cancellation and cancels the agent
    while not (tmp_path / "slow.cancelled").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "slow.cancelled").exists()
    assert time.monotonic() - t0 < 120


# ---------------------------------------------------------------------------- greedy evaluation


def test_evaluate_reports_greedy_next_to_sampled_and_greedy_is_reproducible(tiny, tmp_path):
    engine = ModelEngine.from_pretrained(tiny, dtype="float32")
    with EngineServer(engine) as served:
        llm = LLM(base_url=served.base_url, model=engine.name, sampling_parameters={"temperature": 1.0})
        val = [{"id": f"v{i}", "q": f"tell me {i}", "reward": "crc"} for i in range(4)]
        summaries = [
            Trainer(
                Evaluate(greedy=True, timeout=120),
                resources={"llm": llm},
                n_runners=1,
                runner_concurrency=8,
                run_dir=tmp_path / f"eval{i}",
            ).fit(SamplingAgent(), [], val)
            for i in range(2)
        ]
    for s in summaries:
        assert s.count == 4 and s.failed == 0
        assert s.greedy is not None and s.greedy.count == 4 and s.greedy.failed == 0
        # the greedy pass ran on a trial version of its own, not the published one
        assert s.greedy.resources_version is not None and s.greedy.resources_version != s.resources_version
    greedy = [s.greedy.mean_reward for s in summaries if s.greedy is not None]
    sampled = [s.mean_reward for s in summaries]
    assert greedy[0] == greedy[1]  # temperature 0: the same replies, the same checksums
    assert sampled[0] != sampled[1]  # temperature 1: other replies each time
    assert Evaluate().greedy is False


def test_validate_before_false_skips_only_the_untrained_validation(tiny, tmp_path):
    algo = _grpo(tiny, 1, validate_before=False, val_greedy=False)
    result = Trainer(algo, n_runners=1, runner_concurrency=8, run_dir=tmp_path / "run").fit(
        SamplingAgent(), _train(), _train(2)
    )
    assert [row["step"] for row in result.history] == [1]
    assert result.val_before is None
    assert result.val_after is not None and "val_success" in result.history[-1]
