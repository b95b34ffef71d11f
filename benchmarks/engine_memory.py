"""How ``agentbolt model serve``'s memory follows the batches it serves, with and without handing
the heap's free pages back each time the batch empties (``--release-idle-memory``, the default).

Each run starts ``agentbolt model serve`` afresh (SmolLM2, bfloat16 by default) and sends it the
same ``--batches`` batches, one after the other: each holds 1-32 chats sent at once, with
prompts of about 60-300 tokens and 8-40 new tokens, sampled at temperature 1 with a fixed seed
per chat, so both settings serve the same token counts. A setting with ``+kernels=N`` (``release+kernels=256``)
also bounds oneDNN's cache of compiled kernels at N (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; its
own default is 1024): every new product shape, such as a prefill's token count, compiles one. The batches are drawn from ``--seed``:
every run of one invocation serves the same ones. The settings alternate run by run
(``--runs`` each), in fresh server processes.

After each batch it reads the server's PSS (``/proc/<pid>/smaps_rollup``) 0.3 s after the last
answer; a thread takes the peak of the process's PSS meanwhile (:class:`agentbolt.memory.PeakMemory`,
every 0.1 s). It prints, per run: PSS once the server is up, after the first batch, at 25%,
50% and at the end, the peak, the seconds the batches took and tokens per second, and the
server's own count and seconds of hand-backs (``/health``); then ``--plot`` draws PSS after
each batch for every run. Nothing else may run on the machine meanwhile.

    python benchmarks/engine_memory.py [--batches 40] [--runs 1] [--settings release,keep] [--plot engine_memory.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field

import httpx
from inference_throughput import free_port, server_process

from agentbolt.memory import PeakMemory, pss_bytes

WORDS = (
    "the river carried old boats past the mill while children counted stones and a quiet dog "
    "watched the baker close his shop before the storm reached the hills beyond town"
).split()
SETTINGS = {"release": "--release-idle-memory", "keep": "--no-release-idle-memory"}


@dataclass
class Chat:
    text: str
    max_tokens: int
    seed: int


@dataclass
class Run:
    setting: str
    pss_gb: list[float] = field(default_factory=list)
    """PSS after start, then after each batch."""
    peak_gb: float = 0.0
    seconds: float = 0.0
    tokens: int = 0
    health: dict = field(default_factory=dict)


def batches(n: int, seed: int) -> list[list[Chat]]:
    """``n`` batches of 1-32 chats: prompts of 45-230 words (about 60-300 tokens), 8-40 new tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.randint(1, 32)
        out.append(
            [
                Chat(
                    "Continue this: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(45, 230))),
                    rng.randint(8, 40),
                    rng.randrange(2**31),
                )
                for _ in range(size)
            ]
        )
    return out


async def serve_batch(client: httpx.AsyncClient, batch: list[Chat]) -> int:
    async def one(chat: Chat) -> int:
        body = {
            "messages": [{"role": "user", "content": chat.text}],
            "max_tokens": chat.max_tokens,
            "temperature": 1.0,
            "seed": chat.seed,
            "logprobs": True,
        }
        reply = await client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    return sum(await asyncio.gather(*[one(c) for c in batch]))


def run_once(setting: str, plan: list[list[Chat]], args: argparse.Namespace) -> Run:
    port = free_port()
    cmd = [sys.executable, "-m", "agentbolt.cli.model", "serve", "--model", args.model, "--port", str(port)]
    idle, _, kernels = setting.partition("+kernels=")
    cmd += ["--dtype", args.dtype, SETTINGS[idle]]
    run = Run(setting)
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": kernels} if kernels else None
    with server_process(cmd, port, env=env) as proc:

        async def drive() -> None:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1800) as client:
                await serve_batch(client, [Chat("Hi", 4, 0)])  # first-request costs
                await asyncio.sleep(0.3)
                run.pss_gb.append((pss_bytes(proc.pid) or 0) / 1e9)
                with PeakMemory(proc.pid, interval=0.1) as peak:
                    for i, batch in enumerate(plan):
                        started = time.perf_counter()
                        run.tokens += await serve_batch(client, batch)
                        run.seconds += time.perf_counter() - started
                        await asyncio.sleep(0.3)  # the loop's idle step runs first
                        run.pss_gb.append((pss_bytes(proc.pid) or 0) / 1e9)
                        print(
                            f"  {setting}: batch {i + 1}/{len(plan)} ({len(batch)} chats) "
                            f"PSS {run.pss_gb[-1]:.2f} GB",
                            flush=True,
                        )
                run.peak_gb = (peak.peak_bytes or 0) / 1e9
                run.health = (await client.get("/health")).json()

        asyncio.run(drive())
    return run


def report(runs: list[Run]) -> None:
    print()
    print(
        "| setting | PSS up | after batch 1 | 25% | 50% | end | peak | batches' seconds | tok/s | hand-backs (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        n = len(r.pss_gb) - 1
        at = [r.pss_gb[0], r.pss_gb[1], r.pss_gb[max(1, n // 4)], r.pss_gb[max(1, n // 2)], r.pss_gb[-1]]
        releases = f"{r.health.get('idle_releases')} ({r.health.get('idle_release_s')})"
        cells = [f"{x:.2f}" for x in at] + [
            f"{r.peak_gb:.2f}",
            f"{r.seconds:.1f}",
            f"{r.tokens / r.seconds:.0f}",
        ]
        print(f"| {r.setting} | " + " | ".join(cells) + f" | {releases} |")


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {"release": "tab:blue", "keep": "tab:red"}
    for i, r in enumerate(runs):
        same = sum(1 for x in runs[:i] if x.setting == r.setting)
        ax.plot(
            range(len(r.pss_gb)),
            r.pss_gb,
            color=colours.get(r.setting),
            alpha=1.0 - 0.3 * same,
            label=f"{r.setting} (run {same + 1}): peak {r.peak_gb:.2f} GB",
        )
    ax.set_xlabel("batches served")
    ax.set_ylabel("server PSS after the batch (GB)")
    ax.set_title("agentbolt model serve: memory over mixed batches")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--runs", type=int, default=1, help="runs per setting, alternated")
    ap.add_argument(
        "--settings",
        default="release,keep",
        help="comma-separated: release (the default) and/or keep, each optionally with +kernels=N "
        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY=N in the server's environment)",
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="engine_memory.png", help="'' for none")
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if re.fullmatch(r"(release|keep)(\+kernels=[0-9]+)?", s) is None]
    if unknown or not settings:
        ap.error(f"--settings takes release, keep, each optionally +kernels=N, not {args.settings!r}")
    if args.batches < 1:
        ap.error("--batches must be at least 1")
    plan = batches(args.batches, args.seed)
    print(
        f"{args.batches} batches, {sum(len(b) for b in plan)} chats; settings {settings}, {args.runs} run(s) each"
    )
    runs = []
    for k in range(args.runs):
        for setting in settings if k % 2 == 0 else settings[::-1]:
            runs.append(run_once(setting, plan, args))
    report(runs)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
