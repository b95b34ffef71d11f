"""``torch.compile`` (inductor, CPU) against the embedded engine's eager decode step.

The decode step is what ``Batcher._decode`` runs for a running batch: the engine's own Llama
forward (:class:`agentbolt.engine.forward.LlamaForward`) on one new token per row against the
batch's KV cache, inside the engine's matrix-product mode (``EngineConfig.cpu_matmul``, ``auto``:
packed oneDNN weights on CPUs with bfloat16 units). Sampling is not part of it. A variant is
``eager`` or ``compiled`` (``torch.compile(<that forward>, backend="inductor")``), then any of:

- ``+torch``: ``kernels=False``, PyTorch's ops only (``agentbolt model serve --no-kernels``);
  without it the engine's C kernels (:mod:`agentbolt.engine.kernels`) serve, ctypes calls that
  Dynamo cannot trace, so each is a graph break and runs eagerly;
- ``+native``: no matrix-product mode, PyTorch's ``linear`` (which inductor lowers itself);
  without it the engine's mode, whose packed oneDNN weights inductor cannot lower (``compiled``
  fails with a ``LoweringException`` on ``mkldnn._linear_pointwise``, reported and skipped);
- ``+frozen`` (compiled only): inductor's ``freezing``, the weights compiled in as constants
  (packed for oneDNN by inductor). The engine could not serve so: its in-place weight updates
  would not reach the compiled copies. It bounds what compiling can buy.

``eager`` is the step as the engine serves it; every ratio is to it.

Per batch size, ``--context`` random tokens per row (no padding) are prefilled once with the eager
forward. Each run of a variant starts from that cache, takes one untimed step (which also grows
the cache's buffer), then ``--steps`` timed ones: tokens/s = rows x steps / seconds. Two untimed
runs of each variant come first: a compiled variant's first call (its compile time) is printed
with the graphs Dynamo made and its graph breaks, and graphs compiled later, during the timed
rounds, are counted. Batch 1 is compiled on its own, the larger batches share one dynamic
compilation. Then ``--rounds`` rounds, the variants' order rotating each round: medians and
their ratio to eager. The untimed step's logits are compared with eager's (max abs difference,
and the rows whose argmax agrees). Figures belong to a quiet machine; ``--tiny`` (a random
2-layer, 64-wide Llama, :func:`agentbolt.engine.testing.tiny_model_dir`) only checks the script.

    python benchmarks/engine_compile.py [--batch 1,8,32] [--context 256] [--rounds 5] [--steps 32]
    python benchmarks/engine_compile.py --tiny --rounds 2 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from agentbolt.engine import kernels, kv_cache
from agentbolt.engine.forward import LlamaForward
from agentbolt.engine.matmul import cpu_matmul_mode, make_matmul_mode

VARIANTS = "eager,eager+torch,compiled,compiled+native,compiled+torch+native,compiled+torch+native+frozen"
FLAGS = {"torch", "native", "frozen"}
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
KV = list[tuple[torch.Tensor, torch.Tensor]]


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from agentbolt.engine import ensure_model, tiny_model_dir
    from agentbolt.engine.engine import resolve_dtype

    if args.tiny:
        path = tiny_model_dir(tempfile.mkdtemp(prefix="agentbolt-compile-"))
    else:
        path = ensure_model(args.model)
    return AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.dtype)).eval()


def first_line(exc: BaseException) -> str:
    """The error's first line, and the operator it names (inductor's lowering errors put it on the next)."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    target = next((line for line in lines if line.startswith("target:")), "")
    return f"{type(exc).__name__}: {lines[0] if lines else ''}" + (f" ({target})" if target else "")


def fresh_cache(kv: KV) -> Any:
    """A batcher-style cache (``GrowingLayer``s) holding ``kv``; its first step copies them into
    a new buffer, so ``kv`` itself is never written."""
    cache = kv_cache.new_cache()
    for keys, values in kv:
        layer = kv_cache.GrowingLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


