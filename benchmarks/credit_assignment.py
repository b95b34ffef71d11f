"""Credit assignment side by side: GRPO on the multi-turn ``chain`` task with each advantage mode.

Every mode gets the same budget: the same steps, tasks per step, group size, completion length,
learning rate and seeds (the seed picks the training tasks of each step, so mode ``rollout``
and mode ``turn`` of seed 1 see the same problems). The untrained policy is validated once per
seed (it is the same model for every mode). Prints, per mode, held-out success after training
(sampled at temperature 1 and greedy), mean and spread over the seeds, the change from the
untrained model, and the trained tokens; writes a plot of held-out success per mode and seed
and of the mean training success per step.

    python benchmarks/credit_assignment.py [--steps 6] [--seeds 0,1,2] [--modes rollout,turn,gigpo]
        [--task chain] [--val-tasks 96] [--plot docs/img/credit_assignment.png] [--json runs.json]
    python benchmarks/credit_assignment.py --report runs.json   # the table and plot again

One run (a mode and a seed, 6 steps, both validations) takes 6-14 minutes on 2 CPU cores.
Figures vary from run to run: compare modes within one run. Memory: the process holds about
11 GB while a run trains (seen with ``ps``; most likely the update's full-vocabulary logits over
4,096-token micro-batches and their float copies), so do not run it beside other large jobs on a
24 GB machine; ``--seeds 1 --json s1.json`` runs one seed, and ``--report`` joins such files.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench_util import grpo_on_task


def train(
    task_name: str, mode: str, seed: int, steps: int, val_tasks: int, validate_before: bool
) -> dict[str, Any]:
    from agentbolt.tasks import TASKS

    task = TASKS[task_name]
    result, run_dir, seconds = grpo_on_task(
        task,
        f"bench-credit-{mode}-s{seed}-",
        task.train_tasks(256, seed=1),
        task.heldout_tasks(val_tasks, seed=2),
        steps=steps,
        seed=seed,
        advantage=mode,
        asynchronous=False,  # on-policy, as docs/training.md's figures were measured: only the credit differs
        validate_before=validate_before,
    )
    steps_ = [h for h in result.history if h.get("step", 0) > 0]
    return {
        "mode": mode,
        "seed": seed,
        "before": result.val_before,
        "greedy_before": result.val_greedy_before,
        "after": result.val_after,
        "greedy_after": result.val_greedy_after,
        "train_success": [h["success"] for h in steps_],
        "train_tokens": sum(h.get("train_tokens", 0.0) for h in steps_),
        "seconds": seconds,
        "run_dir": str(run_dir),
    }


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    if len(values) == 1:
        return f"{mean:.0%}"
    return f"{mean:.0%} ± {statistics.stdev(values):.0%} ({min(values):.0%}-{max(values):.0%})"


def report(runs: list[dict[str, Any]], modes: list[str]) -> None:
    befores = [r["before"] for r in runs if r["before"] is not None]
    greedy_befores = [r["greedy_before"] for r in runs if r["greedy_before"] is not None]
    print(f"\nuntrained: sampled {_spread(befores)}, greedy {_spread(greedy_befores)}")
    header = (
        f"{'mode':8} | {'held-out sampled after':28} | {'held-out greedy after':28} | change | tokens | s/run"
    )
    print(header)
    print("-" * len(header))
    base = statistics.mean(befores) if befores else 0.0
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        after = [r["after"] for r in mine if r["after"] is not None]
        greedy = [r["greedy_after"] for r in mine if r["greedy_after"] is not None]
        change = 100 * (statistics.mean(after) - base) if after else float("nan")
        tokens = statistics.mean(r["train_tokens"] for r in mine)
        seconds = statistics.mean(r["seconds"] for r in mine)
        print(
            f"{mode:8} | {_spread(after):28} | {_spread(greedy):28} | {change:+5.0f} | {tokens:6.0f} | {seconds:5.0f}"
        )


def plot(runs: list[dict[str, Any]], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    befores = [r["before"] for r in runs if r["before"] is not None]
    if befores:
        left.axhline(statistics.mean(befores), color="grey", ls=":", label="untrained (sampled)")
    for i, mode in enumerate(modes):
        mine = [r for r in runs if r["mode"] == mode]
        for key, marker, dx in (("after", "o", -0.12), ("greedy_after", "^", 0.12)):
            values = [r[key] for r in mine if r[key] is not None]
            left.scatter([i + dx] * len(values), values, marker=marker, color=f"C{i}", alpha=0.8)
            if values:
                left.hlines(statistics.mean(values), i + dx - 0.1, i + dx + 0.1, color=f"C{i}", lw=2.5)
        curves = [r["train_success"] for r in mine if r["train_success"]]
        if curves:
            n = min(len(c) for c in curves)
            mean = [statistics.mean(c[s] for c in curves) for s in range(n)]
            right.plot(range(1, n + 1), mean, "o-", color=f"C{i}", label=mode)
    left.set_xticks(range(len(modes)), modes)
    left.set_ylim(-0.02, 1.02)
    left.set_ylabel("held-out success after training")
    left.set_title("per seed: o sampled, ^ greedy; bar = mean")
    left.legend(loc="lower right")
    right.set_xlabel("step")
    right.set_ylabel("training success (mean over seeds)")
    right.set_ylim(-0.02, 1.02)
    right.legend(loc="lower right")
    right.grid(alpha=0.3)
    fig.suptitle("GRPO credit assignment on the chain task, equal budget")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="chain")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="rollout,turn,gigpo")
    parser.add_argument("--val-tasks", type=int, default=96)
    parser.add_argument("--plot", type=Path, default=Path("docs/img/credit_assignment.png"))
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="print the table and plot of runs saved with --json; train nothing",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.report:
        runs = [r for path in str(args.report).split(",") for r in json.loads(Path(path).read_text())]
        seeds_done = sorted({r["seed"] for r in runs})
        print(
            f"{len(runs)} runs from {args.report}, seeds {seeds_done}, {len(runs[0]['train_success'])} steps each"
        )
        report(runs, modes)
        plot(runs, modes, args.plot)
        return
    unknown = set(modes) - {"rollout", "turn", "gigpo"}
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))} (choose rollout, turn, gigpo)")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"task {args.task}, {args.steps} steps x 4 tasks x 8 rollouts per run, seeds {seeds}, modes {modes}"
    )
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for i, mode in enumerate(modes):
            run = train(args.task, mode, seed, args.steps, args.val_tasks, validate_before=i == 0)
            runs.append(run)
            greedy = f"{run['greedy_after']:.0%}" if run["greedy_after"] is not None else "-"
            print(
                f"  {mode:8} seed {seed}: held-out after {run['after']:.0%} sampled, {greedy} greedy; "
                f"{run['seconds']:.0f} s ({run['run_dir']})",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(runs, indent=1))
    report(runs, modes)
    plot(runs, modes, args.plot)


if __name__ == "__main__":
    main()
