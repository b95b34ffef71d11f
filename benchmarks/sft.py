"""SFT benchmarks: dataset export throughput, and training tokens/s next to TRL's SFTTrainer.

1. Export: a SQLite store with R rollouts (default 10,000), each finished with a random reward
   and one ``llm_call`` event in the docs/events.md shape (a tool-calling conversation, about
   150 prompt and 30 completion token ids; one in five repeats an earlier conversation). The
   server runs in its own process; ``export_dataset`` reads it over the HTTP API, as
   ``agentbolt export sft`` does, in each format. Prints rows/s and rollouts/s.
2. Training: the same token rows (N rows of L tokens, the last quarter of each trained on) and
   the same model, LoRA r16 on all linear layers, batch B, one optimizer step per batch, trained by
   agentbolt (:func:`agentbolt.algorithms.sft.train_rows`) and by ``trl.SFTTrainer``
   (``completion_only_loss`` over a ``completion_mask`` column, gradient checkpointing off, both
   under the same precision). Tokens/s counts every token passed forward and backward, timed
   from the end of the first (warm-up) step to the end of the last, in wall time and in CPU time
   of the process (tokens per CPU-second: what to compare on a machine shared with other work).

The model is SmolLM2-135M-Instruct when ``agentbolt.engine.ensure_model`` finds it on this
machine (``agentbolt model pull``), else the tiny random Llama of ``agentbolt.engine.testing``;
the output says which.

    python benchmarks/sft.py [--rollouts 10000] [--rows 16 --seq-len 256 --batch 4 --bf16] [--skip-train]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentbolt.algorithms.losses import TrainRow
from agentbolt.algorithms.sft import train_rows
from agentbolt.algorithms.train_state import TrainConfig, make_train_state
from agentbolt.client import Client
from agentbolt.export import export_dataset
from agentbolt.schemas import AttemptFinish, AttemptStatus, EventCreate, RolloutCreate, Task
from agentbolt.server import ServerConfig, ServerProcess
from agentbolt.store import open_store

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


# ---------------------------------------------------------------------------- export


def llm_call(rng: random.Random, i: int) -> dict[str, Any]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "calculator", "arguments": f'{{"expression": "{a}+{b}"}}'},
    }
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Use the calculator."},
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)},
    ]
    prompt = [rng.randrange(49152) for _ in range(150)]
    completion = [rng.randrange(49152) for _ in range(30)]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": f"The answer is {a + b}."},
        "finish_reason": "stop",
        "token_ids": completion,
        "logprobs": [-0.3] * 30,
    }
    return {
        "endpoint": "chat.completions",
        "request": {"model": "smollm2", "messages": messages, "tools": TOOLS},
        "response": {"id": f"r{i}"},
        "stream": False,
        "prompt_token_ids": prompt,
        "choices": [choice],
        "usage": {"prompt_tokens": 150, "completion_tokens": 30},
        "latency_ms": 50.0,
        "upstream_status": 200,
        "model": "smollm2",
        "model_version": "0",
        "resources_version": None,
        "error": None,
    }


def build_store(db: str, rollouts: int, seed: int = 0) -> float:
    """Fill ``db`` straight through the store (no HTTP); returns seconds taken."""
    rng = random.Random(seed)
    started = time.perf_counter()
    store = open_store(db)
    calls: list[dict[str, Any]] = []
    for start in range(0, rollouts, 1000):
        store.enqueue(
            [RolloutCreate(task=Task(data={"i": start + i})) for i in range(min(1000, rollouts - start))]
        )
    for i in range(rollouts):
        claim = store.dequeue("bench")
        assert claim is not None
        data = calls[rng.randrange(len(calls))] if calls and rng.random() < 0.2 else llm_call(rng, i)
        calls.append(data)
        store.add_events(claim.attempt.id, [EventCreate(type="llm_call", data=data)])
        store.finish_attempt(
            claim.attempt.id, AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=rng.random())
        )
    store.close()
    return time.perf_counter() - started


def bench_export(rollouts: int, min_reward: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="agentbolt-sft-bench-"))
    db = str(tmp / "store.db")
    print(f"building a SQLite store with {rollouts} rollouts ... ", end="", flush=True)
    print(f"{build_store(db, rollouts):.1f} s")
    with ServerProcess(ServerConfig(db=db)) as server, Client(server.url, timeout=120) as client:
        for fmt, out in (("openai", "sft.jsonl"), ("tokens", "tokens.jsonl"), ("hf", "hf")):
            s = export_dataset(client, tmp / out, fmt, min_reward=min_reward)  # type: ignore[arg-type]
            print(
                f"  export {fmt:6s}: {s.rows:5d} rows ({s.duplicates} duplicates dropped) from {s.rollouts} "
                f"rollouts with reward >= {min_reward} in {s.seconds:5.2f} s = {s.rows_per_s:6.0f} rows/s, "
                f"{s.rollouts / s.seconds:6.0f} rollouts/s"
            )


# ---------------------------------------------------------------------------- training


def load_model(tmp: Path) -> tuple[str, Path]:
    from agentbolt.engine import ModelNotFoundError, ensure_model

    try:
        return "SmolLM2-135M-Instruct", ensure_model("smollm2")
    except ModelNotFoundError:
        from agentbolt.engine.testing import tiny_model_dir

        return "a tiny random Llama (2 layers, 64 wide; SmolLM2 not on this machine)", tiny_model_dir(
            tmp / "tiny"
        )


def make_rows(n: int, length: int, vocab: int, seed: int = 0) -> list[TrainRow]:
    rng = random.Random(seed)
    prompt = length - length // 4
    return [
        TrainRow(tuple(rng.randrange(vocab) for _ in range(length)), (0,) * prompt + (1,) * (length - prompt))
        for _ in range(n)
    ]


Stamps = list[tuple[float, float]]
"""(wall clock, process CPU time) at the end of each step."""


def _stamp(stamps: Stamps) -> None:
    stamps.append((time.perf_counter(), time.process_time()))


def _rates(stamps: Stamps, tokens_per_step: int) -> tuple[float, float]:
    """Tokens per wall second and per CPU second, from the end of the first step to the end of the last."""
    if len(stamps) < 2:
        return float("nan"), float("nan")
    tokens = tokens_per_step * (len(stamps) - 1)
    return tokens / (stamps[-1][0] - stamps[0][0]), tokens / (stamps[-1][1] - stamps[0][1])


def bench_agentbolt(path: Path, rows: list[TrainRow], batch: int, bf16: bool) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = make_train_state(model, TrainConfig(lora_r=16, lora_alpha=32, lr=2e-4))
    stamps: Stamps = []
    train_rows(
        state,
        rows,
        epochs=1,
        batch_size=batch,
        max_tokens=batch * len(rows[0].input_ids),
        bf16=bf16,
        on_step=lambda _: _stamp(stamps),
    )
    return _rates(stamps, batch * len(rows[0].input_ids))


def bench_trl(path: Path, rows: list[TrainRow], batch: int, bf16: bool, out: Path) -> tuple[float, float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    stamps: Stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            _stamp(stamps)

    data = Dataset.from_list(
        [{"input_ids": list(r.input_ids), "completion_mask": list(r.loss_mask)} for r in rows]
    )
    config = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=bf16,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        completion_only_loss=True,
        max_length=None,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=lora,
        callbacks=[Stamp()],
    )
    trainer.train()
    return _rates(stamps, batch * len(rows[0].input_ids))


def bench_training(n: int, length: int, batch: int, bf16: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="agentbolt-sft-train-"))
    name, path = load_model(tmp)
    from transformers import AutoConfig

    rows = make_rows(n, length, AutoConfig.from_pretrained(path).vocab_size)
    print(
        f"training: {name}; {n} rows x {length} tokens, batch {batch}, LoRA r16 all-linear, "
        f"{'bf16 autocast' if bf16 else 'fp32'}, {torch.get_num_threads()} threads"
    )
    ours = bench_agentbolt(path, rows, batch, bf16)
    print(f"  agentbolt train_rows  : {ours[0]:7.1f} tokens/s {ours[1]:7.1f} tokens/CPU-s")
    try:
        import trl
    except ImportError:
        print(
            "  trl SFTTrainer       : not installed - `pip install 'agentbolt[compare]'` (or `pip install trl`)"
        )
        return
    theirs = bench_trl(path, rows, batch, bf16, tmp / "trl")
    print(
        f"  trl {trl.__version__} SFTTrainer: {theirs[0]:7.1f} tokens/s {theirs[1]:7.1f} tokens/CPU-s"
        f"   (agentbolt / trl per CPU-s: {ours[1] / theirs[1]:.2f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=10_000)
    ap.add_argument("--min-reward", type=float, default=0.5)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bf16", action="store_true", help="Train under bf16 autocast instead of in float32.")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 keeps CPU time honest on a shared machine (spinning threads count)",
    )
    ap.add_argument("--skip-export", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    if not args.skip_export:
        bench_export(args.rollouts, args.min_reward)
    torch.set_num_threads(args.threads)
    if not args.skip_train:
        bench_training(args.rows, args.seq_len, args.batch, bf16=args.bf16)


if __name__ == "__main__":
    main()
