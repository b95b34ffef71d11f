"""Data-parallel GRPO and SFT updates over real gloo ranks under ``torchrun`` on the CPU.

The ranks run tests/algorithms/distributed_update_worker.py (tiny random Llamas, rows of uneven
lengths, 7 micro-batches split 3/4 over 2 ranks, then 1 micro-batch with the other rank idle);
the one-rank reference is the same script as one plain process, through the existing
``optimizer_step``. Tolerance: the trainable weights after two AdamW steps agree within
TOLERANCE (float32 sums in another order: 2-3e-7 measured); the wrong variants below move them
by more than 100 x that, so the comparison would catch a wrong reduction or normalisation.
Every launch has a timeout: a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentbolt.algorithms import distributed
from agentbolt.errors import ConfigError
from tests.algorithms.dist_launch import launch_env, run_ranks

HERE = Path(__file__).parent
WORKER = str(HERE / "distributed_update_worker.py")
TOLERANCE = 1e-5
LAUNCH_TIMEOUT = 150
sys.path.insert(0, str(HERE))

pytestmark = pytest.mark.timeout(240)


def _env(**extra: str) -> dict[str, str]:
    return launch_env(**extra)


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_ranks([*command, *args], _env(), LAUNCH_TIMEOUT)


def _one_process(*args: str) -> None:
    run_ranks([sys.executable, *args], _env(), LAUNCH_TIMEOUT)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario on 2 gloo ranks (one torchrun launch)."""
    out = tmp_path_factory.mktemp("two")
    _torchrun(WORKER, "all", str(out))
    return out


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario on one plain process (the existing one-rank update)."""
    out = tmp_path_factory.mktemp("one")
    _one_process(WORKER, "all", str(out))
    return out


def test_two_ranks_give_the_one_rank_grpo_and_sft_updates(one: Path, two: Path) -> None:
    info = json.loads((two / "info.json").read_text())
    assert info["world_size"] == 2
    counts = info["micro_batches_per_rank"]
    assert sorted(counts["grpo:1"]) == [3, 4]  # ranks with different numbers of micro-batches
    assert sorted(counts["grpo:2"]) == [0, 1]  # and a rank with none
    for name in ("grpo", "sft", "async_kl"):
        assert (
            _max_diff(_weights(one / f"{name}.safetensors"), _weights(two / f"{name}.safetensors"))
            < TOLERANCE
        )
    # the other rank's replica is rank 0's, bit for bit
    assert _max_diff(_weights(two / "grpo.safetensors"), _weights(two / "grpo.rank1.safetensors")) == 0.0
    # the metrics too: the loss summed over ranks is the one-rank loss (global token count)
    ref = json.loads((one / "info.json").read_text())["metrics"]
    for key in ("grpo:1", "grpo:2", "sft:1", "sft:2", "async_kl:1", "async_kl:2"):
        for name in ("loss", "grad_norm", "num_tokens", "kl", "is_weight_mean", "clip_fraction"):
            if name not in ref[key]:
                assert name not in info["metrics"][key] and key.startswith(("grpo", "sft"))
                continue
            assert info["metrics"][key][name] == pytest.approx(ref[key][name], rel=1e-5, abs=1e-6), (
                key,
                name,
            )
        assert info["metrics"][key]["ranks_idle"] == (1.0 if key.endswith(":2") else 0.0)


def test_a_per_rank_normalisation_would_be_caught(one: Path, two: Path) -> None:
    """Each rank dividing by its own token count (a naive per-rank mean) moves the weights far
    beyond the tolerance: the comparison above tells it apart."""
    wrong = _max_diff(_weights(one / "grpo.safetensors"), _weights(two / "per_rank.safetensors"))
    assert wrong > 100 * TOLERANCE


def test_a_missing_gradient_reduction_would_be_caught(one: Path) -> None:
    """Rank 0's share alone (no all-reduce) against the whole batch, on one process."""
    import distributed_update_worker as w

    from agentbolt.algorithms.losses import PolicyLoss
    from agentbolt.algorithms.train_state import optimizer_step

    torch.set_num_threads(1)
    state = w.grpo_state()
    for step in (1, 2):
        batches = w.batches(step)
        owned = distributed.balance([int(b.input_ids_BT.numel()) for b in batches], 2)
        total = float(sum(b.num_tokens for b in batches))
        mine = [batches[i] for i in owned[0]]
        loss = PolicyLoss()
        optimizer_step(state, mine, lambda m, b, _n, loss=loss, total=total: loss(m, b, total))
    wrong = _max_diff(_weights(one / "grpo.safetensors"), w.trainable(state))
    assert wrong > 100 * TOLERANCE


def test_resume_from_two_ranks_onto_one(one: Path, two: Path, tmp_path: Path) -> None:
    """The first update on 2 ranks, checkpointed by rank 0; the second on one process."""
    _one_process(WORKER, "resume", str(tmp_path), str(two / "ckpt"))
    assert (
        _max_diff(_weights(one / "grpo.safetensors"), _weights(tmp_path / "resumed.safetensors")) < TOLERANCE
    )


