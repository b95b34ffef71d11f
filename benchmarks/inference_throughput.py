"""Inference throughput of the embedded engine next to sequential ``generate`` and llama-cpp-python.

Three systems serve the same SmolLM2-135M-Instruct weights and the same chat requests (32 distinct
story prompts by default, greedy, ``max_tokens`` 64), one after the other so they never share the
CPU:

1. **agentbolt engine** - ``agentbolt model serve`` in its own process (bfloat16 by default),
   all requests sent at once over HTTP with ``logprobs: true`` (what the gateway asks for).
2. **sequential generate** - ``model.generate`` on the same model and dtype, one request after
   another in this process (the first ``--sequential`` prompts: it is a rate, and slow).
3. **llama-cpp-python** - its OpenAI server on the GGUF file the model was converted from
   (Q4_1, no logprobs: its fastest setting), all requests at once.
   Skipped, with the command to install it, when ``import llama_cpp`` fails.

The engine chooses its CPU thread count itself from measured step times; the two baselines are
run with 1 thread and with all CPUs and keep the faster (on a machine shared with other jobs, one
thread is often several times faster). Aggregate throughput = completion tokens (from ``usage``)
/ wall time from the first request sent to the last answer received. Resident memory is the peak
RSS of the engine's server process, sampled every 50 ms. With ``--repeat R`` the engine and
llama.cpp run R times, alternating, and each keeps its best round (on a shared machine the slow
rounds measure the neighbours). Targets from the issue: >= 4x sequential generate, >= 1.5x
llama-cpp-python, < 2 GiB resident.

    python benchmarks/inference_throughput.py [--requests 32] [--max-tokens 64] [--dtype bfloat16] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

SUBJECTS = [
    "a cat",
    "a lighthouse keeper",
    "a robot",
    "a dragon",
    "a baker",
    "an astronaut",
    "a fox",
    "a pirate",
]
PLOTS = ["who finds a map", "who loses a key", "who learns to sing", "who builds a boat"]


@dataclass
class Result:
    name: str
    requests: int
    tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def prompts(n: int) -> list[str]:
    combos = [f"Write a short story about {s} {p}." for p in PLOTS for s in SUBJECTS]
    return [combos[i % len(combos)] + ("" if i < len(combos) else f" Version {i}.") for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler:
    """Peak resident memory of a process tree, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                procs = [self.proc, *self.proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            time.sleep(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, timeout: float = 300.0) -> Iterator[subprocess.Popen]:
    log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill up and stall the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[2]} exited: {log.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[2]} did not start within {timeout} s")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
        log.close()


async def fire(base_url: str, texts: list[str], max_tokens: int, extra: dict) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:

        async def one(text: str) -> int:
            body = {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            reply = await client.post("/chat/completions", json=body | extra)
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]

        await one("Hi")  # warm-up: first-request costs are not throughput
        started = time.perf_counter()
        counts = await asyncio.gather(*[one(t) for t in texts])
        return sum(counts), time.perf_counter() - started


def bench_engine(texts: list[str], args) -> tuple[Result, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentbolt.engine.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--max-batch", str(args.max_batch)]
    with server_process(cmd, port) as proc, RssSampler(proc.pid) as rss:
        extra = {"logprobs": True, "return_token_ids": True}
        tokens, seconds = asyncio.run(fire(f"http://127.0.0.1:{port}/v1", texts, args.max_tokens, extra))
    note = f"{args.dtype}, max batch {args.max_batch}, logprobs + token ids on"
    return Result("agentbolt engine", len(texts), tokens, seconds, note), rss.peak


def bench_sequential(texts: list[str], args) -> Result:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentbolt.engine import ensure_model
    from agentbolt.engine.engine import resolve_dtype

    path = ensure_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.dtype)).eval()
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        for t in ["Hi", *texts]
    ]
    counts = thread_counts()
    tokens, seconds = dict.fromkeys(counts, 0), dict.fromkeys(counts, 0.0)
    with torch.inference_mode():
        model.generate(**encoded[0], max_new_tokens=8, do_sample=False)  # warm-up
        for enc in encoded[1:]:
            for threads in counts:  # interleaved, so a busy spell hits both settings
                torch.set_num_threads(threads)
                started = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False)
                seconds[threads] += time.perf_counter() - started
                tokens[threads] += out.shape[1] - enc["input_ids"].shape[1]
    torch.set_num_threads(max(counts))
    best = max(counts, key=lambda t: tokens[t] / seconds[t])
    note = f"{args.dtype}, {best} thread(s) (best of {counts})"
    return Result("sequential model.generate", len(texts), tokens[best], seconds[best], note)


