"""Prompt optimization offline, side by side with DSPy: held-out success of the seed prompt and
of the optimized one, with the bundled model as the agent's model and no other model anywhere.

Per task spec and seed, both sides get the same tasks, the same scorer (the dataset's own) and
the same rollout budget (every model-backed run of a task counts one, bootstrapping and
validation included):

- **agentbolt**: ``APO(method="bootstrap")`` through a real server, runner and gateway, the
  task's own agent (its system prompt the seed); the seed's and the best prompt's held-out
  success measured after, sampled (temperature 1) and greedy.
- **DSPy** (``--dspy``, reasoning-gym specs and ``calculator``): ``benchmarks/apo_dspy_side.py``
  in the virtualenv ``benchmarks/dspy_env.sh`` makes (PyPI ``dspy``), its
  BootstrapFewShotWithRandomSearch on a ``question -> answer`` program (``dspy.ReAct`` with a
  calculator tool for ``calculator``), pointed at the same engine's OpenAI-compatible endpoint; its
  untrained program's held-out success is measured sampled only.

Tasks: ``--train`` training tasks then ``--val`` validation tasks from the spec's training draw
(one draw, cut in two), and ``--heldout`` held-out tasks (disjoint from training by content).
Beside a yes/no task's figures, the held-out success of always giving the likelier answer:
a prompt can reach that by shifting the answers' prior alone. One result file per task, seed and side in ``--results`` (a run already there is not run
again, so the table gathers over several sittings); ``--report`` prints the table from them.

    python benchmarks/apo_vs_dspy.py --tasks 'reasoning_gym:isomorphic_strings,calculator' --seeds 0,1,2
        [--budget 240] [--train 48] [--val 32] [--heldout 64] [--dspy]
    python benchmarks/apo_vs_dspy.py --report
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from external_tasks import constant_answer

HERE = Path(__file__).resolve().parent
DSPY_PYTHON = HERE.parent / ".venv-dspy" / "bin" / "python"


def result_path(results: Path, spec: str, seed: int, side: str) -> Path:
    digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
    name = "".join(c if c.isalnum() else "-" for c in spec)[:60]
    return results / f"{name}-{digest}-seed{seed}-{side}.json"


def draw(spec: str, seed: int, n_train: int, n_val: int, n_heldout: int) -> tuple[Any, list, list, list]:
    from agentbolt.tasks import get_task

    task = get_task(spec)
    pool = task.train_tasks(n_train + n_val, seed=100 + seed)
    return task, pool[:n_train], pool[n_train:], task.heldout_tasks(n_heldout, seed=2)


def success(values: list[float], n: int) -> float:
    return sum(v >= 1.0 for v in values) / n


def ours(spec: str, seed: int, args: argparse.Namespace, served: Any) -> dict[str, Any]:
    """APO's bootstrap method on ``spec``: held-out success of the seed and the best prompt."""
    from rich.console import Console

    from agentbolt import LLM, PromptTemplate, Trainer
    from agentbolt.algorithms.apo import APO
    from agentbolt.algorithms.base import run_sampled_and_greedy
    from agentbolt.client import Client
    from agentbolt.runner.worker import Runner
    from agentbolt.schemas import Mode
    from agentbolt.server import ServerConfig, ServerThread

    task, train, val, heldout = draw(spec, seed, args.train, args.val, args.heldout)
    log = io.StringIO()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="apo-bench-")))
        server = stack.enter_context(ServerThread(ServerConfig(db=str(tmp / "store.db"))))
        runner = Runner(task.agent(), server.url, concurrency=16, flush_interval=0.1)
        thread = threading.Thread(target=lambda: asyncio.run(runner.run()), daemon=True)
        thread.start()
        resources: dict[str, Any] = {
            "llm": LLM(base_url=served.base_url, model="smollm2"),
            "system_prompt": PromptTemplate(template=task.system_prompt, engine="plain"),
        }
        apo = APO(
            method="bootstrap",
            rollout_budget=args.budget,
            bootstrap_tasks=args.bootstrap_tasks,
            trials=args.trials,
            max_demos=args.max_demos,
            demos_as=args.demos_as,
            seed=seed,
            batch_timeout=3600.0,
        )
        t0 = time.perf_counter()
        result = Trainer(
            apo, server_url=server.url, resources=resources, n_runners=0, console=Console(file=log, width=200)
        ).fit(task.agent(), train, val)
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {
            "spec": spec,
            "seed": seed,
            "side": _side(args.demos_as),
            "constant": constant_answer([t.data.get("answer") for t in heldout]),
            "seconds": round(seconds, 1),
            "rollouts": result.stats.rollouts,
            "demos": result.stats.demos,
            "val_seed": result.seed_val,
            "val_best": result.best_val,
            "best_prompt": result.best_prompt,
            "best_turns": result.best_turns,
        }
        with Client(server.url) as client:
            for name, version in (("before", result.seed_version), ("after", result.published_version)):
                sampled, greedy = run_sampled_and_greedy(
                    client, heldout, mode=Mode.VAL, resources_version=version, greedy=True, timeout=3600
                )
                row[f"{name}_sampled"] = success(sampled.values, len(heldout))
                row[f"{name}_greedy"] = success(greedy.values if greedy else [], len(heldout))
        runner.stop()
        thread.join(30)
    return row


