"""What each part of GRPO's update costs on a CPU: one update, variants alternated in one process.

The update of ``grpo_vs_trl.py``'s workload (SmolLM2, LoRA r=16, 4 prompts x 8 completions of
20-32 tokens, bfloat16 autocast where the CPU has it, activation checkpointing as GRPO's default
picks it) on fixed synthetic rows, timed with each variant in turn, ``--rounds`` times:

- ``default``: what GRPO does;
- ``sdpa-attention``: attention with gradients on transformers' sdpa (PyTorch's CPU flash kernel)
  instead of :mod:`agentbolt.algorithms.train_attention`;
- ``chunked-head``: the output layer's log-probs through the checkpointed chunk path instead of
  the one autograd function (``losses._HeadLogprobs``);
- ``low-memory``: ``GRPO(low_memory=True)``, the update's large blocks mapped on their own.

Each line gives the seconds, the page faults the update took and the highest resident size
sampled during it (every 5 ms). The first variant of the first round pays first-call costs;
compare within a round. Also prints the sampler's cost per decode step at 32 rows over the
vocabulary (``--sampling``), against the full sort the sampler used to do for every sampled row.

``--attention`` times one layer's attention forward and backward both ways at three shapes.

    python benchmarks/update_parts.py [--rounds 3] [--variants default,sdpa-attention] [--sampling] [--attention]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

VARIANTS = ("default", "sdpa-attention", "chunked-head", "low-memory")


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """The highest resident size of this process while the block runs, sampled every 5 ms."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with open("/proc/self/statm") as f:
                peak[0] = max(peak[0], int(f.read().split()[1]) * resource.getpagesize())
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def rows_for(tokenizer: Any) -> list[Any]:
    from agentbolt.algorithms.losses import TrainRow

    rng = random.Random(0)
    rows = []
    for p in range(4):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write one short sentence about the number {p}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = tuple(tokenizer(text, add_special_tokens=False).input_ids)
        for _ in range(8):
            n = rng.randint(20, 32)
            ids = prompt + tuple(rng.randrange(100, 40000) for _ in range(n))
            mask = (0,) * len(prompt) + (1,) * n
            rows.append(TrainRow(ids, mask, (-2.0,) * len(ids), rng.gauss(0, 1)))
    return rows


@contextlib.contextmanager
def variant(name: str, state: Any) -> Iterator[bool]:
    """The variant switched on for the block; yields GRPO's ``low_memory``."""
    import torch

    from agentbolt.algorithms import losses
    from agentbolt.algorithms.train_attention import NAME

    base = state.model.get_base_model()
    base.set_attn_implementation("sdpa" if name == "sdpa-attention" else NAME)
    real_nn = losses.nn
    if name == "chunked-head":  # masked_logprobs takes the fused path only for an nn.Linear head
        namespace = type("nn", (), dict(vars(torch.nn)))
        namespace.Linear = type("NotLinear", (), {})  # type: ignore[attr-defined]
        losses.nn = namespace  # type: ignore[assignment]
    try:
        yield name == "low-memory"
    finally:
        losses.nn = real_nn
        base.set_attn_implementation(NAME)


