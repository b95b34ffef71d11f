"""A tiny SFT run as a Python script under ``torchrun`` (tests/algorithms/test_distributed.py):
every rank builds the same Trainer and calls ``fit``; rank 0 serves the tiny model, runs the
store, runners and rollouts and publishes, the other ranks join the updates and get None.

``python distributed_sft_worker.py MODEL_DIR RUN_DIR``: rank 0 writes RUN_DIR/result.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from distributed_agent import vowels
from rich.console import Console

from agentbolt import Trainer
from agentbolt.algorithms import distributed
from agentbolt.algorithms.sft import SFT
from agentbolt.algorithms.train_state import TrainConfig


def main() -> None:
    model, run_dir = sys.argv[1], Path(sys.argv[2])
    trained: list[int] = []  # micro-batches this rank trained on, update by update
    step = distributed._step

    def counting(group, state, batches, loss_fn, bf16, reference):  # type: ignore[no-untyped-def]
        out = step(group, state, batches, loss_fn, bf16, reference)
        ranks = group.size if group is not None else 1
        owned = distributed.balance([int(b.input_ids_BT.numel()) for b in batches], ranks)
        trained.append(len(owned[group.rank if group is not None else 0]))
        return out

    distributed._step = counting  # a spy on the real update, to see each rank's share
    algo = SFT(
        model=model,
        rounds=1,
        rollouts_per_task=4,
        min_reward=None,
        top_fraction=0.5,
        epochs=1,
        batch_size=6,
        max_tokens_per_micro_batch=32,  # one row per micro-batch: both ranks train
        bf16=False,
        train=TrainConfig(lr=1e-2, lora_r=4, lora_alpha=8),
        round_timeout=120,
        validate_before=False,
        val_greedy=False,
    )
    tasks = [{"q": "say a"}, {"q": "banana"}, {"q": "abc"}]
    trainer = Trainer(algo, n_runners=1, runner_concurrency=8, run_dir=run_dir, console=Console(quiet=True))
    result = trainer.fit(vowels, tasks, [])
    if distributed.rank() > 0:
        assert result is None
        (run_dir / f"rank{distributed.rank()}.json").write_text(json.dumps(trained))
        return
    r = result.rounds[0]
    out = {"rows": r.rows, "steps": r.train.steps if r.train else 0, "version": result.resources_version}
    out.update(weights=str(result.weights_path), trained=trained)
    (run_dir / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
