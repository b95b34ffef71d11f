"""GRPO wall time per iteration: agentbolt end to end vs TRL's GRPOTrainer, same workload.

Same single-turn task, model, group size, batch, completion length, LoRA (r=16, all linear
projections) and learning rate. agentbolt runs its whole machinery — embedded server, a runner
process, the gateway, the batched engine, weight sync — while TRL runs its single-process
trainer (generation with ``model.generate`` inside the trainer). Prints seconds per iteration
for both and the ratio (agentbolt / TRL; <= 1.0 means agentbolt is no slower).

    python benchmarks/grpo_vs_trl.py [--model smollm2|tiny] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = [f"Write one short sentence about the number {i}." for i in range(16)]


def reward_text(text: str) -> float:
    """Share of letters that are 'a' (any policy shows a spread; identical for both systems)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return letters.count("a") / len(letters) if letters else 0.0


def _agent(max_tokens: int):
    from agentbolt import LitAgent, Task
    from agentbolt.runner.llm import async_openai
    from agentbolt.schemas import LLM

    class SingleTurn(LitAgent):
        async def execute_rollout(self, task: Task) -> float:
            llm: LLM = self.get_resource("llm")
            client = async_openai(llm, timeout=600)
            r = await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": task.data["prompt"]}],
                max_tokens=max_tokens,
                temperature=1.0,
            )
            return reward_text(r.choices[0].message.content or "")

    return SingleTurn()


def run_agentbolt(
    model: str, steps: int, group: int, prompts: int, max_tokens: int, lr: float
) -> list[float]:
    from agentbolt import Trainer
    from agentbolt.algorithms.grpo import GRPO

    algo = GRPO(
        model=model,
        steps=steps,
        tasks_per_step=prompts,
        group_size=group,
        lr=lr,
        val_every=0,
        checkpoint_every=0,
        plot=False,
        success_threshold=0.5,
    )
    tasks = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    result = Trainer(algo, n_runners=1, runner_concurrency=group * prompts, run_dir=run_dir).fit(
        _agent(max_tokens), tasks, []
    )
    steps_ = [h for h in result.history if h.get("step", 0) > 0]
    for h in steps_:
        print(
            f"  agentbolt step {h['step']}: rollouts {h['t_rollouts']:.2f} s, update {h['t_update']:.2f} s, "
            f"weight sync {h['t_sync']:.2f} s, total {h['t_step']:.2f} s"
        )
    return [h["t_step"] for h in steps_]


def run_trl(path: str, steps: int, group: int, prompts: int, max_tokens: int, lr: float) -> list[float]:
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
        bf16=True,
        save_strategy="no",
        temperature=1.0,
        beta=0.0,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        # TRL turns activation checkpointing on by default: it saves memory at the cost of a
        # second forward pass. agentbolt does not checkpoint, so neither does TRL here.
        gradient_checkpointing=False,
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora,
        callbacks=[Timer()],
    )
    trainer.train()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a local HF directory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()
    from agentbolt.engine import ensure_model, tiny_model_dir

    path = str(tiny_model_dir(tempfile.mkdtemp()) if args.model == "tiny" else ensure_model(args.model))
    shape = (args.steps, args.group, args.prompts, args.max_tokens, args.lr)
    ours = run_agentbolt(path, *shape)
    print(f"agentbolt: {[round(t, 1) for t in ours]} s/iteration")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install 'agentbolt[compare]' (or pip install trl) to compare")
        return
    theirs = run_trl(path, *shape)
    print(f"TRL GRPOTrainer: {[round(t, 1) for t in theirs]} s/iteration")
    # the first iteration of each warms up (allocations, compilation of kernels); compare the rest
    a = statistics.median(ours[1:] or ours)
    b = statistics.median(theirs[1:] or theirs)
    print(f"model={args.model} group={args.group} prompts/step={args.prompts} max_tokens={args.max_tokens}")
    print(
        f"median s/iteration: agentbolt {a:.2f}  TRL {b:.2f}  ratio {a / b:.2f} (<= 1.0: agentbolt no slower)"
    )


if __name__ == "__main__":
    main()
