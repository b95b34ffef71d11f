"""Inference throughput of the embedded engine next to Hugging Face ``generate`` and llama-cpp-python.

The systems serve the same SmolLM2-135M-Instruct weights and the same chat requests (32 distinct
story prompts by default, greedy, ``max_tokens`` 64), one after the other so they never share the
CPU:

1. **agentbolt engine** - ``agentbolt model serve`` in its own process (bfloat16 by default),
   all requests sent at once over HTTP with ``logprobs: true`` and token ids (what the gateway
   asks for). ``--engine-variants auto,native`` also runs it with ``--cpu-matmul native``
   (PyTorch's own bfloat16 kernels and attention), to show what the engine's matrix-product
   mode buys (packed weights, and float32 decode-step attention)
   (``auto`` is ``packed`` on CPUs with bfloat16 units, ``float32`` on the others).
2. **static-batch generate** - ``model.generate`` on ONE left-padded batch of the same prompts,
   same dtype, same ``max_new_tokens``, greedy, in this process: what a user writes in ten lines.
   Tokens are counted per row up to and including its end-of-sequence token, like the engine's
   ``usage``; the wall time includes the prefill, as the engine's does. ``--static-float32``
   adds the same with float32 weights: on CPUs without bfloat16 units (AVX2 only) PyTorch's
   bfloat16 kernels are slow, and float32 is what a user there should compare against.
3. **sequential generate** - ``model.generate`` one request after another (the first
   ``--sequential`` prompts: it is a rate, and slow).
4. **llama-cpp-python** - its OpenAI server on the GGUF file the model was converted from
   (Q4_1, no logprobs: its fastest setting), all requests at once.
   Skipped, with the command to install it, when ``import llama_cpp`` fails.

With ``--repeat R`` the engine, static-batch generate and llama.cpp run R rounds, alternating
(the order rotates each round), and every round is printed; the table shows each system's best
round and the range. Ratios are taken within a round (engine / other system, same round), so a
busy spell of a shared machine hits both sides; the range of those ratios is printed too.

Warm-up: before anything is timed, each system answers one short request and then
``--warm-batches`` (default 1) batches of as many other chats (poems instead of stories), untimed:
the first batch of a shape pays one-time costs (oneDNN sets up its kernels for each new product
shape, the engine's thread tuner makes its first probe). Before this only the short request was
untimed: the generate baseline, which lives in this process, was still warm from its earlier
runs (its one-thread run, earlier rounds), while each engine server, started afresh every round,
was timed on its first batch. ``--warm-batches 0`` gives that setting: engine 427-449 tokens/s
against 427-466 for static generate (0.96-1.02x per round), and then, with the default,
465-566 against 450-464 (1.00-1.26x; both ``--skip-llama-cpp --sequential 0 --repeat 3``, quiet
2-core Xeon with AMX, Dec 5).

Thread settings: the engine chooses its thread count itself from measured step times; the
``generate`` baselines and llama.cpp run with 1 thread and with all CPUs (``--baseline-threads``)
and keep the faster (on a machine shared with other jobs one thread is often several times
faster). Aggregate throughput = completion tokens / wall time from the first request sent to the
last answer received. Resident memory: peak RSS of the engine's server process and of this
process during static-batch generate (which holds the model once), sampled every 50 ms.
Targets from the issue: >= 1.5x static-batch generate and >= 4x llama-cpp-python's server.

    python benchmarks/inference_throughput.py [--requests 32] [--max-tokens 64] [--dtype bfloat16] [--repeat 3]
    python benchmarks/inference_throughput.py --quick      # 1 round, 16 tokens, 1 baseline thread count

``--adapters N`` compares instead N LoRA adapters served per row, every batch mixing them, with
one merged adapter (``benchmarks/lora_adapters.py``).
``--engine-forwards default,engine`` also runs the engine server with its own Llama forward pass
(:mod:`agentbolt.engine.forward`, ``--forward engine``) beside the command's default, in the same
rounds.
``--engine-idle-memory release,keep`` also runs the engine server with
``--no-release-idle-memory`` (the heap's free pages kept when the batch empties), in the same
rounds: what that hand-back costs the next batch.
``--engine-kernels on,off`` also runs the engine server with ``--no-kernels`` (PyTorch's ops
instead of the engine's C kernels, :mod:`agentbolt.engine.kernels`), in the same rounds.
``--forward-ab`` measures that difference in this process instead: one batch of the chats in the
engine's batcher (no server, ``--baseline-threads``' first count, 1 by default), its decode steps
alternating step by step between transformers' forward, the engine's own, and the engine's own
with batched-product decode attention; it prints the median step time of each.

``--thread-ab`` measures why ``agentbolt model serve`` runs the engine's loop in the main thread
(``ModelEngine.run_here``): one batch of the chats in the engine's batcher in this process (no
server, no thread tuning, all CPUs or ``--baseline-threads``' last count), stepped in the main
thread and in a second thread, alternating for ``--repeat`` rounds; it prints the median decode
step of each.

``--decode-attention-ab`` measures one engine detail instead: the engine's batcher in this process
(no server), bfloat16 with packed weights, the same chats decoded with the float32 decode-step
attention (``agentbolt.engine.matmul.decode_attention``, ``PackedMatmul(attention=True)``) and
with PyTorch's CPU flash kernel (the default), alternating for ``--repeat`` rounds. With
transformers 5.x a grouped-query model such as SmolLM2 packs its decode-step queries so that
``decode_attention`` declines them: both variants then run the flash kernel.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
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
def server_process(
    cmd: list[str], port: int, timeout: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """``cmd`` started (with ``env`` as its environment; None: this process's), once it answers."""
    log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill up and stall the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
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


def warm_up_texts(n: int) -> list[str]:
    """``n`` chats unlike the measured ones (poems, not stories) for an untimed warm-up batch."""
    combos = [f"Write a short poem about {s} {p}." for p in PLOTS for s in SUBJECTS]
    return [combos[i % len(combos)] + ("" if i < len(combos) else f" Verse {i}.") for i in range(n)]


async def fire(
    base_url: str, texts: list[str], max_tokens: int, extra: dict, warm_batches: int = 1
) -> tuple[int, float]:
    """Completion tokens and seconds of ``texts`` sent at once, after an untimed warm-up: one
    request, then ``warm_batches`` batches of as many other chats."""
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
        for _ in range(warm_batches):  # nor are the first batch's (see the module docstring)
            await asyncio.gather(*[one(t) for t in warm_up_texts(len(texts))])
        started = time.perf_counter()
        counts = await asyncio.gather(*[one(t) for t in texts])
        return sum(counts), time.perf_counter() - started


def bench_engine(
    texts: list[str],
    args,
    cpu_matmul: str = "auto",
    forward: str = "default",
    idle: str = "release",
    kernels: str = "on",
) -> tuple[Result, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentbolt.cli.model", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--max-batch", str(args.max_batch), "--cpu-matmul", cpu_matmul]
    if forward != "default":
        cmd += ["--forward", forward]
    if idle == "keep":
        cmd += ["--no-release-idle-memory"]
    if kernels == "off":
        cmd += ["--no-kernels"]
    with server_process(cmd, port) as proc, RssSampler(proc.pid) as rss:
        extra = {"logprobs": True, "return_token_ids": True}
        tokens, seconds = asyncio.run(
            fire(f"http://127.0.0.1:{port}/v1", texts, args.max_tokens, extra, args.warm_batches)
        )
    tags = [f"{cpu_matmul} matmul"] if cpu_matmul != "auto" else []
    tags += [f"{forward} forward"] if forward != "default" else []
    tags += ["idle memory kept"] if idle == "keep" else []
    tags += ["no C kernel"] if kernels == "off" else []
    name = "agentbolt engine" + (f" ({', '.join(tags)})" if tags else "")
    note = f"{args.dtype}, max batch {args.max_batch}, logprobs + token ids on, cpu_matmul={cpu_matmul}, forward={forward}"
    return Result(name, len(texts), tokens, seconds, note), rss.peak


class HFBaseline:
    """The same weights and dtype in this process, for the ``generate`` baselines."""

    def __init__(self, args, dtype: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from agentbolt.engine import ensure_model
        from agentbolt.engine.engine import resolve_dtype

        path = ensure_model(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.dtype = dtype or args.dtype
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(self.dtype)).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or [])
        self.torch, self.args = torch, args
        with torch.inference_mode():  # warm-up: first-call costs are not throughput
            self.model.generate(**self.encode(["Hi"]), max_new_tokens=4, do_sample=False)
            for _ in range(args.warm_batches):  # as the servers are warmed (fire)
                texts = warm_up_texts(args.requests)
                self.model.generate(**self.encode(texts), max_new_tokens=args.max_tokens, do_sample=False)

    def encode(self, texts: list[str]):
        rendered = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            )
            for t in texts
        ]
        return self.tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)

    def generated(self, out_BT, prompt_len: int) -> int:
        """Tokens per row up to and including the first end-of-sequence token (the engine's usage)."""
        total = 0
        for row in out_BT[:, prompt_len:].tolist():
            ends = [i for i, t in enumerate(row) if t in self.eos]
            total += ends[0] + 1 if ends else len(row)
        return total

    def static_batch(self, texts: list[str], threads: int) -> tuple[int, float]:
        torch = self.torch
        torch.set_num_threads(threads)
        started = time.perf_counter()
        enc = self.encode(texts)  # tokenizing is part of the job, as in the engine
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=self.args.max_tokens, do_sample=False)
        seconds = time.perf_counter() - started
        return self.generated(out, enc["input_ids"].shape[1]), seconds


