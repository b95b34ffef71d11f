"""GRPO end to end on a tiny random model: server, runner, gateway and engine, for real."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from agentbolt import Trainer
from agentbolt.algorithms.grpo import GRPO
from agentbolt.engine import tiny_model_dir
from agentbolt.memory import descendants
from agentbolt.schemas import Mode
from agentbolt.store import open_store
from tests.algorithms.training_agents import LengthAgent, VictimAgent, VowelAgent
from tests.conftest import tiny_grpo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _grpo(model: str, steps: int, resume: bool = False) -> GRPO:
    return tiny_grpo(
        model,
        steps=steps,
        val_every=1,
        checkpoint_every=1,
        resume=resume,
        success_threshold=0.3,
        plot=True,
    )


def test_grpo_smoke_run_and_resume(tiny, tmp_path):
    train = [{"id": f"t{i}", "q": f"say something {i}"} for i in range(4)]
    val = [{"id": f"v{i}", "q": f"val {i}"} for i in range(3)]
    run_dir = tmp_path / "run"
    result = Trainer(_grpo(tiny, 2), n_runners=1, runner_concurrency=8, run_dir=run_dir).fit(
        VowelAgent(), train, val
    )

    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    assert result.history[0]["step"] == 0 and "val_success" in result.history[0]
    assert all(h["rollouts"] == 8 and h["failed"] == 0 for h in steps)
    # the random policy gives rewards with a spread: at least one step trained on tokens
    assert any(h["train_tokens"] > 0 for h in steps)
    assert all(0.0 <= h["clip_fraction"] <= 1.0 for h in steps if "clip_fraction" in h)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert result.plot is not None and result.plot.stat().st_size > 10_000
    assert (run_dir / "checkpoint" / "state.json").exists()
    store = open_store(str(run_dir / "agentbolt.db"))
    try:  # each validation rollout names its run, for a resume to cancel it (test_grpo_async)
        validation = store.list_rollouts(mode=Mode.VAL, limit=1000).items
    finally:
        store.close()
    assert len(validation) >= 3 and {r.metadata.get("run") for r in validation} == {"run"}

    resumed = Trainer(_grpo(tiny, 3, resume=True), n_runners=1, runner_concurrency=8, run_dir=run_dir).fit(
        VowelAgent(), train, val
    )
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3]
    assert resumed.history[:3] == result.history[:3]
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 3


def test_grpo_against_a_remote_vllm_style_server(tiny, tmp_path):
    """The vLLM path: sampling on a separately started OpenAI-compatible server, each update
    written as a LoRA adapter and loaded through POST /v1/load_lora_adapter (the embedded
    engine speaks that API as vLLM does)."""
    import httpx

    from agentbolt.engine import EngineServer, ModelEngine

    engine = ModelEngine.from_pretrained(tiny, dtype="float32")
    with EngineServer(engine) as served:
        algo = _grpo(tiny, 1)
        algo.serve_url, algo.serve_model, algo.val_every = served.base_url, engine.name, 0
        run_dir = tmp_path / "remote"
        train = [{"id": f"t{i}", "q": f"hello {i}"} for i in range(2)]
        result = Trainer(algo, n_runners=1, runner_concurrency=8, run_dir=run_dir).fit(
            LengthAgent(), train, []
        )
        assert [h["step"] for h in result.history] == [0, 1]
        assert result.history[1]["train_tokens"] > 0
        adapter = run_dir / "adapters" / "step-00001"
        assert (adapter / "adapter_config.json").exists()
        served_models = [m["id"] for m in httpx.get(f"{served.base_url}/models").json()["data"]]
        [name] = [m for m in served_models if re.fullmatch(r"policy-[0-9a-f]{6}-step-1", m)]
        # served beside the base weights, as vLLM serves LoRA: the weights themselves never changed
        assert engine.version == 0 and engine._batcher.adapters.loaded[name].pairs


def _kill_the_victim(folder: Path, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the runner process named in ``victim.pid`` once it appears (a descendant of this
    test process, never the test itself)."""
    pid_file = folder / "victim.pid"
    while not stop.is_set() and not pid_file.exists():
        time.sleep(0.05)
    if stop.is_set():
        return
    pid = int(pid_file.read_text())
    # runners start through the forkserver: a descendant of this process, not always a child
    assert pid != os.getpid() and pid in descendants(os.getpid())
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


def test_a_runner_killed_mid_step_loses_no_group_member(tiny, tmp_path):
    """Two runner processes and a 3 s lease; one is SIGKILLed while it holds attempts of step 1.
    Its rollouts come back after the lease expires, the other runner finishes them, every group
    keeps its 4 members, and only each rollout's last attempt is trained on."""
    algo = _grpo(tiny, 1)
    algo.val_every, algo.plot = 0, False
    train = [{"id": f"t{i}", "q": f"say something {i}", "dir": str(tmp_path)} for i in range(2)]
    out = io.StringIO()
    killed: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_kill_the_victim, args=(tmp_path, killed, stop), daemon=True)
    watcher.start()
    trainer = Trainer(
        algo,
        n_runners=2,
        runner_concurrency=4,
        run_dir=tmp_path / "run",
        lease_seconds=3,
        console=Console(file=out, width=140),
    )
    try:
        result = trainer.fit(VictimAgent(), train, [])
    finally:
        stop.set()
        watcher.join(5)
    assert len(killed) == 1
    step = result.history[1]
    assert (step["step"], step["rollouts"], step["failed"], step["dropped_groups"]) == (1, 8, 0, 0)
    assert step["retried"] >= 1 and step["groups"] == 2
    assert step["samples"] == 8  # the killed attempt's model call is not a sample of its own
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert logged["retried"] == step["retried"]
    # off a terminal: one plain line per step, with the table's figures
    lines = [x for x in out.getvalue().splitlines() if x.startswith("GRPO step 1 |")]
    assert len(lines) == 1
    assert f"| reward mean {step['reward_mean']:.3f} |" in lines[0]
    assert f"| retried {step['retried']} |" in lines[0]
    assert "┏" not in out.getvalue()  # and no table at the end, its 30 columns cut to a few characters


