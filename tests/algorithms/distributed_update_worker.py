"""One rank of the distributed-update tests (tests/algorithms/test_distributed.py), run under
``torchrun`` (several gloo ranks on the CPU) or as one plain process (the one-rank reference).

``python distributed_update_worker.py SCENARIO OUT_DIR [RESUME_DIR]``; rank 0 writes
``OUT_DIR/<name>.safetensors`` (the trainable weights after the scenario) and ``OUT_DIR/info.json``.

Scenarios (each its own tiny random Llama, rows of uneven lengths, several micro-batches):

- ``grpo``: two GRPO updates (PolicyLoss, LoRA) -> ``grpo``;
- ``sft``: two SFT updates (sft_loss, full fine-tuning) -> ``sft``;
- ``async_kl``: two asynchronous-GRPO updates (proximal ratio, truncated importance weights)
  with the KL term, each rank computing its micro-batches' reference log-probs -> ``async_kl``;
- ``per_rank``: the GRPO updates with each rank's loss divided by its OWN token count (the
  wrong normalisation the test must tell apart) -> ``per_rank``;
- ``first``: the first GRPO update only, checkpointed (full state, by rank 0) to ``OUT_DIR/ckpt``;
- ``resume``: the second GRPO update from the checkpoint in ``RESUME_DIR`` -> ``resumed``;
- ``die``: rank 0 sets the followers up and exits at once (the followers must end, not hang);
- ``fail``: rank 0 sets the followers up and raises (they end with its error).

``all`` runs per_rank, sft, async_kl, first and grpo in one launch (each launch costs seconds of imports).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from agentbolt.algorithms import distributed
from agentbolt.algorithms.losses import (
    Batch,
    PolicyLoss,
    TrainRow,
    micro_batches,
    pad_batch,
    reference_logprobs,
    sft_loss,
)
from agentbolt.algorithms.train_state import (
    TrainConfig,
    TrainState,
    load_checkpoint,
    make_train_state,
    optimizer_step,
    save_checkpoint,
)

LENGTHS = (37, 9, 23, 30, 6, 14, 41, 11, 19, 27)
MAX_TOKENS = {1: 64, 2: 4096}
"""Padded tokens per micro-batch by update: 7 micro-batches of uneven size (3 on one rank, 4 on
the other), then one micro-batch (the other rank has none)."""


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def rows(step: int) -> list[TrainRow]:
    """Rows of uneven lengths with a prompt (masked) and an answer, per-row advantages and
    recorded old log-probs (a little off the current policy, so the ratio is not 1)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, 300, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        mask = [0] * prompt + [1] * (n - prompt)
        old = (torch.randn(n, generator=g) * 0.1 - 5.7).tolist()
        out.append(TrainRow(tuple(ids), tuple(mask), tuple(old), advantage=float((-1) ** i * (0.5 + i / 10))))
    return out


def batches(step: int) -> list[Batch]:
    return [pad_batch(mb) for mb in micro_batches(rows(step), max_tokens=MAX_TOKENS[step])]


@dataclass(frozen=True)
class PerRankLoss:
    """The wrong normalisation: each rank divides by the token count of its own micro-batches
    (``local`` by rank), as a naive per-rank mean would."""

    inner: Any
    local: dict[int, int]

    def __call__(self, model: Any, batch: Batch, num_tokens: float) -> Any:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.inner(model, batch, float(self.local[rank]))


def grpo_state(lora: bool = True) -> TrainState:
    return make_train_state(tiny_model(), TrainConfig(lora=lora, lora_r=4, lora_alpha=8, lr=1e-3))


def run_update(
    state: TrainState, step_batches: list[Batch], loss: Any, reference: bool = False
) -> dict[str, float]:
    """The distributed update on several ranks; on one process the existing one-rank path
    (GRPO's: the reference log-probs added to every micro-batch first)."""
    if distributed.leading():
        return distributed.update(state, step_batches, loss, reference=reference)
    if reference:
        step_batches = [
            replace(b, ref_logprobs_BT=reference_logprobs(state.reference_model, b)) for b in step_batches
        ]
    return optimizer_step(state, step_batches, loss)


def trainable(state: TrainState) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().contiguous() for n, p in state.model.named_parameters() if p.requires_grad}


def scenario(name: str, out: Path, resume: Path | None, info: dict[str, Any]) -> None:
    policy = PolicyLoss(entropy=True)
    if name == "async_kl":  # asynchronous GRPO's loss (proximal ratio, importance weights) with KL
        policy = PolicyLoss(kl_coef=0.1, proximal=True, importance="token", importance_cap=1.05)
    if name == "sft":
        state = make_train_state(tiny_model(), TrainConfig(lora=False, lr=1e-3))
        source: Any = tiny_model()
        loss: Any = sft_loss
    else:
        state = grpo_state()
        source, loss = tiny_model(), policy
    distributed.setup_followers(state, source)
    steps = (1, 2)
    if name == "first":
        steps = (1,)
    elif name == "resume":
        assert resume is not None
        ckpt = load_checkpoint(resume, state.model, state.optimizer)
        state.step = ckpt.step
        distributed.share_state(state)
        steps = (2,)
    for step in steps:
        step_batches = batches(step)
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        owned = distributed.balance([int(b.input_ids_BT.numel()) for b in step_batches], ranks)
        info.setdefault("micro_batches_per_rank", {})[f"{name}:{step}"] = [len(o) for o in owned]
        if name == "per_rank":
            local = {r: sum(step_batches[i].num_tokens for i in o) for r, o in enumerate(owned)}
            loss = PerRankLoss(policy, local)
        metrics = run_update(state, step_batches, loss, reference=name == "async_kl")
        info.setdefault("metrics", {})[f"{name}:{step}"] = metrics
    if name == "first":
        save_checkpoint(out / "ckpt", state.model, state.optimizer, state.step)
    saved = "resumed" if name == "resume" else name
    save_file(trainable(state), out / f"{saved}.safetensors")


def main() -> None:
    torch.set_num_threads(1)
    distributed._BUCKET_ELEMENTS = 4096  # several all-reduce buckets per update, as a big model has
    which, out = sys.argv[1], Path(sys.argv[2])
    resume = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    # one group for the whole launch; each scenario sets the followers' model up afresh, so
    # the followers' replica at the end is the last scenario's (grpo, or the one asked for)
    names = ["per_rank", "sft", "async_kl", "first", "grpo"] if which == "all" else [which]
    if distributed.rank() > 0:
        try:
            state = distributed.follow()
        except distributed.DistributedError as exc:
            print(f"rank {distributed.rank()} ended: {exc}", file=sys.stderr, flush=True)
            sys.exit(3)
        assert state is not None
        saved = "resumed" if names[-1] == "resume" else names[-1]
        save_file(trainable(state), out / f"{saved}.rank{distributed.rank()}.safetensors")
        return
    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"world_size": distributed.world_size()}
    with distributed.leader(torch.device("cpu")):
        if which in ("die", "fail"):  # rank 0 dies without a word, or raises, after the setup
            distributed.setup_followers(grpo_state(), tiny_model())
            if which == "die":
                os._exit(7)
            raise RuntimeError("rollouts went wrong")
        for n in names:
            scenario(n, out, resume, info)
    (out / "info.json").write_text(json.dumps(info))
    print("rank 0 done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
