from __future__ import annotations

import io
import itertools
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

from agentbolt import Task
from agentbolt.adapters import to_trajectories
from agentbolt.algorithms.base import TrainContext
from agentbolt.algorithms.losses import TrainRow
from agentbolt.algorithms.policy import EnginePolicy
from agentbolt.algorithms.sft import SFT, eval_loss, select_rollouts, sft_rows, train_rows
from agentbolt.algorithms.train_state import TrainConfig, make_train_state
from agentbolt.client import Client
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, Event, EventSource, Mode, ModelWeights, Rollout, RolloutStatus
from agentbolt.trainer import Trainer
from tests.algorithms.training_agents import chat_agent, scripted
from tests.conftest import finished_rollout


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores; tiny models gain nothing from more
    yield
    torch.set_num_threads(threads)


_ids = itertools.count(1)


def event(type_: str, data: dict[str, Any], attempt: str = "at-1", rollout_id: str = "ro-1") -> Event:
    return Event(
        id=next(_ids),
        rollout_id=rollout_id,
        attempt_id=attempt,
        sequence=None,
        type=type_,
        timestamp=0.0,
        data=data,
        source=EventSource.GATEWAY,  # the gateway's record: what training reads
    )


def llm_call(
    prompt: list[int], completion: list[int], attempt: str = "at-1", rollout_id: str = "ro-1"
) -> Event:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "x"},
        "finish_reason": "stop",
        "token_ids": completion,
        "logprobs": [-0.5] * len(completion),
    }
    data = {
        "endpoint": "chat.completions",
        "request": {"messages": [{"role": "user", "content": "q"}]},
        "prompt_token_ids": prompt,
        "choices": [choice],
        "error": None,
    }
    return event("llm_call", data, attempt, rollout_id)


def make_rollout(
    rid: str, task: str, reward: float | None, status: RolloutStatus = RolloutStatus.SUCCEEDED
) -> Rollout:
    return finished_rollout(rid, task=Task(id=task), status=status, reward=reward)


