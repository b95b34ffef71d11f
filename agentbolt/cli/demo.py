"""The main job: ``agentbolt demo`` trains SmolLM2-135M-Instruct with GRPO on a built-in task.

The default task, ``calculator``, is the quick one (a few minutes): the model must call a
calculator tool and then answer. ``--task chain`` is the multi-turn one: three operations, one
tool call each, the results carried from turn to turn, a step reward per correct call; it is
where per-turn credit assignment (``--advantage turn`` or ``gigpo``) has something to work on.
Tasks, rewards and the train / held-out split live in :mod:`agentbolt.tasks`; ``--task`` also
takes a spec of an environment another project wrote (``reasoning_gym:<dataset>?...``,
``gymnasium:<env id>?...``: :mod:`agentbolt.tasks.external`), trained 30 steps by default.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.table import Table

from agentbolt.extras import needs_extra
from agentbolt.schemas import PromptTemplate

if TYPE_CHECKING:
    from agentbolt.algorithms.credit import AdvantageMode

__all__ = ["demo_command"]

_DEFAULT_STEPS = {"calculator": 8, "chain": 5, "guess": 30}
# chain: five steps and 48 held-out tasks keep the run, both evaluations included, within
# 15 minutes on a 2-core machine (docs/training.md); its gain comes in the first steps
_DEFAULT_VAL_TASKS = {"chain": 48}


@needs_extra("agentbolt demo", "server", "train")
def demo_command(
    task: Annotated[
        str,
        typer.Option(
            help="Built-in task: calculator (quick), chain (multi-turn), guess; or a task spec: "
            "'reasoning_gym:<dataset>?option=value&...', 'gymnasium:<env id>?...' (docs/training.md)."
        ),
    ] = ("calculator"),
    steps: Annotated[
        int | None,
        typer.Option(help="GRPO steps (default: 8 for calculator, 5 for chain, 30 for the others)."),
    ] = None,
    group_size: Annotated[int, typer.Option(help="Rollouts per task per step.")] = 8,
    tasks_per_step: Annotated[int, typer.Option(help="Tasks per step.")] = 4,
    val_tasks: Annotated[
        int | None,
        typer.Option(
            help="Held-out tasks for the before/after evaluation (default: 48 for chain, 96 for the others)."
        ),
    ] = None,
    advantage: Annotated[str, typer.Option(help="Credit assignment: rollout, turn or gigpo.")] = "rollout",
    model: Annotated[
        str, typer.Option(help="'smollm2' or a local Hugging Face model directory.")
    ] = "smollm2",
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 3e-4,
    seed: Annotated[int, typer.Option(help="Seed of the task sampling and the training.")] = 0,
    run_dir: Annotated[Path | None, typer.Option(help="Where metrics, checkpoints and the plot go.")] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the checkpoint in --run-dir (which must be given).")
    ] = False,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-n", help="Rollouts in flight (the engine batches them).")
    ] = 32,
) -> None:
    """Train SmolLM2-135M with GRPO on a built-in task; prints held-out success before and after."""
    from agentbolt.tasks import get_task

    try:
        get_task(task)  # a spec's options and its package, checked before any work
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from None
    if advantage not in ("rollout", "turn", "gigpo"):
        raise typer.BadParameter(f"{advantage!r}: choose rollout, turn or gigpo", param_hint="--advantage")
    if resume and run_dir is None:
        raise typer.BadParameter(
            "--resume continues a run: give its folder with --run-dir", param_hint="--resume"
        )
    if resume and run_dir is not None and not (run_dir / "checkpoint" / "state.json").exists():
        raise typer.BadParameter(f"no checkpoint to resume in {run_dir}", param_hint="--run-dir")
    _run(
        task,
        steps or _DEFAULT_STEPS.get(task, 30),
        model,
        lr,
        seed,
        run_dir,
        resume,
        concurrency,
        group_size=group_size,
        tasks_per_step=tasks_per_step,
        val_tasks=val_tasks if val_tasks is not None else _DEFAULT_VAL_TASKS.get(task, 96),
        advantage=advantage,
    )


def _run(
    name: str,
    steps: int,
    model: str,
    lr: float,
    seed: int,
    run_dir: Path | None,
    resume: bool,
    concurrency: int,
    *,
    group_size: int,
    tasks_per_step: int,
    val_tasks: int,
    advantage: str,
) -> None:
    from agentbolt.memory import PeakMemory, bound_kernel_cache, map_large_blocks

    # before any product: oneDNN reads it once (memory.bound_kernel_cache: the demo's figures there)
    bound_kernel_cache()
    import torch

    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.algorithms.train_state import fast_bf16
    from agentbolt.console import make_console, print_line
    from agentbolt.engine.matmul import keep_plain_weights
    from agentbolt.tasks import get_task
    from agentbolt.trainer import Trainer

    task = get_task(name)
    console = make_console()
    folder = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)  # a task spec holds : ? & =
    run_dir = run_dir or Path("runs") / f"demo-{folder}-{time.strftime('%Y%m%d-%H%M%S')}"
    # bfloat16 only where the hardware has it: emulated on an AVX2-only CPU, its matrix products
    # run 6-8x slower than float32 (train_state.fast_bf16)
    bf16 = fast_bf16("cuda" if torch.cuda.is_available() else "cpu")
    algo = GRPO(
        model=model,
        steps=steps,
        group_size=group_size,
        tasks_per_step=tasks_per_step,
        lr=lr,
        seed=seed,
        advantage=cast("AdvantageMode", advantage),  # checked by demo_command
        resume=resume,
        val_every=0 if name == "calculator" else 10,
        checkpoint_every=max(1, steps // 2) if name == "calculator" else 5,
        bf16=bf16,
        low_memory=True,  # the updates' large blocks mapped: the demo's peak is a target (README)
        # bfloat16 weights in the engine in any case: without native bfloat16 it computes their
        # products in float32 (EngineConfig.cpu_matmul), near float32's speed at half the memory
        engine_dtype="bfloat16",
    )
    trainer = Trainer(
        algo,
        n_runners=1,
        runner_concurrency=concurrency,
        run_dir=run_dir,
        console=console,
        resources={"system_prompt": PromptTemplate(template=task.system_prompt, engine="plain")},
    )
    # Said first: the untrained model's validation comes before the first step's line.
    print_line(
        console,
        f"agentbolt demo: GRPO on {model}, {steps} steps of {tasks_per_step} tasks x {group_size} rollouts; "
        f"task {name}: {task.summary}; advantage {advantage}; held-out success on {val_tasks} tasks "
        f"before and after; {'bfloat16' if bf16 else 'float32 (no native bfloat16 here)'}; run folder {run_dir}",
    )
    # The embedded engine keeps its linear weights only in packed form (matmul.PackedMatmul,
    # release_plain; on CPUs with bfloat16 units): nothing in the demo reads them otherwise.
    # Peak memory of `agentbolt demo --steps 3 --val-tasks 8` (whole tree, PSS, 2-core
    # AVX512-BF16 machine): 2.41 GB with the plain copies kept, 2.13 GB without.
    keep_plain_weights(False)
    # Blocks of 1 MB or more mapped on their own for the whole run (memory.map_large_blocks):
    # `agentbolt demo --steps 2 --val-tasks 96`, peak 2.46 GB without, 2.14 GB with (tree PSS;
    # 253 s against 157 s, on a machine shared with other jobs, part of it with tests beside it).
    # With both, three full `agentbolt demo` runs peaked at 2.31, 2.41 and 2.62 GB (during an
    # update; 2.86 GB before them), held-out success sampled 51-59% -> 97-99%, greedy 91-93% -> 100%.
    map_large_blocks()
    t0 = time.perf_counter()
    try:
        with PeakMemory() as peak:
            result = trainer.fit(
                task.agent(), task.train_tasks(256, seed=1), task.heldout_tasks(val_tasks, seed=2)
            )
    finally:
        keep_plain_weights(True)
    console.print()  # the live training display ends without a line break
    _report(console, result, name, steps, val_tasks, time.perf_counter() - t0)
    console.print(_memory_line(peak))
    console.print(f"plot: {result.plot}   metrics: {result.metrics_file}   run: {run_dir}")


def _memory_line(peak: Any) -> str:
    """The demo's peak memory, all its processes (engine, trainer, runners) counted."""
    if peak.peak_gb is None:
        return "peak memory: not measured (needs Linux /proc/<pid>/smaps_rollup)"
    return (
        f"peak memory: {peak.peak_gb:.2f} GB (whole process tree; PSS, so pages the processes "
        f"share are counted once; sampled every {peak.interval:g} s)"
    )


def _report(console: Console, result: Any, name: str, steps: int, val_tasks: int, seconds: float) -> None:
    """Held-out success before and after training, sampled and greedy, and the change."""
    table = Table(title=f"held-out success, task {name} ({val_tasks} tasks never trained on; strict format)")
    table.add_column("model")
    table.add_column("sampled (temperature 1)", justify="right")
    table.add_column("greedy (temperature 0)", justify="right")

    def pct(value: float | None) -> str:
        return f"{value:.0%}" if value is not None else "-"

    table.add_row("untrained SmolLM2-135M-Instruct", pct(result.val_before), pct(result.val_greedy_before))
    table.add_row(f"after {steps} GRPO steps", pct(result.val_after), pct(result.val_greedy_after))
    console.print(table)
    before, after = result.val_before or 0.0, result.val_after or 0.0
    change = f"change: {100 * (after - before):+.0f} percentage points sampled"
    if result.val_greedy_before is not None and result.val_greedy_after is not None:
        change += f", {100 * (result.val_greedy_after - result.val_greedy_before):+.0f} greedy"
    console.print(f"{change}, in {seconds:.0f} s")
