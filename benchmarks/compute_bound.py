"""The arithmetic floor under the engine's and the trainer's speed: how fast this CPU's matrix
products alone could make a decode step and a GRPO update.

A decode step of a small Llama-style model and the LoRA update of GRPO are mostly products of
activations with the model's weight matrices. This script times those products on this machine
at the model's exact shapes, one weight matrix per layer and projection as in the model (so
each comes from memory as in a real pass, not from a cache a repeated product would keep it
in), in bfloat16 with the weights packed once for oneDNN (the fastest
path the engine knows; ``torch.ops.mkldnn._linear_pointwise``), at 1 thread and at every core
(the better kept), and prints:

- **decode**: the time a step of ``--rows`` rows would take if it were nothing but these
  products (the projections of every layer, q/k/v and gate/up fused as the engine fuses them,
  and the output layer), so the most tokens/s any engine could serve with these kernels;
  beside it Hugging Face ``generate`` on one static batch of the same rows, measured in the
  same run, and the tokens/s 1.5x that baseline would need;
- **update**: the least time the products of an update over ``--update-tokens`` tokens take:
  with activation checkpointing the forward pass runs twice and the backward pass's input
  gradients (the gradient times each weight, timed at those transposed shapes) come on top;
  without it, one forward and the input gradients. LoRA's own small products are left out. Set it beside the
  ``update`` times ``grpo_vs_trl.py`` prints, and beside TRL's iteration time.

Attention, norms and everything else come on top, so real steps are slower than these floors.
With a CPU that has no bfloat16 units (AVX2 only) the packed path is not available: the
script says so and times PyTorch's own bfloat16 product instead.

    python benchmarks/compute_bound.py [--model smollm2] [--rows 32] [--new-tokens 64]
                                       [--update-tokens 1100] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time


def shapes(config) -> tuple[list[tuple[str, int, int]], tuple[str, int, int], int]:
    """(name, out, in) of one layer's products as the engine computes them, the output
    layer's, and the number of layers."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    layer = [
        ("q/k/v (fused)", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate/up (fused)", 2 * inter, hidden),
        ("down", hidden, inter),
    ]
    return layer, ("output layer", config.vocab_size, hidden), config.num_hidden_layers


class Products:
    """The weight products of one forward pass, one weight per layer and projection as in the
    model (random values of its shapes), so that each comes from memory as in a real pass and
    not from a cache that a product repeated on one weight would keep it in."""

    def __init__(self, torch, config, rows: int, backward: bool = False) -> None:
        layer, head, n_layers = shapes(config)
        self.torch, self.rows = torch, rows
        self.packed = _packed_available(torch)
        self.groups: list[tuple[str, int, int, list]] = []
        for name, out, inp in [*layer, head]:
            if backward:  # the gradient times the weight: the transposed shape
                out, inp = inp, out
            count = n_layers if name != head[0] else 1
            weights = [
                self._prepare(torch.randn(out, inp, dtype=torch.bfloat16) * 0.02) for _ in range(count)
            ]
            self.groups.append((name, out, inp, weights))
        self.inputs = {inp: torch.randn(rows, inp, dtype=torch.bfloat16) for _, _, inp, _ in self.groups}

    def _prepare(self, weight):
        if self.packed:
            return self.torch.ops.mkldnn._reorder_linear_weight(weight, self.rows)
        return weight

    def _product(self, x, weight) -> None:
        if self.packed:
            self.torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        else:
            self.torch.nn.functional.linear(x, weight)

    def run_group(self, index: int) -> None:
        _, _, inp, weights = self.groups[index]
        x = self.inputs[inp]
        for w in weights:
            self._product(x, w)

    def run_all(self) -> None:
        for i in range(len(self.groups)):
            self.run_group(i)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def products_seconds(
    torch, config, rows: int, reps: int, threads: list[int], show: bool, backward: bool = False
) -> float:
    """Seconds of every weight product of one forward pass over ``rows`` positions (best over
    ``threads``); with ``backward``, of the backward pass's input gradients instead."""
    products = Products(torch, config, rows, backward)
    best: tuple[float, int] | None = None
    for n in threads:
        torch.set_num_threads(n)
        seconds = median_seconds(products.run_all, reps)
        if best is None or seconds < best[0]:
            best = (seconds, n)
    assert best is not None
    torch.set_num_threads(best[1])
    if show:
        for i, (name, out, inp, weights) in enumerate(products.groups):
            seconds = median_seconds(lambda i=i: products.run_group(i), reps)
            rate = 2 * rows * out * inp * len(weights) / seconds / 1e9
            print(
                f"  {name:16} {out:6} x {inp:5} x{len(weights):<3} {seconds * 1e3:8.2f} ms  {rate:6.1f} GFLOP/s"
            )
    print(f"  ({best[1]} thread(s) fastest)")
    return best[0]


