"""One rank of the FSDP2 tests (tests/algorithms/test_distributed_fsdp.py), run under ``torchrun``
with ``AGENTBOLT_DIST_STRATEGY=fsdp2`` (several gloo ranks on the CPU) or as one plain process
(the one-rank reference, through the existing ``optimizer_step``).

``python distributed_fsdp_worker.py SCENARIOS OUT_DIR [RESUME_DIR]`` (SCENARIOS comma-separated);
rank 0 writes ``OUT_DIR/<name>.safetensors`` (rank 0's full model's trainable weights after the
scenario) and ``OUT_DIR/info.json``. The model and rows are distributed_update_worker.py's (a tiny
random Llama, rows of uneven lengths: 7 micro-batches split 3/4 over 2 ranks, then 1 micro-batch
with the other rank padding with a zero-weight pass).

- ``lora_kl``: two GRPO updates, LoRA, with the KL term (the reference is the model with its
  adapter disabled, through the sharded root);
- ``full_kl``: two GRPO updates, full fine-tuning, KL against a sharded frozen reference;
- ``sft``: two SFT updates, full fine-tuning;
- ``prefix``: ``lora_kl`` with a 20-token prompt shared by every row (one rank computes it once
  per micro-batch; FSDP2 ranks run every layer once per pass, the same values);
- ``first``: ``lora_kl``'s first update only, then a checkpoint (optimizer state gathered from the
  shards) in ``OUT_DIR/ckpt``;
- ``resume``: ``lora_kl``'s second update from the checkpoint in ``RESUME_DIR`` -> ``resumed``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed_update_worker import MAX_TOKENS, rows, run_update, tiny_model, trainable
from safetensors.torch import save_file

from agentbolt.algorithms import distributed
from agentbolt.algorithms.losses import Batch, PolicyLoss, micro_batches, pad_batch, sft_loss
from agentbolt.algorithms.train_state import TrainConfig, load_checkpoint, make_train_state, save_checkpoint

PREFIX = tuple(range(200, 220))


def batches(step: int, prefix: bool) -> list[Batch]:
    step_rows = rows(step)
    if prefix:
        step_rows = [
            replace(
                r,
                input_ids=PREFIX + r.input_ids,
                loss_mask=(0,) * len(PREFIX) + r.loss_mask,
                old_logprobs=(0.0,) * len(PREFIX) + tuple(r.old_logprobs or ()),
            )
            for r in step_rows
        ]
    return [pad_batch(mb) for mb in micro_batches(step_rows, max_tokens=MAX_TOKENS[step] + 40 * prefix)]


def scenario(name: str, out: Path, resume: Path | None, info: dict[str, Any]) -> None:
    lora = name in ("lora_kl", "first", "resume", "prefix")
    kl = name != "sft"
    config = TrainConfig(lora=lora, lora_r=4, lora_alpha=8, lr=1e-3)
    state = make_train_state(tiny_model(), config, reference=kl)
    loss: Any = PolicyLoss(kl_coef=0.1, entropy=True) if kl else sft_loss
    distributed.setup_followers(state, tiny_model())
    group = distributed._group
    if group is not None and group.sharded is not None:  # what rank 0 holds of the model
        params = list(group.sharded.root.parameters())
        info.setdefault("shard", {})[name] = [
            sum(p.to_local().numel() for p in params),  # type: ignore[attr-defined]
            sum(p.numel() for p in params),
        ]
    steps: tuple[int, ...] = (1, 2)
    if name == "first":
        steps = (1,)
    elif name == "resume":
        assert resume is not None
        ckpt = load_checkpoint(resume, state.model, state.optimizer)
        state.step = ckpt.step
        distributed.share_state(state)
        steps = (2,)
    for step in steps:
        step_batches = batches(step, prefix=name == "prefix")
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        owned = distributed.balance([int(b.input_ids_BT.numel()) for b in step_batches], ranks)
        info.setdefault("micro_batches_per_rank", {})[f"{name}:{step}"] = [len(o) for o in owned]
        metrics = run_update(state, step_batches, loss, reference=kl)
        info.setdefault("metrics", {})[f"{name}:{step}"] = metrics
    info.setdefault("steps", {})[name] = state.step
    if name == "first":
        save_checkpoint(out / "ckpt", state.model, state.optimizer, state.step)
    save_file(trainable(state), out / f"{'resumed' if name == 'resume' else name}.safetensors")


def main() -> None:
    torch.set_num_threads(1)
    names, out = sys.argv[1].split(","), Path(sys.argv[2])
    resume = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    if distributed.rank() > 0:
        try:
            state = distributed.follow()
        except distributed.DistributedError as exc:
            print(f"rank {distributed.rank()} ended: {exc}", file=sys.stderr, flush=True)
            sys.exit(3)
        assert state is not None
        return
    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"world_size": distributed.world_size(), "strategy": distributed.strategy()}
    with distributed.leader(torch.device("cpu")):
        for n in names:
            scenario(n, out, resume, info)
    (out / "info.json").write_text(json.dumps(info))
    print("rank 0 done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