def updates(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.algorithms.train_state import (
        TrainConfig,
        fast_bf16,
        frozen_base_to,
        frozen_embeddings_to,
        make_train_state,
    )
    from agentbolt.engine import ensure_model

    path = str(ensure_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = make_train_state(model, TrainConfig(lora=True, lora_r=16, lora_alpha=32, lr=1e-4))
    bf16 = fast_bf16()
    if bf16:
        frozen_base_to(state.model, torch.bfloat16)
        frozen_embeddings_to(state.model, torch.bfloat16)
    rows = rows_for(tokenizer)
    print(
        f"GRPO update, SmolLM2, {len(rows)} rows, {sum(len(r.input_ids) for r in rows)} tokens, "
        f"{'bfloat16 autocast' if bf16 else 'float32'}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    for round_ in range(args.rounds):
        for name in args.variants:
            with variant(name, state) as low_memory:
                algo = GRPO(bf16=bf16, kl_coef=0.0, low_memory=low_memory)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                started = time.perf_counter()
                with peak_rss() as peak:
                    algo._update(state, rows)
                seconds = time.perf_counter() - started
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            times[name].append(seconds)
            print(
                f"round {round_ + 1} {name:15} {seconds:6.2f} s  {faults / 1e6:5.2f}M page faults  "
                f"peak {peak[0] / 1e9:.2f} GB resident",
                flush=True,
            )
    for name, ts in times.items():
        print(f"{name:15} {min(ts):.2f}-{max(ts):.2f} s per update")


def sampling(repeat: int = 20) -> None:
    import torch

    from agentbolt.engine.sampling import SamplingParams, sample_step

    logits = (torch.randn(32, 49152, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - started) / repeat * 1e3

    print(f"sampler, 32 rows x 49152 tokens, {torch.get_num_threads()} thread(s), ms per decode step:")
    for label, kwargs in (
        ("greedy", {"temperature": 0.0}),
        ("temperature 1", {"temperature": 1.0}),
        ("top_k 50", {"temperature": 0.7, "top_k": 50}),
        ("top_p 0.9 (random logits: head too small, full sort)", {"top_p": 0.9}),
    ):
        params = [SamplingParams(**kwargs) for _ in range(32)]  # type: ignore[arg-type]
        gens = [p.make_generator() for p in params]
        print(f"  {label:54} {timed(partial(sample_step, logits, params, gens)):6.2f}")
    probs = torch.softmax(logits.float(), dim=-1)
    print(
        f"  {'a full descending sort of the probabilities (the old path)':54} {timed(lambda: probs.sort(dim=-1, descending=True)):6.2f}"
    )


def attention(repeat: int = 5) -> None:
    """Forward and backward of one layer's attention (bfloat16, SmolLM2's 9 query heads over 3
    key-value heads, a causal mask over the keys' last queries): the training attention against
    transformers' sdpa function (PyTorch's CPU flash kernel), at GRPO-like and longer shapes."""
    import torch

    from agentbolt.algorithms import train_attention as ta

    limit, train_attention = ta.MAX_SCORES, ta.train_attention

    sdpa = __import__("transformers.integrations.sdpa_attention", fromlist=["x"]).sdpa_attention_forward
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 3, True  # type: ignore[assignment]
    print(f"attention forward + backward, bfloat16, {torch.get_num_threads()} thread(s), ms per layer:")
    for B, S, T in ((32, 40, 72), (24, 169, 169), (8, 512, 512)):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, 9, S, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        k = torch.randn(B, 3, T, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        v = torch.randn(B, 3, T, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        mask = torch.ones(B, 1, S, T, dtype=torch.bool).tril(T - S)
        cost = {}
        for name, fn in (("sdpa", sdpa), ("plain", train_attention)):
            args = (layer, q, k, v, mask)
            ta.MAX_SCORES = 2**62  # the plain computation at every size, to show where it loses
            try:
                fn(*args)[0].float().sum().backward()  # warm-up
                started = time.perf_counter()
                for _ in range(repeat):
                    fn(*args)[0].float().sum().backward()
            finally:
                ta.MAX_SCORES = limit
            cost[name] = (time.perf_counter() - started) / repeat * 1e3
        used = "plain" if B * 9 * S * T <= limit else "sdpa"
        print(
            f"  {B:2} rows, {S:3} queries over {T:3} keys: sdpa {cost['sdpa']:6.1f}, "
            f"plain float32 {cost['plain']:6.1f} (training attention uses {used} here)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--variants",
        type=lambda v: v.split(","),
        default=list(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)}",
    )
    ap.add_argument("--sampling", action="store_true", help="only time the sampler")
    ap.add_argument("--attention", action="store_true", help="only time one layer's attention, both ways")
    args = ap.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if args.sampling:
        sampling()
        return
    if args.attention:
        attention()
        return
    updates(args)


if __name__ == "__main__":
    main()