def bench_static(baseline: HFBaseline, texts: list[str], args) -> tuple[Result, int]:
    counts = thread_counts(args)
    runs = {}
    with RssSampler(os.getpid()) as rss:
        for threads in counts:
            runs[threads] = baseline.static_batch(texts, threads)
    best = max(counts, key=lambda t: runs[t][0] / runs[t][1])
    tried = ", ".join(f"{t} thread(s): {runs[t][0] / runs[t][1]:.1f}" for t in counts)
    note = f"{baseline.dtype}, one left-padded batch of {len(texts)}, greedy; best of [{tried}] tok/s"
    name = "static-batch model.generate"
    if baseline.dtype != args.dtype:
        name += f" ({baseline.dtype})"
    return Result(name, len(texts), *runs[best], note), rss.peak


def bench_sequential(baseline: HFBaseline, texts: list[str], args) -> Result:
    torch = baseline.torch
    counts = thread_counts(args)
    tokens, seconds = dict.fromkeys(counts, 0), dict.fromkeys(counts, 0.0)
    with torch.inference_mode():
        for text in texts:
            enc = baseline.encode([text])
            for threads in counts:  # interleaved, so a busy spell hits both settings
                torch.set_num_threads(threads)
                started = time.perf_counter()
                out = baseline.model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False)
                seconds[threads] += time.perf_counter() - started
                tokens[threads] += baseline.generated(out, enc["input_ids"].shape[1])
    best = max(counts, key=lambda t: tokens[t] / seconds[t])
    note = f"{args.dtype}, {best} thread(s) (best of {counts})"
    return Result("sequential model.generate", len(texts), tokens[best], seconds[best], note)


