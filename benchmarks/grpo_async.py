"""Synchronous against asynchronous GRPO at an equal number of updates, on the bundled SmolLM2.

The agent is the calculator task (``agentbolt.tasks.calculator``: one tool call, then the
answer) whose tool call also sleeps for a long-tailed time, as real tools, sandboxes and web
pages do: lognormal with median ``--median`` seconds (0.5) and sigma ``ln(10)/1.645`` (1.40), so
5% of calls take more than ten times the median (5 s). Then the calculator check: the same task
without the sleep, where the engine and the trainer share the cores and asynchronous mode can
only overlap compute with compute (it must not be slower); speed only, no held-out set.

Every run (a task, a mode and a seed) is its own process and runs ``--updates`` updates of
``--tasks-per-step`` groups of ``--group-size``; the slow-tools runs validate once, after the
last update, on ``--val-tasks`` held-out problems (never in training). The two modes of one seed
run one after the other, their order alternating by seed. Printed per run and, over the seeds,
per mode (mean +- sample standard deviation): steps per hour (updates over the seconds of the
training steps, validation left out), the run's wall time, held-out success by the true reward
(the rollout's own, read from the run's store), sampled and greedy, the samples trained on;
then the difference of the means against the seeds' spread, the speed-up, and the verdicts
against the targets (>= 1.5x steps per hour; held-out success within the spread; the
calculator not slower). Compare within one run, on a quiet machine.

Defaults, chosen for a like-for-like comparison that fits about 25 minutes on a quiet 2-core
machine: 6 updates of 2 x 8 rollouts (with 3 the last update has nothing to overlap, which caps
the speed-up), 48 held-out problems, 3 seeds, the calculator check on 3 seeds (its verdict:
async faster, or slower by less than the seeds' spread). ``max_staleness`` 2: the pool holds
2 x ``tasks_per_step`` groups (the default), so a group may wait through two updates before it
is taken; with 1, every group carried past the update after its enqueue is stale by
construction, and its samples are lost.

    python benchmarks/grpo_async.py [--updates 6] [--seeds 0,1,2] [--calculator-seeds 0,1,2]
        [--task both|slow-tools|calculator] [--tasks-per-step 2] [--group-size 8]
        [--val-tasks 48] [--max-staleness 2] [--json out.json]
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
    val_tasks = task.heldout_tasks(args.val_tasks, seed=2) if args.val_tasks else []
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
    ).fit(agent, task.train_tasks(256, seed=1), val_tasks)
    wall = time.perf_counter() - t0
    log.close()
    steps = [h for h in result.history if h.get("step", 0) > 0]
    train_seconds = sum(h["t_step"] for h in steps)
    held = heldout_success(run_dir) if val_tasks else {"sampled": None, "greedy": None}
    weighted = [h for h in steps if "is_clipped_fraction" in h]
    return {
        "task": args.task,
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
        "samples": sum(h.get("samples", 0) for h in steps),
        "updates_trained": sum(1 for h in steps if h.get("train_tokens", 0) > 0),
        "stale_dropped": sum(h.get("stale_dropped", 0) for h in steps),
        "evicted_groups": sum(h.get("evicted_groups", 0) for h in steps),
        "carried_groups": sum(h.get("carried_groups", 0) for h in steps),
        "staleness_mean": statistics.fmean(h.get("staleness_mean", 0.0) for h in steps) if steps else None,
        "is_clipped_fraction": (
            statistics.fmean(h["is_clipped_fraction"] for h in weighted) if weighted else None
        ),
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
    held = (
        f" held-out success {_fmt(r['heldout_sampled'], '.0%')} sampled /"
        f" {_fmt(r['heldout_greedy'], '.0%')} greedy;"
        if r.get("heldout_sampled") is not None
        else ""
    )
    off_policy = (
        f", stale dropped {r['stale_dropped']}, evicted groups {r.get('evicted_groups', 0)},"
        f" carried {r['carried_groups']}, staleness mean {_fmt(r.get('staleness_mean'), '.2f')},"
        f" IS clipped {_fmt(r.get('is_clipped_fraction'), '.3f')}"
        if r["mode"] == "async"
        else ""
    )
    print(
        f"  {r.get('task', 'slow-tools')} {r['mode']:5} seed {r['seed']}:"
        f" {_fmt(r['steps_per_hour'], '.1f')} steps/h,"
        f" train {r['train_seconds']:.0f} s, wall {r['wall_seconds']:.0f} s,{held}"
        f" trained on {r.get('samples', '-')} samples in {r.get('updates_trained', '-')} updates; trainer waited {r['t_trainer_wait']:.0f} s,"
        f" engine idle {r['t_engine_idle']:.0f} s, update {r['t_update']:.0f} s{off_policy}",
        flush=True,
    )


SPEEDUP_TARGET = 1.5


def report(runs: list[dict[str, Any]], task: str = "slow-tools") -> None:
    """The summary of one task's runs; with ``calculator``, the not-slower check instead of the
    speed-up and held-out targets."""
    label = "calculator check (CPU-bound, no tool sleep)" if task == "calculator" else task
    print(f"\nsummary, {label} (mean +- sd over seeds)")
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "async")}
    verdicts: list[str] = []
    for metric, spec in (
        ("steps_per_hour", ".1f"),
        ("wall_seconds", ".0f"),
        ("samples", ".0f"),
        ("heldout_sampled", ".3f"),
        ("heldout_greedy", ".3f"),
    ):
        if not any(r.get(metric) is not None for r in runs):
            continue
        stats = {}
        for mode, mine in by_mode.items():
            values = [r[metric] for r in mine if r.get(metric) is not None]
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
                if metric == "heldout_sampled":
                    verdicts.append("held-out success within noise: needs 2 seeds or more")
            else:
                spread = max(stats["sync"][1], stats["async"][1])  # the larger of the two modes' sd
                inside = "inside" if abs(diff) <= spread else "OUTSIDE"
                line += f" ({inside} the seeds' spread {spread:{spec}})"
                if metric == "heldout_sampled":
                    met = "met" if abs(diff) <= spread else "met (async better)" if diff > 0 else "NOT met"
                    verdicts.append(
                        f"held-out success (sampled) within noise of sync: {met}"
                        f" (difference of means {diff:+.3f}, spread {spread:.3f})"
                    )
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
        if task == "calculator":
            # Not slower: faster, or slower by less than the seeds' spread of steps per hour (a
            # CPU-bound run's speed swings with how many of its steps had groups to train on).
            diff = statistics.fmean(async_rate) - statistics.fmean(sync_rate)
            spread = (
                max(_mean_sd(sync_rate)[1], _mean_sd(async_rate)[1])
                if min(len(sync_rate), len(async_rate)) > 1
                else 0.0
            )
            met = "met" if speedup >= 1.0 else "met (within noise)" if -diff <= spread else "NOT met"
            verdicts.insert(
                0,
                f"calculator: async not slower than sync: {met} ({speedup:.2f}x; spread {spread:.0f} steps/h)",
            )
        else:
            met = "met" if speedup >= SPEEDUP_TARGET else "NOT met"
            verdicts.insert(0, f"steps per hour >= {SPEEDUP_TARGET}x sync: {met} ({speedup:.2f}x)")
    for verdict in verdicts:
        print(f"  target: {verdict}")


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--task",
        choices=("both", "slow-tools", "calculator"),
        default="both",
        help="both: slow tools over --seeds, then the calculator check over --calculator-seeds",
    )
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--calculator-seeds", default="0,1,2", help="the calculator check's seeds (with --task both)"
    )
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--val-tasks", type=int, default=48, help="held-out problems (slow tools; 0: none)")
    p.add_argument("--median", type=float, default=0.5, help="median tool latency, seconds")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--importance", choices=("token", "sequence", "off"), default="token")
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="as the demo (memory)")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--quick", action="store_true", help="2 updates, 1 seed, 2 x 4 rollouts, 16 held-out")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # MODE:SEED:OUT, a child process's run
    return p


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def run_task(args: argparse.Namespace, task: str, seeds: list[int], val_tasks: int) -> list[dict[str, Any]]:
    """Every (mode, seed) of one task, each in its own process, modes alternating by seed."""
    modes = [m for m in args.modes.split(",") if m]
    runs: list[dict[str, Any]] = []
    # the same options; the child runs one (task, mode, seed) and writes it to a file
    child = [*sys.argv[1:], "--task", task, "--val-tasks", str(val_tasks)]
    if args.quick:
        child.remove("--quick")  # the child gets the quick settings spelled out
        child += ["--updates", str(args.updates), "--tasks-per-step", str(args.tasks_per_step)]
        child += ["--group-size", str(args.group_size)]
    for i, seed in enumerate(seeds):
        for mode in modes if i % 2 == 0 else list(reversed(modes)):
            out = Path(tempfile.mkstemp(prefix="grpo-async-", suffix=".json")[1])
            cmd = [sys.executable, __file__, *child, "--one", f"{mode}:{seed}:{out}"]
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                print(f"  {task} {mode} seed {seed}: failed (exit {done.returncode})", flush=True)
                continue
            runs.append(json.loads(out.read_text()))
            print_run(runs[-1])
    return runs


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.updates, args.tasks_per_step, args.group_size = 2, 2, 4
        args.seeds, args.calculator_seeds, args.val_tasks = "0", "0", 16
    if args.one:
        mode, seed, out = args.one.split(":", 2)
        Path(out).write_text(json.dumps(run_one(args, mode, int(seed))))
        return
    plan: list[tuple[str, list[int], int]] = []
    if args.task in ("both", "slow-tools"):
        plan.append(("slow-tools", _seeds(args.seeds), args.val_tasks))
    if args.task == "both" and _seeds(args.calculator_seeds):
        plan.append(("calculator", _seeds(args.calculator_seeds), 0))  # speed only
    if args.task == "calculator":
        plan.append(("calculator", _seeds(args.seeds), args.val_tasks))
    print(
        f"GRPO sync vs async on SmolLM2: {args.updates} updates of {args.tasks_per_step} x"
        f" {args.group_size} rollouts, max_staleness {args.max_staleness}, importance {args.importance},"
        f" {'bfloat16' if _bf16() else 'float32'} training and serving; "
        + "; ".join(
            f"{task} seeds {seeds}"
            + (
                f" (tool latency lognormal, median {args.median} s, sigma {SIGMA:.2f})"
                if task == "slow-tools"
                else ""
            )
            + (f", {val} held-out tasks" if val else ", no held-out set")
            for task, seeds, val in plan
        ),
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for task, seeds, val in plan:
        runs += run_task(args, task, seeds, val)
    for task, _, _ in plan:
        report([r for r in runs if r.get("task") == task], task)
    print(f"\nthe whole benchmark took {(time.perf_counter() - t0) / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
        print(f"runs written to {args.json}")


if __name__ == "__main__":
    main()
