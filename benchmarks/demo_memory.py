"""Where ``agentbolt demo``'s memory goes: the whole demo, traced, once per setting of oneDNN's
primitive cache, the settings alternated in fresh processes.

Each run is ``agentbolt demo`` (with the arguments after ``--``) in a process of its own, with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` set to one of ``--kernel-cache`` (``agentbolt demo`` leaves a
setting it finds alone; 256 is what it sets otherwise, 1024 is oneDNN's own default). A thread
in that process samples every 0.25 s:

- the PSS of the demo's process (trainer, engine, server) and of its whole tree (runners too);
- every 8th sample, the process's mappings by kind: the ``[heap]``, anonymous mappings under
  1 MB (where oneDNN's compiled kernels land, among others), anonymous mappings of 1-64 MB and
  over 64 MB (tensors, glibc's thread heaps), and files;
- whether a GRPO update is running, and the rows in the engine's batch.

It prints per run the tree's peak (the figure ``agentbolt demo`` prints), the process's share
and the mappings at that moment, the growth of the small mappings from the first trace point
to the last, held-out success before and after, and the demo's seconds; then a plot of PSS over
time for every run (``--plot``). Nothing else may run on the machine meanwhile: the demo's
peak moves with how rollouts and updates overlap.

    python benchmarks/demo_memory.py [--kernel-cache 1024,256] [--runs 1] [--plot demo_memory.png] [-- --steps 8]

The module imports only the standard library at the top: the demo's runner processes start from
a forkserver that imports ``__main__`` (this file), and should hold what they hold under
``agentbolt demo``, not a copy of PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

SAMPLE_S = 0.25
MAPPINGS_EVERY = 8
_MB = 2**20


def mappings(pid: int) -> dict[str, float]:
    """PSS in MB of a process's mappings by kind (from /proc/<pid>/smaps)."""
    kinds: Counter[str] = Counter()
    kind = "file"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                parts = line.split()
                name = parts[5] if len(parts) > 5 else ""
                lo, hi = (int(x, 16) for x in head.split("-"))
                if name.startswith("/"):
                    kind = "file"
                elif name:
                    kind = name  # [heap], [stack], ...
                else:
                    size = hi - lo
                    kind = "anon <1MB" if size <= _MB else "anon 1-64MB" if size < 64 * _MB else "anon >=64MB"
            elif head == "Pss:":
                kinds[kind] += int(line.split()[1]) * 1024
    return {k: round(v / 1e6, 1) for k, v in kinds.items() if v >= 1e6}


def child(out: Path, demo_args: list[str]) -> None:
    """One traced demo in this process; the trace goes to ``out`` (JSON) when it ends."""
    from agentbolt.algorithms import grpo
    from agentbolt.cli.main import app
    from agentbolt.engine import batcher
    from agentbolt.memory import descendants, pss_bytes

    state = {"update": False, "rows": 0}
    step, update = batcher.Batcher._step, grpo.GRPO._update

    def traced_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        finally:
            state["rows"] = len(self._running)

    def traced_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        state["update"] = True
        try:
            return update(self, *args, **kwargs)
        finally:
            state["update"] = False

    batcher.Batcher._step = traced_step  # type: ignore[method-assign]
    grpo.GRPO._update = traced_update  # type: ignore[method-assign]
    trace: list[dict[str, Any]] = []
    peak: dict[str, Any] = {"tree": 0.0}
    stop = threading.Event()

    def sample() -> None:
        me, started = os.getpid(), time.monotonic()
        while not stop.wait(SAMPLE_S):
            own = pss_bytes(me)  # walked once: the tree adds the runners' to it
            if own is None:
                continue
            tree = own + sum(pss_bytes(c) or 0 for c in descendants(me))
            point: dict[str, Any] = {
                "t": round(time.monotonic() - started, 2),
                "own": round(own / 1e6, 1),
                "tree": round(tree / 1e6, 1),
                "update": state["update"],
                "rows": state["rows"],
            }
            if len(trace) % MAPPINGS_EVERY == 0:
                point["mappings"] = mappings(me)
            trace.append(point)
            if point["tree"] > peak["tree"]:
                peak.clear()
                peak.update(point, mappings=point.get("mappings") or mappings(me))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        app(["demo", *demo_args], standalone_mode=False)
    finally:
        stop.set()
        thread.join()
        out.write_text(json.dumps({"peak": peak, "trace": trace}))


def run_one(capacity: str, demo_args: list[str], folder: Path, index: int) -> dict[str, Any]:
    out = folder / f"run{index}-{capacity}.json"
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity, "COLUMNS": "200"}
    env.pop("DNNL_PRIMITIVE_CACHE_CAPACITY", None)
    cmd = [sys.executable, __file__, "--child", str(out), "--", *demo_args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the demo (kernel cache {capacity}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["capacity"] = capacity
    result["summary"] = [
        line.strip() for line in done.stdout.splitlines() if line.startswith(("change:", "peak memory:"))
    ]
    result["held_out"] = [
        " ".join(cell.strip() for cell in line.strip("│ ").split("│"))
        for line in done.stdout.splitlines()
        if line.startswith("│ untrained") or line.startswith("│ after")
    ]
    return result


def report(result: dict[str, Any]) -> None:
    peak, trace = result["peak"], result["trace"]
    marks = [p["mappings"] for p in trace if "mappings" in p]
    small = [m.get("anon <1MB", 0.0) for m in marks]
    print(
        f"kernel cache {result['capacity']:>5}: peak {peak['tree'] / 1000:.2f} GB whole tree "
        f"(the demo's process {peak['own'] / 1000:.2f} GB) at {peak['t']:.0f} s, "
        f"{'during' if peak['update'] else 'outside'} an update, {peak['rows']} rows in the engine",
        flush=True,
    )
    print("   at the peak, MB: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(peak["mappings"].items())))
    if small:
        print(
            f"   anonymous mappings under 1 MB: {small[0]:.0f} MB at the first trace point, {small[-1]:.0f} MB at the last"
        )
    for line in result["held_out"] + result["summary"]:
        print(f"   {line}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, result in enumerate(results):
        trace = result["trace"]
        t = [p["t"] for p in trace]
        line = ax.plot(
            t,
            [p["tree"] / 1000 for p in trace],
            lw=1.2,
            label=f"run {i + 1}: kernel cache {result['capacity']}",
        )
        busy = [p["tree"] / 1000 if p["update"] else None for p in trace]
        ax.plot(t, busy, lw=4, alpha=0.5, color=line[0].get_color())
    ax.axhline(2.5, color="grey", ls="--", lw=1, label="2.5 GB target")
    ax.set_xlabel("seconds into the demo")
    ax.set_ylabel("PSS, whole process tree (GB)")
    ax.set_title("agentbolt demo: memory over time (thick: a GRPO update running)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    argv = sys.argv[1:]
    demo_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernel-cache", default="1024,256", help="ONEDNN_PRIMITIVE_CACHE_CAPACITY values, alternated"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each setting")
    parser.add_argument("--plot", type=Path, default=Path("demo_memory.png"))
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, demo_args)
        return
    if not Path("/proc/self/smaps").exists():
        sys.exit("needs Linux /proc/<pid>/smaps")
    capacities = [c.strip() for c in args.kernel_cache.split(",") if c.strip()]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            order = capacities if r % 2 == 0 else capacities[::-1]
            for capacity in order:
                results.append(run_one(capacity, demo_args, Path(tmp), len(results)))
                report(results[-1])
    plot(results, args.plot)


if __name__ == "__main__":
    main()