def thread_counts(args) -> list[int]:
    """1 and all CPUs: on a shared machine fewer threads can be much faster (the engine tunes this)."""
    if args.baseline_threads:
        return [int(t) for t in args.baseline_threads.split(",")]
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
    runs = [llama_cpp_run(texts, args, gguf, threads) for threads in thread_counts(args)]
    return max(runs, key=lambda r: r.tokens_per_s)


def llama_cpp_run(texts: list[str], args, gguf: Path, threads: int) -> Result:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    cmd += ["--n_ctx", "2048", "--verbose", "false"]
    with server_process(cmd, port):
        tokens, seconds = asyncio.run(
            fire(f"http://127.0.0.1:{port}/v1", texts, args.max_tokens, {}, args.warm_batches)
        )
    note = f"{gguf.name}, {threads} thread(s) (best of {thread_counts(args)})"
    return Result("llama-cpp-python server", len(texts), tokens, seconds, note)


def model_and_prompts(texts: list[str], args, dtype: str | None = None):
    """The model (``dtype`` or ``--dtype``), its tokenizer and the chats' prompt token ids, in process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentbolt.engine import ensure_model
    from agentbolt.engine.engine import resolve_dtype

    path = ensure_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype or args.dtype)).eval()
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    return model, tokenizer, [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]


def decode_attention_ab(texts: list[str], args) -> None:
    """In-process batcher with and without ``decode_attention`` (packed bfloat16 weights), interleaved."""
    from agentbolt.engine import matmul as mm
    from agentbolt.engine.batcher import Batcher
    from agentbolt.engine.sampling import SamplingParams
    from agentbolt.engine.sequence import Sequence

    if not mm.packed_matmul_available():
        print("no oneDNN packed linear in this PyTorch: nothing to compare")
        return
    model, tokenizer, prompt_ids = model_and_prompts(texts, args, "bfloat16")

    def run(variant: str) -> float:
        batcher = Batcher(
            model, {tokenizer.eos_token_id}, max_batch=args.max_batch, max_context=2048, matmul="packed"
        )
        mode = batcher.matmul_mode
        assert isinstance(mode, mm.PackedMatmul)
        mode.attention = variant == "decode_attention"
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        seqs = [Sequence(p, params, tokenizer.decode) for p in prompt_ids]
        started = time.perf_counter()
        for seq in seqs:
            batcher.submit([seq])
        while batcher.num_running or batcher.num_waiting:
            batcher._step()
        return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - started)

    variants = ["decode_attention", "flash kernel"]
    run(variants[0])  # warm-up
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.repeat):
        for v in variants[round_ % 2 :] + variants[: round_ % 2]:
            rates[v].append(run(v))
        print(
            f"round {round_ + 1}: " + ", ".join(f"{v} {r[-1]:.1f} tok/s" for v, r in rates.items()),
            flush=True,
        )
    ratios = [a / b for a, b in zip(rates[variants[0]], rates[variants[1]], strict=True)]
    print(f"decode_attention / flash kernel per round: {min(ratios):.2f}-{max(ratios):.2f}x")


def in_process_batcher(texts: list[str], args):
    """A batcher over the model in this process, set up as ``agentbolt model serve`` sets it up
    (``--engine-variants``/``--engine-forwards``: the first of each) but with a fixed thread
    count (the last of ``--baseline-threads``, default all CPUs); and the chats' prompt ids."""
    import torch

    from agentbolt.engine.batcher import Batcher
    from agentbolt.engine.engine import cpu_matmul_mode

    model, tokenizer, prompt_ids = model_and_prompts(texts, args)
    threads = int(args.baseline_threads.split(",")[-1] or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    forward = args.engine_forwards.split(",")[0]
    batcher = Batcher(
        model,
        {tokenizer.eos_token_id},
        max_batch=args.max_batch,
        max_context=2048,
        matmul=cpu_matmul_mode(args.engine_variants.split(",")[0], model),
        tune_threads=False,
        forward=forward if forward != "default" else "auto",  # the serve command's default
    )
    return batcher, tokenizer, prompt_ids, threads


def decode_steps(batcher, tokenizer, prompt_ids: list[list[int]], args) -> list[float]:
    """Seconds of each decode step of one batch of the chats (the prefill and the first decode
    step, which share a step, not counted)."""
    from agentbolt.engine.sampling import SamplingParams
    from agentbolt.engine.sequence import Sequence

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompt_ids:
        batcher.submit([Sequence(p, params, tokenizer.decode)])
    batcher._step()
    steps = []
    while batcher.num_running:
        started = time.perf_counter()
        batcher._step()
        steps.append(time.perf_counter() - started)
    return steps


def thread_ab(texts: list[str], args) -> None:
    """The same in-process batch stepped in the main thread and in a second thread, alternating."""
    import statistics

    import torch

    batcher, tokenizer, prompt_ids, threads = in_process_batcher(texts, args)
    medians: dict[str, list[float]] = {"main thread": [], "second thread": []}

    def one_batch(where: str) -> None:
        torch.set_num_threads(threads)  # a new thread starts from the process default: same count
        medians[where].append(statistics.median(decode_steps(batcher, tokenizer, prompt_ids, args)) * 1e3)

    one_batch("main thread")  # warm-up
    medians["main thread"].clear()
    for round_ in range(args.repeat):
        for where in ["main thread", "second thread"][:: 1 if round_ % 2 == 0 else -1]:
            if where == "main thread":
                one_batch(where)
            else:
                worker = threading.Thread(target=one_batch, args=(where,))
                worker.start()
                worker.join()
        print(
            f"round {round_ + 1}: median decode step, main thread {medians['main thread'][-1]:.1f} ms, "
            f"second thread {medians['second thread'][-1]:.1f} ms",
            flush=True,
        )
    ratios = [b / a for a, b in zip(medians["main thread"], medians["second thread"], strict=True)]
    print(
        f"{args.requests} rows, {args.dtype}, {threads} thread(s), load average {os.getloadavg()[0]:.1f}: "
        f"second thread / main thread per round {min(ratios):.2f}-{max(ratios):.2f}x"
    )


def profile_steps(texts: list[str], args) -> None:
    """Where a decode step's time goes: one in-process batch under ``torch.profiler``, in the main
    thread, after a warm-up batch; the operators that took the most CPU, grouped."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from agentbolt.engine import kernels

    batcher, tokenizer, prompt_ids, threads = in_process_batcher(texts, args)
    decode_steps(batcher, tokenizer, prompt_ids, args)  # warm-up
    # the engine's C kernels are ctypes calls the profiler does not see: name them for it
    for name in ("decode_attention", "rope_append", "add_rms_norm", "silu_mul", "row_stats"):
        setattr(kernels, name, _profiled(getattr(kernels, name), f"agentbolt::{name}"))
    plain = [
        statistics.median(decode_steps(batcher, tokenizer, prompt_ids, args)) for _ in range(args.repeat)
    ]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps = decode_steps(batcher, tokenizer, prompt_ids, args)
    ops = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    total = sum(t for _, t, _ in ops) or 1.0
    groups = {
        "linear products": ("_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear"),
        "attention": ("scaled_dot_product", "aten::bmm", "aten::_softmax", "agentbolt::decode_attention"),
        "logprobs and sampling": (
            "log_softmax",
            "aten::sort",
            "aten::topk",
            "aten::argmax",
            "aten::cumsum",
            "agentbolt::row_stats",
        ),
        "RoPE, norms, SiLU (C kernels)": (
            "agentbolt::rope_append",
            "agentbolt::add_rms_norm",
            "agentbolt::silu_mul",
        ),
    }
    shares = dict.fromkeys([*groups, "everything else"], 0.0)
    for key, t, _ in ops:
        group = next((g for g, names in groups.items() if any(n in key for n in names)), "everything else")
        shares[group] += t / total
    print(
        f"{args.requests} rows, {args.max_tokens} tokens, {args.dtype}, cpu_matmul={batcher.matmul_kind or 'native'}, "
        f"forward={'engine' if batcher.own_forward is not None else 'transformers'}, {threads} thread(s), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "median decode step: "
        + ", ".join(f"{m * 1e3:.1f}" for m in plain)
        + f" ms ({args.repeat} batches unprofiled); {statistics.median(steps) * 1e3:.1f} ms profiled"
    )
    print("share of the profiled CPU time: " + ", ".join(f"{g} {v:.0%}" for g, v in shares.items()))
    print(f"{'operator':<56} {'self CPU %':>10} {'calls/step':>10} {'us/call':>9}")
    for key, t, count in sorted(ops, key=lambda o: -o[1])[:15]:
        print(
            f"{key[:56]:<56} {t / total:>10.1%} {count / max(len(steps), 1):>10.1f} {t / max(count, 1):>9.1f}"
        )


def _profiled(fn: Callable, name: str) -> Callable:
    """``fn`` under ``torch.profiler.record_function(name)``, so its time shows as an operator."""
    import torch

    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return run


def forward_ab(texts: list[str], args) -> None:
    """Decode steps of one in-process batch, alternating transformers' forward and the engine's own."""
    import statistics

    import torch

    from agentbolt.engine.batcher import Batcher
    from agentbolt.engine.engine import cpu_matmul_mode
    from agentbolt.engine.sampling import SamplingParams
    from agentbolt.engine.sequence import Sequence

    model, tokenizer, prompt_ids = model_and_prompts(texts, args)
    matmul = cpu_matmul_mode(args.engine_variants.split(",")[0], model)
    threads = int(args.baseline_threads.split(",")[0] or 1)
    torch.set_num_threads(threads)
    batcher = Batcher(
        model,
        {tokenizer.eos_token_id},
        max_batch=args.max_batch,
        max_context=2048,
        matmul=matmul,
        tune_threads=False,
    )
    own = batcher.own_forward
    if own is None:
        print(f"the engine's forward does not take this model ({batcher.forward_note}): nothing to compare")
        return
    variants = ["transformers", "engine", "engine, bmm attention"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.repeat):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        seqs = [Sequence(p, params, tokenizer.decode) for p in prompt_ids]
        for seq in seqs:
            batcher.submit([seq])
        batcher._step()  # the prefill (and a first decode step), not timed
        step = 0
        while batcher.num_running:
            which = variants[(step + round_) % len(variants)]
            batcher.own_forward = None if which == "transformers" else own
            own.bmm_attention = which.endswith("bmm attention")
            started = time.perf_counter()
            batcher._step()
            times[which].append(time.perf_counter() - started)
            step += 1
        batcher.own_forward = own
    if not all(times.values()):
        print(
            f"too few decode steps for {len(variants)} variants: raise --max-tokens (now {args.max_tokens})"
        )
        return
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = med["transformers"]
    print(
        f"{args.requests} rows, {args.dtype}, cpu_matmul={matmul or 'native'}, {threads} thread(s), "
        f"decode steps alternated ({len(times['engine'])} each), load average {os.getloadavg()[0]:.1f}; "
        "median step: " + ", ".join(f"{k} {v:.1f} ms ({base / v:.2f}x)" for k, v in med.items())
    )


def report(rounds: list[dict[str, Result]], skipped: list[str], memory: dict[str, int], args) -> None:
    engine_name = "agentbolt engine"
    names = list(dict.fromkeys(n for r in rounds for n in r))
    print(
        f"\n{args.requests} concurrent chat requests, max_tokens {args.max_tokens}, greedy, {args.dtype}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {len(rounds)} round(s)\n"
    )
    print(f"{'system':38} {'best tok/s':>10} {'range tok/s':>16} {'engine is (per round)':>24}  notes")
    ratios: dict[str, list[float]] = {}
    for name in names:
        results = [r[name] for r in rounds if name in r]
        rates = [x.tokens_per_s for x in results]
        best = max(results, key=lambda x: x.tokens_per_s)
        per_round = [
            r[engine_name].tokens_per_s / r[name].tokens_per_s
            for r in rounds
            if name in r and engine_name in r
        ]
        ratios[name] = per_round
        ratio = f"{min(per_round):.2f}-{max(per_round):.2f}x" if per_round else "-"
        span = f"{min(rates):.1f}-{max(rates):.1f}"
        print(f"{name:38} {best.tokens_per_s:10.1f} {span:>16} {ratio:>24}  {best.note}")
    for line in skipped:
        print(f"skipped: {line}")
    print()
    for what, peak in memory.items():
        print(f"peak resident memory, {what}: {peak / 2**30:.2f} GiB")
    checks = [("engine server resident memory < 2 GiB", memory.get("engine server", 0) < 2 * 2**30)]
    for name, factor in (("static-batch model.generate", 1.5), ("llama-cpp-python server", 4.0)):
        if ratios.get(name):
            worst = min(ratios[name])
            checks.append((f">= {factor}x {name} in every round (worst {worst:.2f}x)", worst >= factor))
    for name, ok in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--sequential", type=int, default=8, help="prompts for the sequential baseline (0: skip)"
    )
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-static", action="store_true", help="leave out static-batch generate")
    parser.add_argument(
        "--static-float32",
        action="store_true",
        help="also run static-batch generate with float32 weights (on CPUs without bfloat16 units it is faster)",
    )
    parser.add_argument(
        "--engine-variants",
        default="auto",
        help="comma-separated --cpu-matmul settings of the engine to run each round (auto,native,packed,float32)",
    )
    parser.add_argument(
        "--engine-forwards",
        default="default",
        help="comma-separated --forward settings of `agentbolt model serve` to run each round: default "
        "(the command's own default), transformers, engine (the engine's own forward, Llama models), auto",
    )
    parser.add_argument(
        "--engine-idle-memory",
        default="release",
        help="comma-separated: release (the serve command's default: the heap's free pages handed "
        "back each time the batch empties) and/or keep (--no-release-idle-memory)",
    )
    parser.add_argument(
        "--engine-kernels",
        default="on",
        help="comma-separated: on (the serve command's default: a decode step's attention in the "
        "engine's C kernel) and/or off (--no-kernels: PyTorch's attention)",
    )
    parser.add_argument(
        "--baseline-threads",
        default="",
        help="thread counts for the baselines, e.g. 1 or 1,2 (default: 1 and all CPUs)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the order of the systems rotates")
    parser.add_argument(
        "--warm-batches",
        type=int,
        default=1,
        help="untimed batches of other chats each system runs first (0: only one short request)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 16 tokens, baselines with 1 thread, no sequential"
    )
    parser.add_argument(
        "--decode-attention-ab",
        action="store_true",
        help="only compare the engine's decode-step attention with PyTorch's flash kernel, in process",
    )
    parser.add_argument(
        "--forward-ab",
        action="store_true",
        help="only compare decode steps of transformers' forward and the engine's own, alternated in process",
    )
    parser.add_argument(
        "--thread-ab",
        action="store_true",
        help="only compare decode steps run in the main thread and in a second thread, in process",
    )
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="only compare N LoRA adapters served per row (every batch mixing them) with one merged "
        "adapter, in process (benchmarks/lora_adapters.py)",
    )
    parser.add_argument("--adapter-rank", type=int, default=8, help="rank of the --adapters LoRAs")
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="only profile the decode steps of one in-process batch (torch.profiler): where a step's time goes",
    )
    args = parser.parse_args()
    if not set(args.engine_kernels.split(",")) <= {"on", "off"}:
        parser.error(f"--engine-kernels takes on and/or off, not {args.engine_kernels!r}")
    if not set(args.engine_idle_memory.split(",")) <= {"release", "keep"}:
        parser.error(f"--engine-idle-memory takes release and/or keep, not {args.engine_idle_memory!r}")
    only = {  # the in-process studies, each instead of the throughput comparison
        "profile_steps": profile_steps,
        "thread_ab": thread_ab,
        "forward_ab": forward_ab,
        "decode_attention_ab": decode_attention_ab,
    }
    if args.adapters:
        from lora_adapters import adapters_ab

        adapters_ab(prompts(args.requests), args)
        return
    for flag, study in only.items():
        if getattr(args, flag):
            study(prompts(args.requests), args)
            return
    if args.quick:
        args.repeat, args.max_tokens, args.sequential = 1, 16, 0
        args.baseline_threads = args.baseline_threads or "1"
    texts = prompts(args.requests)
    baseline = None if args.skip_static and not args.sequential else HFBaseline(args)
    skipped: list[str] = []
    memory: dict[str, int] = {}

    def run_engine(
        variant: str, forward: str = "default", idle: str = "release", kernels: str = "on"
    ) -> Result:
        result, peak = bench_engine(texts, args, variant, forward, idle, kernels)
        key = "engine server" + result.name.removeprefix("agentbolt engine")
        memory[key] = max(memory.get(key, 0), peak)
        return result

    def run_static(model: HFBaseline) -> Result:
        result, peak = bench_static(model, texts, args)
        key = f"this process, static-batch generate ({model.dtype})"
        memory[key] = max(memory.get(key, 0), peak)
        return result

    def run_llama() -> Result | None:
        llama = bench_llama_cpp(texts, args)
        if isinstance(llama, str):
            skipped[:] = [llama]
            return None
        return llama

    systems: list[tuple[str, Callable[[], Result | None]]] = [
        (f"engine {v} {f} {i} {k}", partial(run_engine, v, f, i, k))
        for v in args.engine_variants.split(",")
        for f in args.engine_forwards.split(",")
        for i in args.engine_idle_memory.split(",")
        for k in args.engine_kernels.split(",")
    ]
    if not args.skip_static:
        assert baseline is not None
        systems.append(("static", partial(run_static, baseline)))
    if args.static_float32 and args.dtype not in ("float32", "fp32"):
        systems.append(("static float32", partial(run_static, HFBaseline(args, "float32"))))
    if args.skip_llama_cpp:
        skipped.append("llama-cpp-python: --skip-llama-cpp given")
    else:
        systems.append(("llama", run_llama))
    rounds: list[dict[str, Result]] = []
    for round_ in range(args.repeat):  # alternate the systems, rotating the order, so a busy spell hits all
        k = round_ % len(systems)
        this: dict[str, Result] = {}
        for _, run in systems[k:] + systems[:k]:
            result = run()
            if result is not None:
                this[result.name] = result
                print(f"round {round_ + 1}: {result.name:38} {result.tokens_per_s:8.1f} tokens/s", flush=True)
        rounds.append(this)
    if args.sequential and baseline is not None:
        seq = bench_sequential(baseline, texts[: args.sequential], args)
        print(f"sequential: {seq.tokens_per_s:.1f} tokens/s", flush=True)
        for r in rounds:
            r[seq.name] = seq
    report(rounds, skipped, memory, args)


if __name__ == "__main__":
    main()