def test_activation_checkpointing_option_resolves_and_rejects_bad_values(tiny):
    assert tiny_grpo(tiny).checkpointing  # 4096-token micro-batches: on
    assert not tiny_grpo(tiny, max_tokens_per_micro_batch=1024).checkpointing
    assert not tiny_grpo(tiny, activation_checkpointing=False).checkpointing
    assert tiny_grpo(tiny, max_tokens_per_micro_batch=512, activation_checkpointing=True).checkpointing
    from agentbolt.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        tiny_grpo(tiny, activation_checkpointing="yes")
    assert str(err.value) == "activation_checkpointing must be True, False or None (automatic); got 'yes'"


def test_a_checkpointed_update_equals_the_plain_one(tiny):
    """The same optimizer step with and without activation checkpointing: loss, metrics and the
    updated weights agree (float32, 1e-5), over several micro-batches sharing a prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentbolt.algorithms.losses import TrainRow
    from agentbolt.algorithms.train_state import TrainConfig, make_train_state

    g = torch.Generator().manual_seed(0)
    prompt = tuple(int(x) for x in torch.randint(3, 200, (24,), generator=g))
    rows = []
    for i in range(6):
        answer = tuple(int(x) for x in torch.randint(3, 200, (3 + i,), generator=g))
        mask = (0,) * len(prompt) + (1,) * len(answer)
        old = tuple(-1.0 * m for m in mask)
        rows.append(TrainRow(prompt + answer, mask, old, 1.0 if i % 2 else -1.0))
    results = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        state = make_train_state(model, TrainConfig(lora_r=4, lr=1e-2))
        for name, p in state.model.named_parameters():  # LoRA B starts at 0: give the adapter weight
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
        algo = tiny_grpo(tiny, max_tokens_per_micro_batch=80, activation_checkpointing=checkpoint)
        metrics = algo._update(state, rows)
        trained = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
        results.append((metrics, trained))
    (plain, plain_weights), (ckpt, ckpt_weights) = results
    assert plain.keys() == ckpt.keys() and plain["num_tokens"] == ckpt["num_tokens"] > 0
    for name, value in plain.items():
        assert ckpt[name] == pytest.approx(value, abs=1e-5), name
    moved = [n for n, w in plain_weights.items() if "lora_B" in n]
    assert moved
    for name, weight in plain_weights.items():
        assert torch.allclose(ckpt_weights[name], weight, atol=1e-5), name


def test_low_memory_maps_the_updates_blocks_and_changes_nothing_else(tiny, monkeypatch):
    """``low_memory``: the update runs inside ``large_blocks_mapped`` (its large blocks handed back
    when freed); off (the default), it does not; the step is the same either way."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from agentbolt.algorithms import grpo as grpo_module
    from agentbolt.algorithms import grpo_update
    from agentbolt.algorithms.losses import TrainRow
    from agentbolt.algorithms.train_state import TrainConfig, make_train_state

    entered: list[bool] = []
    real = grpo_update.large_blocks_mapped

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with real(*args, **kwargs) as mapped:
            entered.append(mapped)
            yield mapped

    monkeypatch.setattr(grpo_update, "large_blocks_mapped", recording)
    rows = [TrainRow((5, 6, 7, 8, 9), (0, 0, 1, 1, 1), (-1.0,) * 5, a) for a in (1.0, -1.0)]
    weights = []
    for low in (False, True):
        torch.manual_seed(0)
        state = make_train_state(
            AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), TrainConfig(lora_r=4)
        )
        grpo_module.GRPO(model=tiny, low_memory=low)._update(state, rows)
        weights.append({n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad})
        assert len(entered) == int(low)
    assert grpo_module.GRPO().low_memory is False
    for name, w in weights[0].items():
        assert torch.equal(weights[1][name], w), name


def test_the_embedded_engine_runs_the_forward_grpo_asks_for(tiny, tmp_path):
    """``GRPO.engine_forward`` reaches the embedded engine ("auto" by default: the engine's own
    for a Llama model); a value that is not a forward pass is refused up front."""
    from rich.console import Console

    from agentbolt.algorithms.policy import serve_policy
    from agentbolt.errors import ConfigError

    assert GRPO().engine_forward == "auto"
    with pytest.raises(ConfigError, match="engine_forward must be"):
        GRPO(engine_forward="fast")
    for forward, runs in (("auto", "engine"), ("transformers", "transformers")):
        with serve_policy(tiny, tmp_path, Console(quiet=True), forward=forward) as policy:
            assert policy.engine.stats()["forward"] == runs  # type: ignore[attr-defined]