def _side(demos_as: str) -> str:
    """Our side's name: ``agentbolt`` with the examples as chat turns (the default), else
    ``agentbolt-text``."""
    return "agentbolt" if demos_as == "turns" else f"agentbolt-{demos_as}"


def dspy(spec: str, seed: int, args: argparse.Namespace, served: Any) -> dict[str, Any]:
    """The DSPy side, in its own virtualenv, on the same tasks, endpoint and budget."""
    if not DSPY_PYTHON.exists():
        raise SystemExit(f"no DSPy virtualenv at {DSPY_PYTHON}: run bash benchmarks/dspy_env.sh")
    _, train, val, heldout = draw(spec, seed, args.train, args.val, args.heldout)
    tasks_file = args.results / f"tasks-{seed}.json"
    tasks_file.write_text(
        json.dumps(
            {
                "spec": spec,
                "dataset": train[0].data.get("dataset"),
                "train": [t.data for t in train],
                "val": [t.data for t in val],
                "heldout": [t.data for t in heldout],
            }
        )
    )
    out = args.results / f"dspy-{seed}.json"
    command = [
        str(DSPY_PYTHON),
        str(HERE / "apo_dspy_side.py"),
        *("--tasks", str(tasks_file), "--base-url", served.base_url),
        *("--budget", str(args.budget), "--seed", str(seed), "--json", str(out)),
        *(("--max-tokens", "128") if spec == "calculator" else ()),  # room for ReAct's three fields
    ]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    got = json.loads(out.read_text())
    out.unlink()
    tasks_file.unlink()
    return {
        "spec": spec,
        "seed": seed,
        "side": "dspy",
        "seconds": got["wall_s"],
        "rollouts": got["rollouts"],
        "before_sampled": got["heldout_before"],
        "after_sampled": got["heldout_after_sampled"],
        "after_greedy": got["heldout_after_greedy"],
        "parse_failures": got["counts"]["optimization"]["parse_failures"],
        "dspy": got,
    }


@contextlib.contextmanager
def serving() -> Any:
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model

    engine = ModelEngine.from_pretrained(str(ensure_model("smollm2")))
    try:
        with EngineServer(engine) as served:
            yield served
    finally:
        engine.close()


def report(results: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(results.glob("*.json")) if "-seed" in p.name]
    print(
        f"{'task':<42} {'side':<15} {'seeds':>5} {'sampled before -> after':>26} {'greedy before -> after':>26} {'time':>8}"
    )
    for (spec, side), group in _groups(rows).items():

        def span(key: str, group: list[dict[str, Any]] = group) -> str:
            values = [r[key] * 100 for r in group if r.get(key) is not None]
            if not values:
                return "-"
            return f"{statistics.mean(values):.0f}% ({min(values):.0f}-{max(values):.0f})"

        seconds = statistics.mean(r["seconds"] for r in group)
        sampled = f"{span('before_sampled')} -> {span('after_sampled')}"
        greedy = f"{span('before_greedy')} -> {span('after_greedy')}"
        constants = [r["constant"] for r in group if r.get("constant") is not None]
        extra = f"  constant answer {statistics.mean(constants):.0%}" if constants else ""
        if side == "dspy":
            extra += f"  parse failures {sum(r.get('parse_failures', 0) for r in group)}"
        print(f"{spec:<42} {side:<15} {len(group):>5} {sampled:>26} {greedy:>26} {seconds:>7.0f}s{extra}")


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["spec"], row["side"]), []).append(row)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="reasoning_gym:isomorphic_strings", help="comma-separated specs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=240, help="rollouts per optimization, both sides")
    parser.add_argument("--train", type=int, default=48)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--bootstrap-tasks", type=int, default=32)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--max-demos", type=int, default=3)
    parser.add_argument(
        "--demos-as", choices=["turns", "text"], default="turns", help="how our examples reach the model"
    )
    parser.add_argument("--dspy", action="store_true", help="also run DSPy's side")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "apo")
    parser.add_argument("--report", action="store_true", help="only print the table from the result files")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(args.results)
        return
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sides = [(_side(args.demos_as), ours)] + ([("dspy", dspy)] if args.dspy else [])
    if args.dspy and any(
        not spec.startswith("reasoning_gym:") and spec != "calculator" for spec in args.tasks.split(",")
    ):
        raise SystemExit("--dspy: DSPy's side is written for reasoning-gym specs and the calculator only")
    with serving() as served:
        for spec in args.tasks.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for side, run in sides:
                    path = result_path(args.results, spec, seed, side)
                    if path.exists():
                        continue
                    row = run(spec, seed, args, served)
                    path.write_text(json.dumps(row, indent=1))
                    shown = {k: v for k, v in row.items() if k not in ("best_prompt", "best_turns")}
                    print(json.dumps(shown), flush=True)
    report(args.results)


if __name__ == "__main__":
    sys.exit(main())
