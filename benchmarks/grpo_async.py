"""Synchronous against asynchronous GRPO at an equal number of updates, on the bundled SmolLM2.

The agent is the calculator task (``agentbolt.tasks.calculator``: one tool call, then the
answer) whose tool call also sleeps for a long-tailed time, as real tools, sandboxes and web
pages do: lognormal with median ``--median`` seconds (0.5) and sigma ``ln(10)/1.645`` (1.40), so
5% of calls take more than ten times the median (5 s). ``--task calculator`` drops the sleep:
the CPU-bound check, where the engine and the trainer share the cores and asynchronous mode
can only overlap compute with compute (it must not be slower).

Every run (a mode and a seed) is its own process, runs ``--updates`` updates of
``--tasks-per-step`` groups of ``--group-size`` and validates once, after the last update, on
held-out problems (never in training); the two modes of one seed run one after the other, their
order alternating by seed. Printed per run and, over the seeds, per mode (mean +- sample
standard deviation): steps per hour (updates over the seconds of the training steps, validation
left out), the run's wall time, held-out success by the true reward (the rollout's own, read from
the run's store), sampled and greedy; then the difference of the means against the seeds' spread
and the speed-up. Figures only, no assertion: compare within one run, on a quiet machine.

    python benchmarks/grpo_async.py [--updates 8] [--seeds 0,1,2] [--task slow-tools|calculator]
        [--tasks-per-step 4] [--group-size 8] [--val-tasks 64] [--max-staleness 1] [--json out.json]
    python benchmarks/grpo_async.py --quick   # 2 updates, 1 seed, small groups: checks it works
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentbolt.tasks.base import TextGameAgent

SIGMA = math.log(10) / 1.645
"""Lognormal sigma putting the 95th percentile at ten times the median."""


class SlowToolAgent(TextGameAgent):
    """A built-in text game whose tool calls each sleep a lognormal time (median ``median``)."""

    def __init__(self, *args: Any, median: float = 0.5, sigma: float = SIGMA, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.median, self.sigma = median, sigma

    async def tool_latency(self, use: Any) -> float:
        latency = random.lognormvariate(math.log(self.median), self.sigma) if self.median else 0.0
        await asyncio.sleep(latency)  # the slow tool
        return latency * 1000


# ---------------------------------------------------------------------------- one run


def heldout_success(run_dir: Path) -> dict[str, float | None]:
    """Held-out success by the true reward (the rollout's own, >= 1), sampled and greedy, read
    from the run's store (the only validation is the one after the last update)."""
    from agentbolt.schemas import Mode, RolloutStatus
    from agentbolt.store import open_store

    store = open_store(str(run_dir / "agentbolt.db"))
    try:
        rows, cursor = [], None
        while True:
            page = store.list_rollouts(limit=1000, cursor=cursor, mode=Mode.VAL)
            rows += page.items
            if not page.next_cursor:
                break
            cursor = page.next_cursor
        trial = {
            v: store.get_resources(v).trial for v in {r.resources_version for r in rows} if v is not None
        }
        out: dict[str, float | None] = {}
        for kind, want_trial in (("sampled", False), ("greedy", True)):
            mine = [
                r
                for r in rows
                if r.resources_version is not None and trial[r.resources_version] == want_trial
            ]
            ok = sum(1 for r in mine if r.status == RolloutStatus.SUCCEEDED and (r.reward or 0.0) >= 1.0)
            out[kind] = ok / len(mine) if mine else None
        return out
    finally:
        store.close()


def run_one(args: argparse.Namespace, mode: str, seed: int) -> dict[str, Any]:
    from rich.console import Console

    from agentbolt import PromptTemplate, Trainer
    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.tasks import TASKS

    bf16 = _bf16()
    task = TASKS["calculator"]
    median = args.median if args.task == "slow-tools" else 0.0
    agent = SlowToolAgent(task.episode, task.worked, median=median)
    agent.max_tokens = task.max_tokens
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-grpo-{mode}-s{seed}-"))
    algo = GRPO(
        steps=args.updates,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        seed=seed,
        asynchronous=mode == "async",
        max_staleness=args.max_staleness,
        importance=args.importance,
        val_every=0,
        validate_before=False,
        checkpoint_every=0,
        plot=False,
        max_tokens_per_micro_batch=args.micro_batch_tokens,
        bf16=bf16,
        engine_dtype="bfloat16" if bf16 else "float32",
    )
    log = (run_dir / "log.txt").open("w")
    t0 = time.perf_counter()
    result = Trainer(
        algo,
        n_runners=1,
        runner_concurrency=4 * args.tasks_per_step * args.group_size,
        run_dir=run_dir,
        console=Console(file=log, width=250),
        resources={"system_prompt": PromptTemplate(template=task.system_prompt, engine="plain")},
    ).fit(agent, task.train_tasks(256, seed=1), task.heldout_tasks(args.val_tasks, seed=2))
    wall = time.perf_counter() - t0
    log.close()
    steps = [h for h in result.history if h.get("step", 0) > 0]
    train_seconds = sum(h["t_step"] for h in steps)
    held = heldout_success(run_dir)
    return {
        "mode": mode,
        "seed": seed,
        "updates": len(steps),
        "steps_per_hour": 3600.0 * len(steps) / train_seconds if train_seconds else None,
        "train_seconds": train_seconds,
        "wall_seconds": wall,
        "heldout_sampled": held["sampled"],
        "heldout_greedy": held["greedy"],
        "train_success": statistics.fmean(h["success"] for h in steps) if steps else None,
        "t_trainer_wait": sum(h.get("t_trainer_wait", h.get("t_rollouts", 0.0)) for h in steps),
        "t_engine_idle": sum(h.get("t_engine_idle", 0.0) for h in steps),
        "t_update": sum(h["t_update"] for h in steps),
        "stale_dropped": sum(h.get("stale_dropped", 0) for h in steps),
        "carried_groups": sum(h.get("carried_groups", 0) for h in steps),
        "run_dir": str(run_dir),
    }


def _bf16() -> bool:
    """bfloat16 only where the hardware has it, as the demo does (emulated on an AVX2-only CPU
    it is tens of times slower than float32)."""
    import torch

    from agentbolt.algorithms.train_state import fast_bf16

    return fast_bf16("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def print_run(r: dict[str, Any]) -> None:
    print(
        f"  {r['mode']:5} seed {r['seed']}: {_fmt(r['steps_per_hour'], '.1f')} steps/h,"
        f" train {r['train_seconds']:.0f} s, wall {r['wall_seconds']:.0f} s,"
        f" held-out success {_fmt(r['heldout_sampled'], '.0%')} sampled /"
        f" {_fmt(r['heldout_greedy'], '.0%')} greedy; trainer waited {r['t_trainer_wait']:.0f} s,"
        f" engine idle {r['t_engine_idle']:.0f} s, update {r['t_update']:.0f} s,"
        f" stale dropped {r['stale_dropped']}, carried {r['carried_groups']}",
        flush=True,
    )


def report(runs: list[dict[str, Any]]) -> None:
    print("\nsummary (mean +- sd over seeds)")
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "async")}
    for metric, spec in (
        ("steps_per_hour", ".1f"),
        ("wall_seconds", ".0f"),
        ("heldout_sampled", ".3f"),
        ("heldout_greedy", ".3f"),
    ):
        stats = {}
        for mode, mine in by_mode.items():
            values = [r[metric] for r in mine if r[metric] is not None]
            stats[mode] = _mean_sd(values) if values else None
        cells = [
            f"{mode} {_fmt(s[0], spec)} +- {_fmt(s[1], spec)}" if s else f"{mode} -"
            for mode, s in stats.items()
        ]
        line = f"  {metric:16} " + " | ".join(cells)
        if stats["sync"] and stats["async"]:
            diff = stats["async"][0] - stats["sync"][0]
            line += f" | async - sync {diff:+{spec}}"
            if min(len(by_mode["sync"]), len(by_mode["async"])) < 2:
                line += " (one seed: no spread to compare with)"
            else:
                spread = max(stats["sync"][1], stats["async"][1])  # the larger of the two modes' sd
                inside = "inside" if abs(diff) <= spread else "OUTSIDE"
                line += f" ({inside} the seeds' spread {spread:{spec}})"
        print(line)
    sync_rate = [r["steps_per_hour"] for r in by_mode["sync"] if r["steps_per_hour"]]
    async_rate = [r["steps_per_hour"] for r in by_mode["async"] if r["steps_per_hour"]]
    if sync_rate and async_rate:
        ratios = [
            a["steps_per_hour"] / s["steps_per_hour"]
            for s in by_mode["sync"]
            for a in by_mode["async"]
            if a["seed"] == s["seed"] and a["steps_per_hour"] and s["steps_per_hour"]
        ]
        speedup = statistics.fmean(async_rate) / statistics.fmean(sync_rate)
        per_seed = ", ".join(f"{x:.2f}x" for x in ratios)
        print(f"  speed-up (steps per hour, async / sync): {speedup:.2f}x (per seed: {per_seed})")


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("slow-tools", "calculator"), default="slow-tools")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--val-tasks", type=int, default=64)
    p.add_argument("--median", type=float, default=0.5, help="median tool latency, seconds")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--importance", choices=("token", "sequence", "off"), default="token")
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="as the demo (memory)")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--quick", action="store_true", help="2 updates, 1 seed, 2 x 4 rollouts, 16 held-out")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # MODE:SEED:OUT, a child process's run
    return p


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.updates, args.seeds, args.tasks_per_step, args.group_size, args.val_tasks = 2, "0", 2, 4, 16
    if args.one:
        mode, seed, out = args.one.split(":", 2)
        Path(out).write_text(json.dumps(run_one(args, mode, int(seed))))
        return
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = [m for m in args.modes.split(",") if m]
    print(
        f"GRPO sync vs async on SmolLM2, task {args.task}"
        + (
            f" (tool latency lognormal, median {args.median} s, sigma {SIGMA:.2f})"
            if args.task == "slow-tools"
            else ""
        )
        + f": {args.updates} updates of {args.tasks_per_step} x {args.group_size} rollouts,"
        f" seeds {seeds}, {args.val_tasks} held-out tasks, max_staleness {args.max_staleness},"
        f" importance {args.importance}, {'bfloat16' if _bf16() else 'float32'} training and serving",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    child = sys.argv[1:]  # the same options; the child runs one (mode, seed) and writes it to a file
    for i, seed in enumerate(seeds):
        for mode in modes if i % 2 == 0 else list(reversed(modes)):
            out = Path(tempfile.mkstemp(prefix="grpo-async-", suffix=".json")[1])
            cmd = [sys.executable, __file__, *child, "--one", f"{mode}:{seed}:{out}"]
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                print(f"  {mode} seed {seed}: failed (exit {done.returncode})", flush=True)
                continue
            runs.append(json.loads(out.read_text()))
            print_run(runs[-1])
    report(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
        print(f"runs written to {args.json}")


if __name__ == "__main__":
    main()
