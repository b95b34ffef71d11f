"""FSDP2 (``AGENTBOLT_DIST_STRATEGY=fsdp2``) updates over real gloo ranks under ``torchrun`` on the CPU.

The ranks run tests/algorithms/distributed_fsdp_worker.py (the tiny random Llama and uneven rows of
distributed_update_worker.py: 7 micro-batches split 3/4 over 2 ranks, then 1 micro-batch, the
other rank running a zero-weight pass so FSDP's collectives line up); the one-rank reference is
the same script as one plain process, through the existing ``optimizer_step``.

Tolerance: after two AdamW steps (lr 1e-3) the trainable weights agree within TOLERANCE. Measured:
8e-8 with LoRA, 1.5e-6 (SFT) and 4.8e-6 (GRPO with KL) with full fine-tuning: float32 sums in
another order (the reduce-scatter, the sharded clip norm), which Adam's first steps (updates of
about lr x sign) amplify. The loss, gradient norm and KL must agree within 1e-5 relative: a
gradient averaged over the ranks instead of summed would halve the gradient norm (the weights
alone could not tell: Adam is nearly scale-invariant).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentbolt.algorithms import distributed
from agentbolt.errors import ConfigError
from tests.algorithms.dist_launch import launch_env, run_ranks

HERE = Path(__file__).parent
WORKER = str(HERE / "distributed_fsdp_worker.py")
TOLERANCE = 2e-5
LAUNCH_TIMEOUT = 120
SCENARIOS = ("lora_kl", "full_kl", "sft", "prefix")

pytestmark = pytest.mark.timeout(300)


def _run(args: list[str], *, fsdp2: bool) -> None:
    env = launch_env(AGENTBOLT_DIST_STRATEGY="fsdp2") if fsdp2 else launch_env()
    run_ranks([sys.executable, *args], env, LAUNCH_TIMEOUT)


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys() and x
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """One process (every scenario, and a checkpoint after the first update); 2 fsdp2 ranks
    (every scenario, a checkpoint, and the second update resumed from the one-process
    checkpoint); one process resuming from the 2-rank checkpoint."""
    one, two, back = (tmp_path_factory.mktemp(n) for n in ("one", "two", "back"))
    _run([WORKER, ",".join((*SCENARIOS, "first")), str(one)], fsdp2=False)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER]
    _run([*torchrun, ",".join((*SCENARIOS, "first", "resume")), str(two), str(one / "ckpt")], fsdp2=True)
    _run([WORKER, "resume", str(back), str(two / "ckpt")], fsdp2=False)
    return one, two, back


def test_two_fsdp2_ranks_give_the_one_rank_updates(runs: tuple[Path, Path, Path]) -> None:
    one, two, _ = runs
    info = json.loads((two / "info.json").read_text())
    assert info["world_size"] == 2 and info["strategy"] == "fsdp2"
    for name in SCENARIOS:
        counts = info["micro_batches_per_rank"]
        assert sorted(counts[f"{name}:1"]) == [3, 4] and sorted(counts[f"{name}:2"]) == [0, 1]
        local, full = info["shard"][name]
        assert local * 2 == full  # rank 0 holds half of every parameter: the model is sharded
        assert _max_diff(one / f"{name}.safetensors", two / f"{name}.safetensors") < TOLERANCE
    ref = json.loads((one / "info.json").read_text())["metrics"]
    for key, metrics in ref.items():
        if key.startswith("first"):
            continue
        for metric in ("loss", "grad_norm", "kl", "num_tokens"):
            if metric in metrics:
                assert info["metrics"][key][metric] == pytest.approx(metrics[metric], rel=1e-5, abs=1e-7), (
                    key,
                    metric,
                )
        assert info["metrics"][key]["ranks_idle"] == (1.0 if key.endswith(":2") else 0.0)


def test_a_checkpoint_from_two_fsdp2_ranks_resumes_on_one(runs: tuple[Path, Path, Path]) -> None:
    """The optimizer state gathered from the shards: the second update on one process from it
    gives the one-process run's weights."""
    one, two, back = runs
    assert json.loads((two / "ckpt" / "state.json").read_text())["step"] == 1
    assert _max_diff(one / "lora_kl.safetensors", back / "resumed.safetensors") < TOLERANCE


def test_a_checkpoint_from_one_rank_resumes_on_two_fsdp2_ranks(runs: tuple[Path, Path, Path]) -> None:
    """The full optimizer state scattered into the shards."""
    one, two, _ = runs
    assert _max_diff(one / "lora_kl.safetensors", two / "resumed.safetensors") < TOLERANCE


def test_grpo_end_to_end_with_fsdp2_from_the_cli(tmp_path: Path) -> None:
    """``AGENTBOLT_DIST_STRATEGY=fsdp2 agentbolt train grpo --nproc 2``: rank 0 serves the tiny
    model, runs the rollouts, syncs and publishes rank 0's full model after each sharded update
    and writes a checkpoint whose optimizer state is gathered from both ranks' shards."""
    from agentbolt.engine import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "say a"}\n{"q": "banana"}\n{"q": "abc"}\n')
    run_dir = tmp_path / "run"
    args = ["-m", "agentbolt", "train", "grpo", "--nproc", "2", "--model", str(model), "--train", str(tasks)]
    args += ["--agent", f"{HERE / 'distributed_agent.py'}:vowels", "--steps", "2", "--tasks-per-step", "2"]
    args += ["--group-size", "4", "--lr", "1e-3", "--val-every", "0", "--checkpoint-every", "1"]
    args += ["--engine-dtype", "float32", "--no-bf16", "--no-plot", "--no-validate-before"]
    args += ["--concurrency", "8", "--run-dir", str(run_dir), "--max-tokens-per-micro-batch", "64"]
    _run(args, fsdp2=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["resources_version"] > rows[0]["resources_version"] >= 2
    trained = [r for r in rows if r["train_tokens"]]
    assert trained and all(r["ranks_idle"] == 0 and r["grad_norm"] > 0 for r in trained)
    ckpt = run_dir / "checkpoint"
    assert json.loads((ckpt / "state.json").read_text())["step"] == len(trained)
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    weights = load_file(str(ckpt / "trainable.safetensors"))
    moments = sorted(tuple(s["exp_avg"].shape) for s in optimizer["state"].values())
    assert moments == sorted(tuple(w.shape) for w in weights.values())  # full, not shards


def test_a_bad_strategy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbolt.algorithms import SFT

    monkeypatch.setenv("AGENTBOLT_DIST_STRATEGY", "zero3")
    with pytest.raises(ConfigError, match="AGENTBOLT_DIST_STRATEGY='zero3': choose replicate or fsdp2"):
        distributed.check_launch(SFT())
    monkeypatch.setenv("AGENTBOLT_DIST_STRATEGY", "fsdp2")
    assert distributed.strategy() == "fsdp2"
    monkeypatch.delenv("AGENTBOLT_DIST_STRATEGY")
    assert distributed.strategy() == "replicate"
    assert torch.distributed.is_available()
