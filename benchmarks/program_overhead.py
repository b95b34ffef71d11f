"""What running an agent as a program costs per rollout, over running it in the runner's process.

For each program (``true``, and a Python script that does nothing) and each concurrency:

* in-process: a Runner runs an async agent that returns a reward at once;
* program: a Runner runs ``Program(command, reward_later=True)`` (the reward path still reads
  the attempt's events back from the server, as it does for every program);
* bare: the command alone, started and waited for the same number of times at the same
  concurrency (its own start-up, which no runner can avoid).

The overhead is ``program - in-process - bare``, in ms per rollout (wall time / rollouts, the
end taken from the last rollout's ``ended_at``); each figure is the best of ``--repeats``
runs (on a shared machine the least disturbed one), the three measured one after another.
``cpu+`` is what load cannot blur: the CPU time this process (server and runner, not the
children) spends per rollout on the program path over the in-process path. The server is a ServerThread in this process
(SQLite file), as in the tests. The machine's load average is printed with the figures: on a
shared machine, compare runs made at the same load.

    python benchmarks/program_overhead.py [--rollouts 100 --concurrency 1 16 --repeats 5]

With ``--sandbox``, it measures instead what the sandbox adds (``Program(sandbox=True)``, with its
default limits, docs/agents.md): rounds of ``true`` run plainly and sandboxed, one after the
other, and the median over the rounds of each and of the difference, in ms per rollout.

    python benchmarks/program_overhead.py --sandbox [--rollouts 100 --concurrency 1 --repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentbolt.client import Client
from agentbolt.runner.agent import rollout
from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread


@rollout
async def instant(task: Task) -> float:
    return 1.0


def _per_rollout(url: str, agent: object, rollouts: int, concurrency: int) -> tuple[float, float]:
    """Seconds of wall time and of this process's CPU time per rollout, for a fresh batch run
    by one Runner."""
    with Client(url) as client:
        ids = [
            r.id for r in client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(rollouts)])
        ]
        runner = Runner(agent, url, concurrency=concurrency, max_rollouts=rollouts, poll_wait=0.2)
        started, cpu = time.time(), time.process_time()
        runner.run_sync()  # as `agentbolt runner` runs it (signals, the child watcher it installs)
        done = client.wait(ids, 30)
        assert done.done, "rollouts left unfinished"
        failed = [r for r in done.rollouts if r.status != RolloutStatus.SUCCEEDED]
        assert not failed, f"{len(failed)} failed, e.g. {failed[0].error}"
        cpu = time.process_time() - cpu
        return (max(r.ended_at or 0.0 for r in done.rollouts) - started) / rollouts, cpu / rollouts


async def _bare(argv: list[str], runs: int, concurrency: int) -> float:
    """Seconds per run of the command alone, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def once() -> None:
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
            await proc.wait()

    started = time.perf_counter()
    await asyncio.gather(*(once() for _ in range(runs)))
    return (time.perf_counter() - started) / runs


def _best(url: str, argv: list[str], rollouts: int, concurrency: int, repeats: int) -> list[float]:
    """Best seconds per rollout of ``repeats`` runs: in-process, program, the bare command
    (wall), and the in-process and program CPU times."""
    runs = []
    for _ in range(repeats):
        inproc, inproc_cpu = _per_rollout(url, instant, rollouts, concurrency)
        program, program_cpu = _per_rollout(url, Program(argv, reward_later=True), rollouts, concurrency)
        bare = asyncio.run(_bare(argv, rollouts, concurrency))
        runs.append((inproc, program, bare, inproc_cpu, program_cpu))
    return [min(column) for column in zip(*runs, strict=True)]


def _sandbox_cost(url: str, rollouts: int, concurrency: int, repeats: int) -> None:
    """Median seconds per rollout of ``true`` plain and sandboxed, and of the difference, over
    ``repeats`` rounds (each round runs both, alternating which goes first)."""
    plain, boxed = Program(["true"], reward_later=True), Program(["true"], reward_later=True, sandbox=True)
    boxed.preflight()
    rows = []
    for round_ in range(repeats):
        order = (plain, boxed) if round_ % 2 == 0 else (boxed, plain)
        seconds = {id(agent): _per_rollout(url, agent, rollouts, concurrency)[0] for agent in order}
        rows.append((seconds[id(plain)], seconds[id(boxed)]))
    median = [statistics.median(column) * 1e3 for column in zip(*rows, strict=True)]
    added = statistics.median(b - p for p, b in rows) * 1e3
    print(f"{'C':>4}{'plain':>10}{'sandboxed':>11}{'added':>8}  (ms/rollout, median of {repeats} rounds)")
    print(f"{concurrency:>4}{median[0]:>10.2f}{median[1]:>11.2f}{added:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sandbox", action="store_true", help="what the sandbox adds to `true`")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentbolt-bench-"))
    if args.sandbox:
        print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        with ServerThread(ServerConfig(db=str(work / "bench.db"))) as srv:
            for concurrency in args.concurrency:
                _sandbox_cost(srv.url, args.rollouts, concurrency, args.repeats)
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
        return
    script = work / "nothing.py"
    script.write_text("")
    programs = {"true": ["true"], "python script": [sys.executable, str(script)]}
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(
        f"{'program':<14}{'C':>4}{'in-process':>12}{'program':>10}{'bare':>8}{'overhead':>10}{'cpu+':>8}"
        "  (ms/rollout)"
    )
    with ServerThread(ServerConfig(db=str(work / "bench.db"))) as srv:
        for concurrency in args.concurrency:
            for name, argv in programs.items():
                inproc, program, bare, inproc_cpu, program_cpu = _best(
                    srv.url, argv, args.rollouts, concurrency, args.repeats
                )
                overhead = program - inproc - bare
                print(
                    f"{name:<14}{concurrency:>4}{inproc * 1e3:>12.2f}{program * 1e3:>10.2f}"
                    f"{bare * 1e3:>8.2f}{overhead * 1e3:>10.2f}{(program_cpu - inproc_cpu) * 1e3:>8.2f}"
                )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