def test_resume_from_one_rank_onto_two(one: Path, tmp_path: Path) -> None:
    """The first update on one process, checkpointed; the second on 2 ranks."""
    _torchrun(WORKER, "resume", str(tmp_path), str(one / "ckpt"))
    resumed = _weights(tmp_path / "resumed.safetensors")
    assert _max_diff(_weights(one / "grpo.safetensors"), resumed) < TOLERANCE
    assert _max_diff(resumed, _weights(tmp_path / "resumed.rank1.safetensors")) == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("how", "code", "words"), [("die", 7, "rank 0"), ("fail", 1, "rollouts went wrong")])
def test_a_dead_or_failed_rank_0_ends_the_others_with_a_message(
    tmp_path: Path, how: str, code: int, words: str
) -> None:
    """Two ranks started by hand (no torchrun to clean up): rank 0 dies (or raises) after
    setting the other up; rank 1 ends with a message within seconds instead of waiting forever."""
    port = str(_free_port())
    procs = []
    for r in (0, 1):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
        env["AGENTBOLT_DIST_LIVENESS"] = "5"
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, how, str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        _, err0 = procs[0].communicate(timeout=LAUNCH_TIMEOUT)
        t0 = time.monotonic()
        _, err1 = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == code, err0[-2000:]
    assert procs[1].returncode == 3, err1[-2000:]
    assert "rank 1 ended:" in err1 and words in err1.split("rank 1 ended:")[1]
    assert time.monotonic() - t0 < 30


def test_grpo_end_to_end_on_two_ranks_from_the_cli(tmp_path: Path) -> None:
    """``agentbolt train grpo --nproc 2``: torchrun starts 2 ranks; rank 0 serves the tiny
    model, runs the store, runners and rollouts, and publishes each update; both ranks train."""
    from agentbolt.engine import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "say a"}\n{"q": "banana"}\n{"q": "abc"}\n')
    run_dir = tmp_path / "run"
    args = [
        "--agent",
        f"{HERE / 'distributed_agent.py'}:vowels",
        "--train",
        str(tasks),
        "--model",
        str(model),
    ]
    args += ["--steps", "2", "--tasks-per-step", "2", "--group-size", "4", "--lr", "1e-3", "--val-every", "0"]
    args += ["--checkpoint-every", "1", "--engine-dtype", "float32", "--no-bf16", "--no-plot"]
    args += ["--no-validate-before", "--concurrency", "8", "--run-dir", str(run_dir)]
    args += ["--max-tokens-per-micro-batch", "64"]  # several micro-batches: both ranks train
    done = run_ranks(
        [sys.executable, "-m", "agentbolt", "train", "grpo", "--nproc", "2", *args], _env(), LAUNCH_TIMEOUT
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train_tokens"] > 0 and r["ranks_idle"] == 0  # rank 1 took micro-batches
        assert r["resources_version"] >= 2
    assert rows[1]["resources_version"] > rows[0]["resources_version"]
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    assert done.stdout.count("GRPO step 2") == 1  # progress only from rank 0


def test_launch_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbolt.algorithms import Evaluate

    with pytest.raises(ConfigError, match="does not train over several ranks"):
        distributed.check_launch(Evaluate())
    monkeypatch.setenv("AGENTBOLT_DIST_BACKEND", "nccl")
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        distributed._backend(torch.device("cpu"))
    monkeypatch.setenv("AGENTBOLT_DIST_BACKEND", "mpi")
    with pytest.raises(ConfigError, match="choose gloo"):
        distributed._backend(torch.device("cpu"))
    monkeypatch.setenv("AGENTBOLT_DIST_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="expected seconds"):
        distributed._seconds("AGENTBOLT_DIST_TIMEOUT", 1.0)


def test_balance_spreads_micro_batches_by_tokens() -> None:
    assert distributed.balance([50, 10, 40, 30, 20], 2) == [[0, 1, 4], [2, 3]]  # 80 / 70
    assert distributed.balance([5], 3) == [[0], [], []]
    assert distributed.balance([], 2) == [[], []]


def test_sft_end_to_end_on_two_ranks_from_python(tmp_path: Path) -> None:
    """A Python script under torchrun: every rank calls Trainer.fit; rank 0 runs the round
    (rollouts, selection, export, sync, publish), rank 1 trains its share and gets None."""
    from agentbolt.engine import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _torchrun(str(HERE / "distributed_sft_worker.py"), str(model), str(run_dir))
    result = json.loads((run_dir / "result.json").read_text())
    assert result["rows"] >= 2 and result["steps"] == 1 and result["version"] >= 2
    assert (Path(result["weights"]) / "adapter_config.json").exists()
    rank1 = json.loads((run_dir / "rank1.json").read_text())
    assert len(rank1) == len(result["trained"]) == 1
    assert rank1[0] >= 1 and result["trained"][0] >= 1  # both ranks took micro-batches
