"""One benchmark, two versions of the code, interleaved rounds: the medians side by side.

Runs ``COMMAND`` once per round against each source tree (``--before`` and ``--after``, e.g. a
``git worktree`` of an older commit and this checkout), alternating, with the tree first on
``PYTHONPATH`` (and its ``benchmarks/`` folder, for the shared helpers). Each figure a pattern
names is read from the command's output; the table gives each side's median and the ratio.
Alternating rounds spread a machine's drift over both sides; the median drops a round that a
neighbour disturbed. Take figures on a quiet machine all the same.

    python benchmarks/ab_rounds.py --before /work/ab-before --rounds 5 -- \\
        python benchmarks/store_throughput.py -R 5000

``{tree}`` in the command stands for each side's tree: ``{tree}/benchmarks/gateway_overhead.py``
runs each side's own copy of a benchmark whose options changed between the two.

The default patterns read ``store_throughput.py``'s and ``gateway_overhead.py``'s summary
lines; ``--figure NAME=REGEX`` (repeatable; the first group is the number) reads others.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_FIGURES = {
    "rollouts/s": r"([\d.]+) rollouts/s",
    "server CPU ms/rollout": r"servers ([\d.]+) ms",
    "client CPU ms/rollout": r"client ([\d.]+) ms",
    "gateway calls/s": r"gateway\s+([\d.]+) calls/s",
    "gateway CPU ms/call": r"gateway CPU per call \(server process, user\+sys / calls\): ([\d.]+) ms",
}


def run_once(tree: Path, command: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "benchmarks")])}
    command = [part.replace("{tree}", str(tree)) for part in command]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} failed in {tree} (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    return done.stdout + done.stderr


def figures(text: str, patterns: dict[str, str]) -> dict[str, float]:
    found = {}
    for name, pattern in patterns.items():
        match = re.search(pattern, text)
        if match is not None:
            found[name] = float(match.group(1))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the older source tree")
    ap.add_argument("--after", type=Path, default=Path(__file__).parents[1], help="default: this checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    ap.add_argument("--figure", action="append", default=[], metavar="NAME=REGEX")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark, after --")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark command after --")
    for tree in (args.before, args.after):
        if not (tree / "agentbolt").is_dir():
            ap.error(f"{tree} holds no agentbolt package")
    patterns = dict(DEFAULT_FIGURES)
    for item in args.figure:
        name, sep, pattern = item.partition("=")
        if not sep:
            ap.error(f"--figure {item!r}: expected NAME=REGEX")
        patterns[name] = pattern
    sides = {"before": args.before, "after": args.after}
    seen: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for number in range(1, args.rounds + 1):
        for side, tree in sides.items():
            got = figures(run_once(tree, command, args.timeout), patterns)
            for name, value in got.items():
                seen[side].setdefault(name, []).append(value)
            shown = ", ".join(f"{name} {value:g}" for name, value in got.items())
            print(f"round {number} {side:6s} {shown}", flush=True)
    print(f"\nmedians of {args.rounds} interleaved rounds ({' '.join(command)})")
    print(f"{'figure':28s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for name in patterns:
        before, after = seen["before"].get(name), seen["after"].get(name)
        if not before or not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        print(f"{name:28s} {b:10.3f} {a:10.3f} {a / b:12.3f}x")


if __name__ == "__main__":
    sys.exit(main())
