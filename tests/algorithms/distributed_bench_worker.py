"""FSDP2 (``fully_shard``) against DDP-style replicas (``agentbolt.algorithms.distributed``) for
one SFT update on CPU/gloo: the figures in docs/training.md ("Distributed training (torchrun)").
Not a test: run by hand, on a quiet machine, e.g.

    torchrun --standalone --nproc-per-node 2 tests/algorithms/distributed_bench_worker.py tiny ddp
    torchrun --standalone --nproc-per-node 2 tests/algorithms/distributed_bench_worker.py smollm2 fsdp2
    python tests/algorithms/distributed_bench_worker.py smollm2 ddp   # one rank, for reference

``tiny``: the tests' 2-layer, 64-wide Llama, full fine-tuning. ``smollm2``: a random Llama of
SmolLM2-135M's shapes (30 layers, width 576, vocabulary 49152) with a rank-16 LoRA adapter on
every linear layer. Strategies: ``ddp`` (DDP-style replicas, the default) and ``fsdp2``, each
in its own launch (the peak memory is the process's). One warm-up update, then the median seconds of 3 updates of 8
micro-batches (4 per rank on 2 ranks), and the peak resident memory of the rank. Rank 0 prints a
JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from agentbolt.algorithms import distributed
from agentbolt.algorithms.losses import Batch, TrainRow, forward_logits, logprobs_from_logits, pad_batch
from agentbolt.algorithms.train_state import TrainConfig, make_train_state


def model_of(size: str) -> tuple[LlamaForCausalLM, TrainConfig, int]:
    torch.manual_seed(0)
    if size == "tiny":
        cfg = LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return LlamaForCausalLM(cfg), TrainConfig(lora=False, lr=1e-4), 64
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg), TrainConfig(lora=True, lora_r=16, lora_alpha=32, lr=1e-4), 128


def micro(vocab: int, length: int, n: int = 8) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        rows = [
            TrainRow(
                tuple(torch.randint(1, vocab, (length,), generator=g).tolist()),
                (0,) * 8 + (1,) * (length - 8),
            )
            for _ in range(2)
        ]
        out.append(pad_batch(rows))
    return out


def sft_loss(model: Any, batch: Batch, num_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT's loss through the root module's forward (full logits) for both strategies: FSDP2
    all-gathers the embedding, final norm and output layer in the root's hooks, which the
    chunked :func:`~agentbolt.algorithms.losses.sft_loss` bypasses (it calls the decoder and the
    head apart)."""
    logprobs = logprobs_from_logits(
        forward_logits(model, batch.input_ids_BT, batch.attention_mask_BT), batch.input_ids_BT
    )
    return -(logprobs * batch.loss_mask_BT).sum() / num_tokens, {}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_updates(run: Any, repeats: int = 3) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replicas(size: str, batches: list[Batch]) -> float:
    """DDP-style: replicated weights, one flat gradient all-reduce after accumulation."""
    model, config, _ = model_of(size)
    state = make_train_state(model, config)
    group = distributed._group
    return time_updates(lambda: distributed._step(group, state, batches, sft_loss, False, False))


def fsdp2(size: str, batches: list[Batch]) -> float:
    """FSDP2: every decoder layer and the root sharded; gradients reduce-scattered once, at the
    rank's last micro-batch (every rank runs the same number: FSDP's forward is collective)."""
    from torch.distributed.fsdp import fully_shard

    model, config, _ = model_of(size)
    state = make_train_state(model, config)
    root = state.model
    layers = root.get_base_model().model.layers if config.lora else root.model.layers
    for layer in layers:
        fully_shard(layer)
    fully_shard(root)
    params = [p for p in root.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    mine = batches[dist.get_rank() :: dist.get_world_size()]
    total = float(sum(b.num_tokens for b in batches))

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        for i, b in enumerate(mine):
            root.set_requires_gradient_sync(i == len(mine) - 1)
            loss, _ = sft_loss(root, b, total)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return time_updates(run)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    size = sys.argv[1]
    _, _, length = model_of(size) if size == "tiny" else (None, None, 128)
    vocab = 300 if size == "tiny" else 49152
    batches = micro(vocab, length)
    ranks = distributed.world_size()
    if ranks > 1:
        distributed._join(torch.device("cpu"))
    fn = {"ddp": replicas, "fsdp2": fsdp2}[sys.argv[2]]
    seconds = fn(size, batches)
    if distributed.rank() == 0:
        line = {"model": size, "ranks": ranks, "strategy": sys.argv[2], "s_per_update": round(seconds, 3)}
        print(json.dumps({**line, "peak_rss_mb_rank0": round(peak_mb())}), flush=True)
    distributed._leave()


if __name__ == "__main__":
    main()
