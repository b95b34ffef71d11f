"""GRPO wall time per iteration: agentbolt end to end vs TRL's GRPOTrainer, same workload.

Same single-turn task, model, group size, batch, completion length, LoRA (r=16, all linear
projections) and learning rate. agentbolt runs its whole machinery — embedded server, a runner
process, the gateway, the batched engine, weight sync — while TRL runs its single-process
trainer (generation with ``model.generate`` inside the trainer). Both generate and train in
the same dtype (``--dtype``; default bfloat16 where the CPU has native bfloat16, float32 where
it would be emulated), both checkpoint activations in the update or neither
(``--checkpointing``; by default as agentbolt's GRPO does, TRL set to match), and the runs
alternate, ``--rounds`` times each, so that a change of load hits both. Prints seconds per
iteration for both (the first iteration of each run, a warm-up, left out) and the ratio
(agentbolt / TRL; <= 1.0 means agentbolt is no slower).

    python benchmarks/grpo_vs_trl.py [--model smollm2|tiny] [--steps 3] [--rounds 2] [--quick]

TRL's options that shape an iteration are set, not left to defaults, and printed. TRL's own
``generate`` runs in the weights' dtype (float32) with autocast off even with ``bf16=True``, so here
it runs under bfloat16 autocast when ``--dtype bfloat16``, like agentbolt's engine (which holds
bfloat16 weights; autocast re-casts the float32 weights at each product: a cost TRL keeps). TRL runs
once per ``--trl-threads`` count each round: on a 2-core machine with other jobs, TRL at the default
2 torch threads measured 1.7-25 s per tiny-model iteration against 0.23-0.61 s at 1 thread (every parallel
operator waits for a parked thread), while agentbolt's engine picks its thread count by timing; the
ratio is taken against TRL's best count.

``--asynchronous`` also runs agentbolt's default, asynchronous GRPO every round and prints its
figure on its own line: its runner generates the next groups while the update trains, so an
iteration costs about the longer of the two phases rather than their sum. That is a different
algorithm from TRL's (each update trains on groups generated up to ``max_staleness`` policy
versions earlier, importance-corrected), so the like-for-like ratio is the synchronous one.

Both systems run in this one process, one after the other, with glibc's allocator at its
defaults (its mmap and trim thresholds adjust to the blocks the process frees). Fixing the mmap
threshold at 32 MB for both, to take out the order, made agentbolt's iterations about 30% slower
in one run (rollouts 4.5-7.5 s against 3.6-4.9, updates 6.0-9.5 against 5.6-7.4): fixing it
also freezes the trim threshold at 128 KB, so the heap is given back and faulted in again all the
time.

Differences that remain: agentbolt serves rollouts over HTTP from its engine to a runner process
and records every call in its store; TRL calls ``generate`` in-process on one padded batch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from agentbolt import LitAgent, Task
from agentbolt.schemas import LLM

PROMPTS = [f"Write one short sentence about the number {i}." for i in range(16)]


def reward_text(text: str) -> float:
    """Share of letters that are 'a' (any policy shows a spread; identical for both systems)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return letters.count("a") / len(letters) if letters else 0.0


class SingleTurn(LitAgent):
    """At module level, so it pickles and the Trainer starts its runner with forkserver."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens

    async def execute_rollout(self, task: Task) -> float:
        from agentbolt.runner.llm import async_openai

        llm: LLM = self.get_resource("llm")
        client = async_openai(llm, timeout=600)
        r = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task.data["prompt"]}],
            max_tokens=self.max_tokens,
            temperature=1.0,
        )
        return reward_text(r.choices[0].message.content or "")


# TRL's options that change the work of one iteration, set rather than left to its defaults
# (which move between versions): one generation and one optimizer step per iteration, no
# reference model, no compilation, no extra logging.
TRL_FIXED = {
    "num_iterations": 1,
    "steps_per_generation": 1,
    "torch_compile": False,
    "log_completions": False,
    "use_vllm": False,
    "use_transformers_paged": False,
}
TRL_SHOWN = (
    "bf16",
    "gradient_checkpointing",
    "beta",
    "generation_batch_size",
    "per_device_train_batch_size",
    "num_generations",
    *TRL_FIXED,
    "logging_steps",
    "loss_type",
)


def checkpointing_options(choice: str) -> tuple[dict[str, bool], bool]:
    """agentbolt's GRPO options and TRL's ``gradient_checkpointing`` for ``--checkpointing``:
    ``auto`` is agentbolt's default, whatever it resolves to, and TRL is set the same."""
    import dataclasses

    from agentbolt.algorithms.grpo import GRPO

    known = {f.name for f in dataclasses.fields(GRPO)}
    if "activation_checkpointing" not in known:  # a GRPO that never checkpoints
        return {}, False
    if choice == "auto":
        return {}, bool(getattr(GRPO(), "checkpointing", False))
    return {"activation_checkpointing": choice == "on"}, choice == "on"