def tiny_model(vocab: int = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------- selection


def test_select_keeps_passing_runs_within_the_top_fraction_of_each_task() -> None:
    runs = [
        make_rollout("a1", "a", 1.0),
        make_rollout("a2", "a", 0.2),
        make_rollout("a3", "a", 0.9),
        make_rollout("a4", "a", 1.0),
        make_rollout("b1", "b", 0.1),
        make_rollout("b2", "b", 0.8),
        make_rollout("b3", "b", None),
        make_rollout("b4", "b", 1.0, status=RolloutStatus.FAILED),
    ]
    assert {r.id for r in select_rollouts(runs, 0.5)} == {"a1", "a3", "a4", "b2"}
    # top half of 4 runs = 2 per task; ties keep the earlier run
    assert [r.id for r in select_rollouts(runs, 0.5, top_fraction=0.5)] == ["a1", "a4", "b2"]
    assert [r.id for r in select_rollouts(runs, None, top_fraction=0.25)] == ["a1", "b2"]
    assert select_rollouts(runs, 2.0) == []


# ---------------------------------------------------------------------------- rows and masks


def test_multi_turn_rows_train_model_tokens_only() -> None:
    # system+user prompt [1,2,3] -> model [10,11] (a tool call); tool output [20,21] -> model [12,13]
    events = [llm_call([1, 2, 3], [10, 11]), llm_call([1, 2, 3, 10, 11, 20, 21], [12, 13])]
    trajectories, stats = to_trajectories(events, reward=1.0)
    rows, duplicates = sft_rows(trajectories)
    assert stats.prefix_mismatches == 0 and duplicates == 0 and len(rows) == 1
    assert rows[0].input_ids == (1, 2, 3, 10, 11, 20, 21, 12, 13)
    assert rows[0].loss_mask == (0, 0, 0, 1, 1, 0, 0, 1, 1)
    assert rows[0].old_logprobs is None and rows[0].advantage == 0.0


def test_identical_runs_are_trained_once_and_empty_rows_dropped() -> None:
    a, _ = to_trajectories([llm_call([1, 2], [5, 6], rollout_id="r1")])
    b, _ = to_trajectories([llm_call([1, 2], [5, 6], rollout_id="r2")])
    c, _ = to_trajectories([llm_call([1, 2], [7], rollout_id="r3")])
    empty, _ = to_trajectories([llm_call([1, 2], [], rollout_id="r4")])
    rows, duplicates = sft_rows(a + b + c + empty)
    assert duplicates == 1
    assert [r.input_ids for r in rows] == [(1, 2, 5, 6), (1, 2, 7)]


class _FakeClient:
    def __init__(self, events: dict[str, list[Event]]) -> None:
        self.events = events

    def events_of(self, rollout_ids: list[str], **_: Any) -> dict[str, list[Event]]:
        return {rid: self.events[rid] for rid in rollout_ids}


def _context(events: dict[str, list[Event]], run_dir: Path, console: Console | None = None) -> TrainContext:
    """A context whose client serves ``events`` (no server: ``SFT._rows`` reads events only)."""
    extra = {"console": console} if console is not None else {}
    return TrainContext(
        client=_FakeClient(events),  # type: ignore[arg-type]
        server_url="",
        train_tasks=[],
        val_tasks=[],
        run_dir=run_dir,
        **extra,
    )


def test_rows_come_from_the_last_attempt_only(tmp_path: Path) -> None:
    events = {"ro-1": [llm_call([1, 2], [9, 9, 9], attempt="at-1"), llm_call([1, 2], [5, 6], attempt="at-2")]}
    ctx = _context(events, tmp_path)
    rows, duplicates, stats = SFT()._rows(ctx, [make_rollout("ro-1", "t", 1.0)], 1)
    assert [r.input_ids for r in rows] == [(1, 2, 5, 6)] and stats.calls == 1


def test_a_round_prints_how_many_calls_it_skipped_for_lack_of_ids(tmp_path: Path) -> None:
    text_only = llm_call([1, 2], [5, 6], rollout_id="ro-2")  # as the gateway records one without ids
    text_only.data.update(prompt_token_ids=None, token_ids=False)
    text_only.data["choices"][0].update(token_ids=None, logprobs=None)
    events = {"ro-1": [llm_call([1, 2], [5, 6])], "ro-2": [text_only]}
    out = io.StringIO()
    ctx = _context(events, tmp_path, Console(file=out, width=200))
    kept = [make_rollout("ro-1", "t", 1.0), make_rollout("ro-2", "t", 1.0)]
    rows, _, stats = SFT()._rows(ctx, kept, 3)
    assert len(rows) == 1 and stats.skipped_no_ids == 1 and stats.calls == 2
    assert "SFT round 3: 1 llm call skipped for lack of token ids" in out.getvalue()
    SFT()._rows(ctx, kept[:1], 4)  # none skipped: nothing said
    assert "round 4" not in out.getvalue()


# ---------------------------------------------------------------------------- training


def test_training_lowers_the_loss_on_its_rows() -> None:
    model = tiny_model()
    rows = [TrainRow((1, 2, 3, 10 + i, 11 + i, 12 + i), (0, 0, 0, 1, 1, 1)) for i in range(6)]
    before = eval_loss(model, rows)
    state = make_train_state(model, TrainConfig(lr=1e-2, lora_r=8))
    stats = train_rows(state, rows, epochs=6, batch_size=4, seed=0)
    after = eval_loss(state.model, rows)
    assert after < before * 0.9, (before, after)
    assert stats.steps == 12 and stats.model_tokens == 6 * 3 * 6 and stats.input_tokens == 6 * 6 * 6
    assert stats.loss_last is not None and stats.loss_first is not None and stats.loss_last < stats.loss_first


def test_eval_loss_is_the_token_weighted_mean() -> None:
    model = tiny_model()
    rows = [TrainRow((1, 2, 3), (0, 1, 1)), TrainRow((4, 5, 6, 7, 8), (0, 0, 0, 0, 1))]
    whole = eval_loss(model, rows, max_tokens=10_000)
    split = eval_loss(model, rows, max_tokens=1)  # one row per micro-batch
    assert whole == pytest.approx(split, rel=1e-5)


# ---------------------------------------------------------------------------- a whole run, no engine


class _FakeEngine:
    """Records weight updates; stands in for ModelEngine behind an EnginePolicy."""

    name = "fake"

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []

    def update_weights(
        self, state_dict: Any = None, adapter_path: str | None = None, version: Any = None
    ) -> Any:
        self.updates.append({"adapter_path": adapter_path, "version": version, "state_dict": state_dict})
        return version


@pytest.fixture
def runner_thread(server: Any) -> Iterator[Runner]:
    runner = Runner(scripted, server.url, concurrency=4)
    thread = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    yield runner
    runner.stop()
    thread.join(20)


def test_a_run_trains_publishes_and_swaps_weights(
    server: Any, client: Client, runner_thread: Runner, tmp_path: Path
) -> None:
    train = [
        Task(id=f"t{i}", data={"prompt": [1, 2, 3], "completion": [10 + i, 11, 12], "reward": i % 2})
        for i in range(4)
    ]
    val = [Task(id="v", data={"prompt": [1, 2], "completion": [5], "reward": 1})]
    engine = _FakeEngine()
    policy = EnginePolicy(engine, "http://127.0.0.1:9/v1", "")  # type: ignore[arg-type]
    algo = SFT(
        rounds=2,
        rollouts_per_task=2,
        epochs=2,
        batch_size=2,
        bf16=False,
        train=TrainConfig(lr=1e-2, lora_r=4),
        round_timeout=60,
        policy=policy,
        policy_model=tiny_model(),
    )
    out = io.StringIO()  # not a terminal: the training bar becomes plain lines
    console = Console(file=out, width=140)
    trainer = Trainer(algo, n_runners=0, server_url=server.url, run_dir=tmp_path, console=console)
    result = trainer.fit(scripted, train, val)

    assert len(result.rounds) == 2 and result.val_before is not None and result.val_before.count == 1
    # validation ran sampled and greedy, the greedy pass on a trial version (never the latest)
    greedy = result.val_before.greedy
    assert greedy is not None and greedy.count == 1 and greedy.resources_version is not None
    assert (
        client.get_resources(greedy.resources_version).resources["llm"].sampling_parameters["temperature"]
        == 0
    )
    greedy_resources = client.get_resources(greedy.resources_version)
    assert greedy_resources.trial and greedy_resources.metadata["stage"] == "greedy"
    assert "metrics" not in greedy_resources.metadata  # no second point per step on the training page
    first = result.rounds[0]
    assert (first.rollouts, first.kept, first.rows, first.duplicates) == (8, 4, 2, 2)
    assert first.train is not None and first.train.steps == 2
    assert [u["version"] for u in engine.updates] == ["sft-r1", "sft-r2"]
    assert all(Path(u["adapter_path"], "adapter_config.json").is_file() for u in engine.updates)
    latest = client.latest_resources()
    assert latest is not None and latest.version == result.resources_version
    weights = latest.resources["policy_weights"]
    assert isinstance(weights, ModelWeights) and weights.format == "lora"
    assert weights.path == str(result.weights_path) and weights.metadata["round"] == 2
    assert latest.metadata["algorithm"] == "sft" and latest.metadata["metrics"]["steps"] == 2
    # round 2 ran with round 1's weights, validation with each round's
    round2 = client.list_rollouts(mode=Mode.TRAIN, resources_version=first.resources_version, limit=100).items
    assert len(round2) == 8
    assert (tmp_path / "sft" / "rounds.jsonl").read_text().count("\n") == 2
    lines = re.findall(r"^SFT round (\d) training (\d)/(\d) \| loss (\d+\.\d{4})$", out.getvalue(), re.M)
    assert [line[:3] for line in lines] == [
        ("1", "1", "2"),
        ("1", "2", "2"),
        ("2", "1", "2"),
        ("2", "2", "2"),
    ]
    assert first.train.loss_last == pytest.approx(float(lines[1][3]), abs=1e-4)


# ---------------------------------------------------------------------------- end to end, real engine


def test_end_to_end_through_server_runner_gateway_and_engine(
    server: Any, client: Client, tmp_path: Path
) -> None:
    from agentbolt.engine import EngineServer, ModelEngine, tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model")
    engine = ModelEngine.from_pretrained(model_dir, dtype="float32")
    runner = Runner(chat_agent, server.url, concurrency=4)
    thread = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
    with EngineServer(engine) as engine_server:
        thread.start()
        try:
            policy = EnginePolicy(engine, engine_server.base_url, str(model_dir))
            algo = SFT(
                rounds=2,
                rollouts_per_task=2,
                min_reward=None,
                top_fraction=0.5,
                epochs=1,
                batch_size=4,
                bf16=False,
                train=TrainConfig(lr=1e-2, lora_r=4),
                round_timeout=120,
                sampling={"temperature": 1.0, "max_tokens": 12},
                policy=policy,
            )
            trainer = Trainer(
                algo,
                n_runners=0,
                server_url=server.url,
                run_dir=tmp_path / "run",
                console=Console(quiet=True),
            )
            tasks = [Task(id=f"t{i}", data={"q": f"What is {i} plus 30?"}) for i in range(4)]
            result = trainer.fit(chat_agent, tasks, [Task(id="v", data={"q": "What is 12 plus 30?"})])
        finally:
            runner.stop()
            thread.join(30)
        engine.close()

    assert [(r.rollouts, r.succeeded, r.kept) for r in result.rounds] == [(8, 8, 4), (8, 8, 4)]
    assert all(r.rows >= 1 and r.train is not None and r.val is not None for r in result.rounds)
    assert engine.version == "sft-r2"
    latest = client.latest_resources()
    assert latest is not None and latest.version == result.resources_version
    weights, llm = latest.resources["policy_weights"], latest.resources["llm"]
    assert isinstance(weights, ModelWeights) and Path(weights.path, "adapter_model.safetensors").is_file()
    assert isinstance(llm, LLM) and llm.base_url == engine_server.base_url
    # round 2 sampled from round 1's weights, and the gateway recorded which weights served each call
    round2 = client.list_rollouts(mode=Mode.TRAIN, resources_version=result.rounds[0].resources_version).items
    calls = [e for r in round2 for e in client.all_events(r.id, type=["llm_call"])]
    assert len(calls) == 16 and {str(e.data.get("model_version")) for e in calls} == {"sft-r1"}