class Bench:
    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, variants: list[str]) -> None:
        self.args, self.model = args, model
        self.batches = [int(b) for b in args.batch.split(",")]
        self.matmul = cpu_matmul_mode(args.matmul, model)
        self.mode = make_matmul_mode(self.matmul, max(self.batches), model)
        tuned = dict(torch._inductor.list_mode_options(args.compile_mode)) if args.compile_mode else {}
        positions = args.context + args.steps + 2
        forwards: dict[tuple[bool, bool], LlamaForward] = {}
        self.steps: dict[str, Step] = {}
        for variant in ["eager", *variants]:
            flags = set(variant.split("+")[1:])
            key = ("torch" not in flags, "native" in flags)
            if key not in forwards:
                forwards[key] = LlamaForward(model, positions, use_kernels=key[0])
                forwards[key].packed = self.mode if self.matmul == "packed" and not key[1] else None
            fwd = forwards[key]
            if variant.startswith("compiled"):  # its own backend object, so its own compiled code
                options = tuned | ({"freezing": True} if "frozen" in flags else {})
                fn = torch.compile(fwd.__call__, backend="inductor", dynamic=args.dynamic, options=options)
                self.steps[variant] = fn
            else:
                self.steps[variant] = fwd
        self.kernel_note = forwards[True, False].kernel_note
        self.failed: dict[str, str] = {}
        config: Any = model.config
        self.vocab = int(config.vocab_size)
        self.ids = torch.randint(
            self.vocab, (max(self.batches), 1), generator=torch.Generator().manual_seed(1)
        )

    def prefill(self, rows: int) -> KV:
        context = self.args.context
        ids = torch.randint(self.vocab, (rows, context), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(rows, context, dtype=torch.long)
        pos = torch.arange(context).expand(rows, -1)
        cache = kv_cache.new_cache()
        with self.mode or contextlib.nullcontext():
            self.steps["eager"](ids, mask, pos, cache)
        return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    def step(self, variant: str, cache: Any, rows: int, t: int) -> torch.Tensor:
        """Decode step ``t`` (0: the first after the prefill), as ``Batcher._forward`` runs it."""
        length = self.args.context + t
        mask = torch.ones(rows, length + 1, dtype=torch.long)
        pos = torch.full((rows, 1), length, dtype=torch.long)
        flags = variant.split("+")[1:]
        mode = contextlib.nullcontext() if "native" in flags else self.mode or contextlib.nullcontext()
        with mode:
            return self.steps[variant](self.ids[:rows], mask, pos, cache).cpu()

    def run(self, variant: str, kv: KV, rows: int) -> tuple[float, float, torch.Tensor]:
        """(seconds of the untimed first step, tokens/s of the timed ones, the first step's logits)."""
        cache = fresh_cache(kv)
        started = time.perf_counter()
        logits = self.step(variant, cache, rows, 0)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for t in range(1, self.args.steps + 1):
            self.step(variant, cache, rows, t)
        return first, rows * self.args.steps / (time.perf_counter() - started), logits


def graph_breaks(before: dict[str, int], graphs: int) -> str:
    """The graphs Dynamo compiled and its graph breaks since ``before`` (a copy of its break
    counter) and ``graphs`` (its graph count then), with the most frequent break."""
    from torch._dynamo.utils import counters

    made = f"{counters['stats']['unique_graphs'] - graphs} graphs"
    breaks = {k: n - before.get(k, 0) for k, n in counters["graph_break"].items() if n > before.get(k, 0)}
    if not breaks:
        return f"{made}, no graph breaks"
    top = max(breaks, key=lambda k: breaks[k])
    return f"{made}, {sum(breaks.values())} graph breaks (most: {top.splitlines()[0][:100]!r} x{breaks[top]})"


def bench_batch(bench: Bench, rows: int, variants: list[str]) -> dict[str, float]:
    """Median tokens/s of each variant that ran at ``rows`` rows (printing the rounds)."""
    from torch._dynamo.utils import counters

    args = bench.args
    kv = bench.prefill(rows)
    print(f"\nbatch {rows}: context {args.context}, {args.steps} timed steps per run", flush=True)
    reference: torch.Tensor | None = None
    atol = args.atol
    for variant in list(variants):
        if variant in bench.failed:
            continue
        before, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
        try:
            first, _, logits = bench.run(variant, kv, rows)  # warm-up: compiles
            bench.run(variant, kv, rows)  # and whatever the second run's cache shapes recompile
        except Exception as exc:  # noqa: BLE001 - Dynamo/inductor raise many kinds
            bench.failed[variant] = first_line(exc)
            print(f"  {variant}: failed: {bench.failed[variant]}", flush=True)
            continue
        note = f" ({graph_breaks(before, graphs)})" if variant.startswith("compiled") else ""
        print(f"  {variant}: first call {first:.2f} s{note}", flush=True)
        if variant == "eager":
            reference = logits.float()
            scale = reference.abs().max().item()
            atol = args.atol or (1e-3 if logits.dtype == torch.float32 else 0.02 * scale)
            print(f"    logits: max |logit| {scale:.3g}, tolerance {atol:.3g}", flush=True)
        elif reference is not None:
            diff = (logits.float() - reference).abs().max().item()
            same = int((logits.argmax(-1) == reference.argmax(-1)).sum())
            verdict = "match" if diff <= atol else "DIFFER"
            print(
                f"    logits vs eager: max |diff| {diff:.3g} ({verdict}), argmax same in {same}/{rows} rows",
                flush=True,
            )
    ran = [v for v in variants if v not in bench.failed]
    rates: dict[str, list[float]] = {v: [] for v in ran}
    graphs = counters["stats"]["unique_graphs"]
    for round_ in range(args.rounds):
        shift = round_ % len(ran)
        for variant in ran[shift:] + ran[:shift]:
            rates[variant].append(bench.run(variant, kv, rows)[1])
        print(f"  round {round_ + 1}: " + ", ".join(f"{v} {r[-1]:.1f}" for v, r in rates.items()) + " tok/s")
    if counters["stats"]["unique_graphs"] > graphs:
        print(
            f"  NOTE: {counters['stats']['unique_graphs'] - graphs} graph(s) compiled during the timed rounds"
        )
    return {v: statistics.median(r) for v, r in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="smollm2", help="a local HF Llama directory (default: the bundled SmolLM2)"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead: checks the script only")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per row before the timed steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    ap.add_argument(
        "--variants",
        default=VARIANTS,
        help="comma-separated: eager or compiled, each with any of +torch, +native, +frozen",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--matmul", default="auto", help="EngineConfig.cpu_matmul: auto, native, packed, float32")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument(
        "--dynamic",
        default="true",
        choices=["true", "false", "auto"],
        help="torch.compile(dynamic=...): the cache grows a column every step (auto: recompile once, then dynamic)",
    )
    ap.add_argument(
        "--compile-mode", default="", help="a torch.compile mode's options, e.g. max-autotune-no-cudagraphs"
    )
    ap.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="max abs logit difference to eager (0: 1e-3 in float32, else 2%% of the largest |logit|)",
    )
    args = ap.parse_args()
    args.dynamic = {"true": True, "false": False, "auto": None}[args.dynamic]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        base, *flags = v.split("+")
        if (
            base not in ("eager", "compiled")
            or not set(flags) <= FLAGS
            or (base == "eager" and "frozen" in flags)
        ):
            ap.error(
                f"--variants: {v!r} is not eager or compiled with +torch, +native (+frozen: compiled only)"
            )
    if "eager" not in variants:
        variants.insert(0, "eager")
    if args.threads:
        torch.set_num_threads(args.threads)
    # graph breaks inside the layer loop recompile per layer: never fall back to eager quietly
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    model = load_model(args)
    bench = Bench(model, args, variants)
    print(
        f"{'tiny random Llama' if args.tiny else args.model}, {args.dtype}, matmul {bench.matmul or 'native'}, "
        f"kernels: {bench.kernel_note or kernels.status()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}; "
        f"torch.compile(backend='inductor', dynamic={args.dynamic}, mode={args.compile_mode or 'default'})"
    )
    medians: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in bench.batches:
            medians[rows] = bench_batch(bench, rows, variants)
    for variant, error in bench.failed.items():
        print(f"\n{variant} failed: {error}")
    shown = [v for v in variants if v not in bench.failed]
    print(f"\nmedian tokens/s of {args.rounds} interleaved rounds (ratio: to eager)")
    print("| batch | " + " | ".join(shown) + " |")
    print("|---|" + "---|" * len(shown))
    for rows, med in medians.items():
        cells = [
            f"{med[v]:.1f}" + ("" if v == "eager" else f" ({med[v] / med['eager']:.2f}x)") for v in shown
        ]
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