def run_agentbolt(
    model: str,
    steps: int,
    group: int,
    prompts: int,
    max_tokens: int,
    lr: float,
    dtype: str,
    checkpointing: str = "auto",
    asynchronous: bool = False,
) -> list[float]:
    from agentbolt import Trainer
    from agentbolt.algorithms.grpo import GRPO

    algo = GRPO(
        **checkpointing_options(checkpointing)[0],
        model=model,
        steps=steps,
        tasks_per_step=prompts,
        group_size=group,
        lr=lr,
        val_every=0,
        checkpoint_every=0,
        plot=False,
        success_threshold=0.5,
        bf16=dtype == "bfloat16",
        engine_dtype=dtype,
        # synchronous is like TRL: each iteration generates, then trains on what it generated;
        # asynchronous (agentbolt's default) generates the next groups while the update trains
        asynchronous=asynchronous,
    )
    tasks = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    result = Trainer(algo, n_runners=1, runner_concurrency=group * prompts, run_dir=run_dir).fit(
        SingleTurn(max_tokens), tasks, []
    )
    steps_ = [h for h in result.history if h.get("step", 0) > 0]
    mode = "asynchronous" if asynchronous else "synchronous"
    for h in steps_:
        print(
            f"  agentbolt ({mode}) step {h['step']}: rollouts {h['t_rollouts']:.2f} s, update {h['t_update']:.2f} s, "
            f"weight sync {h['t_sync']:.2f} s, total {h['t_step']:.2f} s"
        )
    return [h["t_step"] for h in steps_]