def thread_counts() -> list[int]:
    """1 and all CPUs: on a shared machine fewer threads can be much faster (the engine tunes this)."""
    return sorted({1, os.cpu_count() or 1})


def gguf_file() -> Path | None:
    from agentbolt.engine.model_files import find_gguf

    return find_gguf()


def bench_llama_cpp(texts: list[str], args) -> Result | str:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed: pip install 'llama-cpp-python[server]' (compiles ~5 min)"
    gguf = gguf_file()
    if gguf is None:
        return "no GGUF file found (agentbolt model pull)"
    runs = [llama_cpp_run(texts, args, gguf, threads) for threads in thread_counts()]
    return max(runs, key=lambda r: r.tokens_per_s)


def llama_cpp_run(texts: list[str], args, gguf: Path, threads: int) -> Result:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    cmd += ["--n_ctx", "2048", "--verbose", "false"]
    with server_process(cmd, port):
        tokens, seconds = asyncio.run(fire(f"http://127.0.0.1:{port}/v1", texts, args.max_tokens, {}))
    note = f"{gguf.name}, {threads} thread(s) (best of {thread_counts()})"
    return Result("llama-cpp-python server", len(texts), tokens, seconds, note)


def report(results: list[Result], skipped: list[str], rss: int, args) -> None:
    engine = results[0]
    print(
        f"\n{args.requests} concurrent chat requests, max_tokens {args.max_tokens}, greedy; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        f"{'system':28} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'engine is':>10}  notes"
    )
    for r in results:
        ratio = engine.tokens_per_s / r.tokens_per_s
        print(
            f"{r.name:28} {r.requests:8d} {r.tokens:7d} {r.seconds:8.1f} {r.tokens_per_s:9.1f} {ratio:9.2f}x  {r.note}"
        )
    for line in skipped:
        print(f"skipped: {line}")
    print(f"\nengine server peak resident memory: {rss / 2**30:.2f} GiB")
    by_name = {r.name: r for r in results}
    checks = [("resident memory < 2 GiB", rss < 2 * 2**30)]
    if "sequential model.generate" in by_name:
        checks.append(
            (
                ">= 4x sequential generate",
                engine.tokens_per_s >= 4 * by_name["sequential model.generate"].tokens_per_s,
            )
        )
    if "llama-cpp-python server" in by_name:
        checks.append(
            (
                ">= 1.5x llama-cpp-python",
                engine.tokens_per_s >= 1.5 * by_name["llama-cpp-python server"].tokens_per_s,
            )
        )
    for name, ok in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=8, help="prompts for the sequential baseline")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of engine + llama.cpp; the best of each is kept"
    )
    args = parser.parse_args()
    texts = prompts(args.requests)
    runs: dict[str, list[Result]] = {}
    skipped: list[str] = []
    rss = 0
    for round_ in range(args.repeat):  # alternate the servers, so a busy spell hits both
        engine, peak = bench_engine(texts, args)
        rss = max(rss, peak)
        runs.setdefault(engine.name, []).append(engine)
        print(f"round {round_ + 1}: engine {engine.tokens_per_s:.1f} tokens/s", flush=True)
        llama = "--skip-llama-cpp given" if args.skip_llama_cpp else bench_llama_cpp(texts, args)
        if isinstance(llama, str):
            skipped = [llama]
        else:
            runs.setdefault(llama.name, []).append(llama)
            print(f"round {round_ + 1}: llama-cpp-python {llama.tokens_per_s:.1f} tokens/s", flush=True)
    seq = bench_sequential(texts[: args.sequential], args)
    best = [max(r, key=lambda x: x.tokens_per_s) for r in runs.values()]
    report([*best, seq], skipped, rss, args)


if __name__ == "__main__":
    main()
