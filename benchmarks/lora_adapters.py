"""Several LoRA adapters in one batch against one merged adapter: ``inference_throughput.py
--adapters N`` (issue: two adapters mixed in every batch at least 0.8x the throughput of the
engine serving one merged adapter).

Two engines over the same bundled weights, in this process, one at a time: **merged** has one
adapter merged into its weights (``update_weights(adapter_path=...)``, what GRPO's embedded
policy does) and every request on it; **N rows** serves N adapters beside the weights
(``load_lora_adapter``, vLLM's multi-LoRA) with the requests spread over them round-robin, so
every batch mixes them. The adapters are random PEFT LoRAs of rank ``--adapter-rank`` on every
linear projection (q, k, v, o, gate, up, down). Each round sends the ``--requests`` chats at once
(greedy, ``--max-tokens``, token ids and logprobs as the gateway asks), the two engines
alternating first; tokens/s per round and the ratio within each round are printed.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def make_adapters(base: Path, folder: Path, n: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = []
    for i in range(n):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        peft = get_peft_model(model, config)
        for name, param in peft.named_parameters():  # small deltas: a trained adapter's size
            if "lora_B" in name:
                param.data.mul_(0.01)
        peft.save_pretrained(folder / f"adapter-{i}")
        out.append(folder / f"adapter-{i}")
    return out


async def _round(engine: Any, texts: list[str], models: list[str], max_tokens: int) -> tuple[int, float]:
    bodies = [
        {
            "model": models[i % len(models)],
            "messages": [{"role": "user", "content": t}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "return_token_ids": True,
        }
        for i, t in enumerate(texts)
    ]
    started = time.perf_counter()
    answers = await asyncio.gather(*(engine.chat(b) for b in bodies))
    seconds = time.perf_counter() - started
    return sum(a["usage"]["completion_tokens"] for a in answers), seconds


def adapters_ab(texts: list[str], args: Any) -> None:
    from agentbolt.engine import ModelEngine, ensure_model

    n = args.adapters
    if n < 1:
        raise SystemExit("--adapters takes a number of adapters, at least 1")
    base = ensure_model(args.model)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        paths = make_adapters(base, Path(tmp), n, args.adapter_rank)
        merged = ModelEngine.from_pretrained(base, device="cpu", dtype=args.dtype, name="base").start()
        rows = ModelEngine.from_pretrained(base, device="cpu", dtype=args.dtype, name="base").start()
        try:
            merged.update_weights(adapter_path=str(paths[0]))
            names = [rows.load_lora_adapter(f"adapter-{i}", str(p)) for i, p in enumerate(paths)]
            systems = {"merged": (merged, ["base"]), f"{n} rows": (rows, names)}
            for engine, models in systems.values():  # warm-up: one untimed batch each
                asyncio.run(_round(engine, texts, models, min(args.max_tokens, 8)))
            rates: dict[str, list[float]] = {k: [] for k in systems}
            for round_ in range(args.repeat):
                order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
                for key in order:
                    engine, models = systems[key]
                    tokens, seconds = asyncio.run(_round(engine, texts, models, args.max_tokens))
                    rates[key].append(tokens / seconds)
                ratio = rates[f"{n} rows"][-1] / rates["merged"][-1]
                print(
                    f"round {round_ + 1}: merged {rates['merged'][-1]:.1f} tokens/s, {n} adapters per row "
                    f"{rates[f'{n} rows'][-1]:.1f} tokens/s: {ratio:.2f}x",
                    flush=True,
                )
            ratios = [r / m for r, m in zip(rates[f"{n} rows"], rates["merged"], strict=True)]
            print(
                f"{len(texts)} requests x {args.max_tokens} tokens, {args.dtype}, rank {args.adapter_rank}, "
                f"{rows.stats()['forward']} forward: {n} adapters mixed in every batch at "
                f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}) the "
                "throughput of one merged adapter (target >= 0.8x)"
            )
        finally:
            merged.close()
            rows.close()