def _packed_available(torch) -> bool:
    ops = torch.ops.mkldnn
    return (
        hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def static_generate(model_dir: str, rows: int, new_tokens: int, threads: list[int]) -> tuple[float, int]:
    """Tokens/s of ``generate`` on one static batch of ``rows`` chats (bfloat16, greedy, every
    row made to run ``new_tokens``), best over ``threads``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Tell me a short story about the number {i}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(rows)
    ]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    best: tuple[float, int] | None = None
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
        for n in threads:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            rate = rows * new_tokens / (time.perf_counter() - t0)
            if best is None or rate > best[0]:
                best = (rate, n)
    assert best is not None
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face directory")
    ap.add_argument("--rows", type=int, default=32, help="rows of a decode step (concurrent chats)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per row for the generate baseline")
    ap.add_argument(
        "--update-tokens",
        type=int,
        default=1100,
        help="positions an update computes (grpo_vs_trl.py's default workload: 4 prompts of about "
        "45 tokens computed once per group, 32 completions of at most 32 tokens)",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-generate", action="store_true", help="do not run the generate baseline")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig

    from agentbolt.engine import ensure_model

    model_dir = str(ensure_model(args.model))
    config = AutoConfig.from_pretrained(model_dir)
    threads = sorted({1, torch.get_num_threads()})
    kind = (
        "packed for oneDNN" if _packed_available(torch) else "PyTorch's own bfloat16 product (no bf16 units)"
    )
    layer, head, n_layers = shapes(config)
    macs = n_layers * sum(o * i for _, o, i in layer) + head[1] * head[2]
    print(f"model {args.model}: {n_layers} layers, {2 * macs / 1e6:.0f} MFLOP of weight products per token")
    print(f"products: bfloat16, {kind}; thread counts tried: {threads}")

    print(f"decode step, {args.rows} rows:")
    step = products_seconds(torch, config, args.rows, args.reps, threads, show=True)
    ceiling = args.rows / step
    print(f"  products alone: {step * 1e3:.1f} ms per step -> at most {ceiling:.0f} tokens/s")
    if not args.skip_generate:
        rate, n = static_generate(model_dir, args.rows, args.new_tokens, threads)
        print(
            f"  static-batch generate, {args.rows} x {args.new_tokens} tokens: {rate:.0f} tokens/s ({n} thread(s)); "
            f"1.5x would be {1.5 * rate:.0f} tokens/s, {1.5 * rate / ceiling:.2f}x the products-only ceiling"
        )

    print(f"update over {args.update_tokens} positions:")
    reps = max(3, args.reps // 4)
    forward = products_seconds(torch, config, args.update_tokens, reps, threads, show=False)
    backward = products_seconds(torch, config, args.update_tokens, reps, threads, show=False, backward=True)
    print(
        f"  one forward pass's products: {forward:.2f} s; the backward pass's input gradients: {backward:.2f} s"
    )
    print(
        f"  with activation checkpointing (forward twice, then backward): at least {2 * forward + backward:.2f} s"
    )
    print(f"  without: at least {forward + backward:.2f} s")


if __name__ == "__main__":
    main()