def run_trl(
    path: str,
    steps: int,
    group: int,
    prompts: int,
    max_tokens: int,
    lr: float,
    dtype: str,
    checkpointing: str = "auto",
    threads: int = 0,
    generation_autocast: bool = True,
) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):  # noqa: ANN002, ANN003
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):  # noqa: ANN002, ANN003
            times.append(time.perf_counter() - self.t0)

    def reward(completions, **_):  # noqa: ANN001, ANN003
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_text(t) for t in texts]

    class Trainer(GRPOTrainer):
        """TRL's trainer, generating in ``dtype`` like agentbolt's engine: TRL's own ``generate``
        runs in the weights' dtype (float32) with autocast off, even with ``bf16=True``."""

        def _generate_single_turn(self, *a, **k):  # noqa: ANN002, ANN003
            with torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=generation_autocast and dtype == "bfloat16"
            ):
                return super()._generate_single_turn(*a, **k)

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=group * prompts,
        num_generations=group,
        max_completion_length=max_tokens,
        max_steps=steps,
        learning_rate=lr,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=dtype == "bfloat16",
        save_strategy="no",
        temperature=1.0,
        beta=0.0,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        # activation checkpointing (memory for a second forward pass of the body) as agentbolt's
        gradient_checkpointing=checkpointing_options(checkpointing)[1],
        **TRL_FIXED,
    )
    print("  TRL options: " + ", ".join(f"{k}={getattr(config, k)}" for k in TRL_SHOWN), flush=True)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Trainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora,
        callbacks=[Timer()],
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(before)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a local HF directory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each system")
    ap.add_argument(
        "--dtype", choices=["bfloat16", "float32"], help="generation and training dtype, both sides"
    )
    ap.add_argument(
        "--checkpointing",
        choices=["auto", "on", "off"],
        default="auto",
        help="activation checkpointing in the update, both sides (auto: agentbolt's default, TRL set the same)",
    )
    ap.add_argument(
        "--trl-threads",
        type=lambda v: [int(x) for x in v.split(",")],
        help="torch thread counts TRL runs with, each every round (default: 1 and all cores); "
        "agentbolt's engine picks its own count by timing, so TRL is compared at its best",
    )
    ap.add_argument(
        "--trl-float32-generation",
        action="store_true",
        help="leave TRL's generate in float32 (its own behaviour) instead of bfloat16 autocast",
    )
    ap.add_argument(
        "--asynchronous",
        action="store_true",
        help="also run agentbolt's default asynchronous GRPO every round, reported on its own line "
        "(not like for like: it trains on groups generated while earlier updates ran, up to "
        "max_staleness policy versions behind, importance-corrected; TRL and the main figure are on-policy)",
    )
    ap.add_argument("--quick", action="store_true", help="one round of 2 steps, 2 prompts x 4")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.prompts, args.group = 1, 2, 2, 4
    import torch

    from agentbolt.algorithms.train_state import fast_bf16
    from agentbolt.engine import ensure_model, tiny_model_dir

    args.trl_threads = args.trl_threads or sorted({1, torch.get_num_threads()})
    dtype = args.dtype or ("bfloat16" if fast_bf16() else "float32")
    path = str(tiny_model_dir(tempfile.mkdtemp()) if args.model == "tiny" else ensure_model(args.model))
    shape = (args.steps, args.group, args.prompts, args.max_tokens, args.lr, dtype, args.checkpointing)
    try:
        import trl  # noqa: F401
    except ImportError:
        trl = None
        print("TRL is not installed: pip install 'agentbolt[compare]' (or pip install trl) to compare")
    ours: list[float] = []
    ours_async: list[float] = []
    theirs: dict[int, list[float]] = {n: [] for n in args.trl_threads}
    for r in range(args.rounds):
        # the first iteration of each run warms up (allocations, kernels); compare the rest
        run = run_agentbolt(path, *shape)
        print(f"round {r + 1} agentbolt: {[round(t, 2) for t in run]} s/iteration", flush=True)
        ours += run[1:] or run
        if args.asynchronous:
            run = run_agentbolt(path, *shape, asynchronous=True)
            print(
                f"round {r + 1} agentbolt asynchronous: {[round(t, 2) for t in run]} s/iteration", flush=True
            )
            ours_async += run[1:] or run
        if trl is not None:
            for n in args.trl_threads:
                run = run_trl(path, *shape, threads=n, generation_autocast=not args.trl_float32_generation)
                print(
                    f"round {r + 1} TRL GRPOTrainer, {n} torch thread(s): {[round(t, 2) for t in run]} s/iteration",
                    flush=True,
                )
                theirs[n] += run[1:] or run
    print(
        f"model={args.model} dtype={dtype} (generation and update, both) group={args.group} "
        f"prompts/step={args.prompts} max_tokens={args.max_tokens} steps={args.steps} rounds={args.rounds} "
        f"activation checkpointing={'on' if checkpointing_options(args.checkpointing)[1] else 'off'} (both)"
    )
    a = statistics.median(ours)
    print(f"agentbolt s/iteration: median {a:.2f}, range {min(ours):.2f}-{max(ours):.2f}")
    if ours_async:
        print(
            f"agentbolt asynchronous s/iteration: median {statistics.median(ours_async):.2f}, "
            f"range {min(ours_async):.2f}-{max(ours_async):.2f}"
        )
    if trl is None:
        return
    for n, t in theirs.items():
        print(
            f"TRL, {n} thread(s), s/iteration: median {statistics.median(t):.2f}, range {min(t):.2f}-{max(t):.2f}"
        )
    best = min(theirs, key=lambda n: statistics.median(theirs[n]))
    b = statistics.median(theirs[best])
    print(
        f"ratio agentbolt / TRL (TRL at its best, {best} thread(s)): {a / b:.2f} (<= 1.0: agentbolt no slower)"
    )
    if ours_async:
        print(
            f"ratio agentbolt asynchronous / TRL (not like for like, see --asynchronous): "
            f"{statistics.median(ours_async) / b:.2f}"
        )


if __name__ == "__main__":
    main()
