"""Many concurrent agents against one agentbolt deployment on this machine: what each part costs.

N simulated agents (``--agents``, default 1,000) run at once. Each rollout is ``--calls`` turns
(default 2); a turn is one model call through the gateway, then one tool call that sleeps
``--tool-latency`` seconds (default 5; each sleep drawn uniformly within +-``--jitter`` of it, so
the agents do not march in step). Everything is real except the model:

- the agentbolt server (``--replicas`` processes; SQLite, or PostgreSQL with ``--backend
  postgres``), configured as deployed: an admin token, workers registered with issued tokens;
- the runners: the real :class:`agentbolt.runner.worker.Runner`, ``--runner-procs`` processes
  with N/P asyncio slots each (1,000 Ray actors or processes do not fit in 2 cores), split over
  the replicas (runner i talks to replica i mod R: no load balancer in front);
- the agents: async ``@rollout`` functions calling the rollout's ``LLM`` resource as any agent
  does (``agentbolt.runner.llm.async_openai`` on the gateway URL and per-attempt agent key the
  claim carries, with the OpenAI client's default of 2 retries: ``--agent-retries``), recording
  each tool call (``emit_tool_call``);
- the model: the instant stub of ``benchmarks/gateway_overhead.py`` in its own process.

The driver (this process) keeps N + B rollouts in the system (N running, a backlog of B,
``--backlog``); the first N get a random fraction of their tool time, so that the claims spread
out at once. After ``--warmup`` seconds it measures for ``--duration`` seconds, then stops
enqueueing, lets every rollout finish, and checks the store: every rollout succeeded with
exactly one attempt, and the gateway recorded as many model calls as the agents made. Last, a
calibration phase sends model calls straight to one attempt's gateway (no agents running) to
split the server's CPU into gateway and store work.

Measured over the window, from ``/proc`` (user + system CPU per process, other load does not
count): the CPU of each server, the stub, each runner process, the driver and (PostgreSQL) our
backends and the database's background processes; rollouts/s and gateway calls/s (as the store
recorded them); claim latency (the runner's dequeue call, timed inside the runner) and queue
wait (enqueued -> claimed, from the store); server CPU per rollout; which process is nearest to
saturating a core, and the paper estimate for 10,000 agents from the per-rollout costs.

    python benchmarks/scale_sim.py                                   # 1,000 agents, 5 s tools, SQLite
    python benchmarks/scale_sim.py --backend postgres --replicas 2   # PostgreSQL, 2 server replicas
    python benchmarks/scale_sim.py --quick                           # a smoke run (about 40 s)

Use it on a quiet machine: every part shares its cores (the summary says how busy the machine
was with other work during the window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import os
import random
import re
import secrets
import shutil
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_util import cpu_seconds, pct, store_url
from gateway_overhead import _phase, _serve_upstream

from agentbolt.client import AsyncClient, Client
from agentbolt.console import make_console, print_line, task_bars
from agentbolt.runner.agent import emit_tool_call, rollout
from agentbolt.runner.llm import async_openai
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, Task
from agentbolt.server import ServerConfig
from agentbolt.server.run import ServerProcess, free_port, start_together, wait_healthy

SPAWN = multiprocessing.get_context("spawn")
TARGET_AGENTS = 10_000
SYSTEM = "You are a simulated agent. Think, call a tool, read its result, answer. " * 4
TOOL_RESULT = "result line of the simulated tool; " * 8

# ---------------------------------------------------------------------------- the agent (runner side)


@dataclass
class _AgentStats:
    """What the agents of one runner process did (module state: one runner per process)."""

    calls: int = 0
    model_calls: list[tuple[float, float]] = field(default_factory=list)  # (wall start, seconds)


_AGENT = _AgentStats()


@rollout
async def sim_agent(task: Task, llm: LLM) -> float:
    """``len(task.data["tools"])`` turns of: a model call through the gateway, then a tool that
    sleeps for the turn's seconds."""
    client = async_openai(llm, timeout=120, max_retries=task.data["retries"])
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Solve task {task.id} with the tool."},
    ]
    for seconds in task.data["tools"]:
        started, t0 = time.time(), time.perf_counter()
        answer = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=8)
        _AGENT.model_calls.append((started, time.perf_counter() - t0))
        _AGENT.calls += 1
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        await asyncio.sleep(seconds)  # the tool
        emit_tool_call("sim_tool", {"seconds": seconds}, TOOL_RESULT, duration_ms=seconds * 1000)
        messages.append({"role": "user", "content": f"Tool result: {TOOL_RESULT}"})
    return 1.0


# shared counters of a runner process, read by the driver
READY, COMPLETED, FAILED, LOST, CALLS, CLAIMS = range(6)


def _runner_process(
    index: int,
    url: str,
    token: str,
    slots: int,
    lease: float,
    shared: Any,
    stop: Any,
    results: Any,
    profile: str | None = None,
) -> None:
    logging.basicConfig(level=logging.WARNING)
    if profile is None:
        asyncio.run(_run_runner(index, url, token, slots, lease, shared, stop, results))
        return
    import cProfile

    # wall-clock timer: a CPU-time one costs a system call per function call, which slows the
    # runner enough (the openai client makes many calls) that its leases lapse
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        asyncio.run(_run_runner(index, url, token, slots, lease, shared, stop, results))
    finally:
        profiler.disable()
        profiler.dump_stats(profile)


async def _run_runner(
    index: int, url: str, token: str, slots: int, lease: float, shared: Any, stop: Any, results: Any
) -> None:
    runner = Runner(
        sim_agent, url, token=token, concurrency=slots, worker_id=f"sim-runner-{index}", lease_seconds=lease
    )
    claims: list[tuple[float, float]] = []
    dequeue = runner.client.dequeue

    async def timed_dequeue(worker_id: str, lease_seconds: float | None = None, wait: float = 0.0) -> Any:
        """The runner's own dequeue call, timed (wall start, seconds) when it brings a claim."""
        started, t0 = time.time(), time.perf_counter()
        claim = await dequeue(worker_id, lease_seconds, wait)
        if claim is not None:
            claims.append((started, time.perf_counter() - t0))
        return claim

    runner.client.dequeue = timed_dequeue  # type: ignore[method-assign]

    def publish() -> None:
        shared[COMPLETED], shared[FAILED], shared[LOST] = runner.completed, runner.failed, runner.lost
        shared[CALLS], shared[CLAIMS] = _AGENT.calls, len(claims)

    async def report() -> None:
        shared[READY] = 1
        stopping = False
        while True:
            publish()
            if not stopping and stop.is_set():
                stopping = True
                runner.stop()
            await asyncio.sleep(0.2)

    reporter = asyncio.create_task(report())
    try:
        await runner.run()
    finally:
        reporter.cancel()
        publish()
        results.put({"index": index, "claims": claims, "model_calls": _AGENT.model_calls})


# ---------------------------------------------------------------------------- measuring


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat, idle and iowait excluded)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """User + system CPU of groups of processes between :meth:`start` and the last
    :meth:`sample`; a group's processes may come and go (PostgreSQL backends): one first seen
    after the start counts from zero, one gone keeps its last reading."""

    def __init__(self, groups: dict[str, Callable[[], list[int]]]) -> None:
        self.groups = groups
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.members: dict[str, set[int]] = {name: set() for name in groups}
        self.started = False

    def sample(self) -> None:
        for name, pids in self.groups.items():
            for pid in pids():
                cpu = cpu_seconds(pid)
                if cpu <= 0 and pid in self.last:
                    continue  # gone: keep its last reading
                if pid not in self.base:
                    self.base[pid] = cpu if not self.started else 0.0
                self.last[pid] = cpu
                self.members[name].add(pid)

    def start(self) -> None:
        self.base.clear()
        self.last.clear()
        self.members = {name: set() for name in self.groups}
        self.started = False
        self.sample()
        self.started = True

    def seconds(self) -> dict[str, float]:
        return {
            name: sum(self.last[p] - self.base[p] for p in members) for name, members in self.members.items()
        }


class PgMonitor:
    """PostgreSQL's view: our backends (by application_name), the background processes, rows
    written to our schema, commits (the whole database) and WAL bytes (the whole cluster)."""

    def __init__(self, dsn: str, app: str, schema: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True, application_name=f"{app}-monitor")
        self.app, self.schema = app, schema
        self.lock = threading.Lock()

    def _rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.conn.execute(sql, params).fetchall()

    def ours(self) -> list[int]:
        return [
            r[0] for r in self._rows("SELECT pid FROM pg_stat_activity WHERE application_name = %s", self.app)
        ]

    def background(self) -> list[int]:
        return [
            r[0]
            for r in self._rows("SELECT pid FROM pg_stat_activity WHERE backend_type <> 'client backend'")
        ]

    def counters(self) -> dict[str, float]:
        rows = self._rows(
            "SELECT COALESCE(SUM(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables "
            "WHERE schemaname = %s",
            self.schema,
        )[0][0]
        commits = self._rows("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[
            0
        ][0]
        wal = self._rows("SELECT wal_bytes FROM pg_stat_wal")[0][0]
        return {"rows_written": float(rows), "commits": float(commits), "wal_bytes": float(wal)}

    def close(self) -> None:
        self.conn.close()


def _query(db: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Read the store's tables directly (the SQLite file read-only, or PostgreSQL)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db) as conn:
            return conn.execute(sql.replace("?", "%s"), params).fetchall()
    lite = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return lite.execute(sql, params).fetchall()
    finally:
        lite.close()


def _dist(values: list[float]) -> dict[str, float | int]:
    """p50/p99/mean in ms of values in seconds."""
    return {
        "p50_ms": pct(values, 50),
        "p99_ms": pct(values, 99),
        "mean_ms": statistics.fmean(values) * 1000 if values else float("nan"),
        "n": len(values),
    }


# ---------------------------------------------------------------------------- the run


@dataclass
class Deployment:
    servers: list[ServerProcess]
    stub: Any
    runners: list[Any]
    shared: list[Any]
    stop: Any
    results: Any
    token: str
    stub_url: str
    runner_urls: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


def _tools(rng: random.Random, args: argparse.Namespace, first_wave: bool) -> list[float]:
    """One rollout's tool sleeps; the first wave's are cut by a random fraction, so the first
    claims spread over one rollout's time instead of coming back all at once."""
    scale = rng.random() if first_wave else 1.0
    j = args.jitter
    return [round(args.tool_latency * rng.uniform(1 - j, 1 + j) * scale, 4) for _ in range(args.calls)]


def _pid_of(process: Any) -> Callable[[], list[int]]:
    """The pid of a child process once it has started."""
    return lambda: [process.pid] if process is not None and process.pid else []


class Driver:
    def __init__(self, args: argparse.Namespace, dep: Deployment, db: str, pg: PgMonitor | None) -> None:
        self.args, self.dep, self.db, self.pg = args, dep, db, pg
        self.rng = random.Random(args.seed)
        self.enqueued = 0
        groups: dict[str, Callable[[], list[int]]] = {}
        for i, s in enumerate(dep.servers):
            groups[f"server {i + 1}" if len(dep.servers) > 1 else "server"] = _pid_of(s.process)
        groups["stub model"] = _pid_of(dep.stub)
        for i, r in enumerate(dep.runners):
            groups[f"runner {i + 1}"] = _pid_of(r)
        groups["driver"] = lambda: [os.getpid()]
        if pg is not None:
            groups["PostgreSQL backends"] = pg.ours
            groups["PostgreSQL background"] = pg.background
        self.meter = CpuMeter(groups)
        self.live = CpuMeter(groups)  # for the progress line: the last second only
        self.console = make_console()

    def counter(self, index: int) -> int:
        return int(sum(s[index] for s in self.dep.shared))

    @property
    def done(self) -> int:
        return self.counter(COMPLETED) + self.counter(FAILED) + self.counter(LOST)

    async def feed(self, client: AsyncClient) -> None:
        """Top the system up to N running + B queued."""
        want = self.args.agents + self.args.backlog - (self.enqueued - self.done)
        while want > 0:
            n = min(want, 1000)
            items = [
                RolloutCreate(
                    task=Task(
                        data={
                            "tools": _tools(self.rng, self.args, self.enqueued + i < self.args.agents),
                            "retries": self.args.agent_retries,
                        }
                    ),
                    max_attempts=1,
                )
                for i in range(n)
            ]
            await client.enqueue(items)
            self.enqueued += n
            want -= n

    async def run(self) -> tuple[float, float, dict[str, Any]]:
        """Warm up, measure, drain; returns the window (wall start, end) and what was measured in it."""
        args, dep = self.args, self.dep
        client = AsyncClient(dep.urls[0], token=dep.token, timeout=120)
        try:
            await self.feed(client)  # the first wave waits for the runners: no slot polls an empty queue
            for proc in dep.runners:
                proc.start()
            deadline = time.monotonic() + 180
            # running: every runner started and every slot has claimed its first rollout
            while self.counter(READY) < len(dep.runners) or self.counter(CLAIMS) < args.agents:
                dead = [p for p in dep.runners if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise SystemExit("error: the runner processes did not start (see their output above)")
                await asyncio.sleep(0.1)
            with task_bars(self.console if self.console.is_terminal else None) as bars:
                self.bars = bars
                await self._phase(client, "warm-up", args.warmup)
                self.meter.start()
                busy0, pg0, t0 = _busy_seconds(), self.pg.counters() if self.pg else {}, time.time()
                await self._phase(client, "measure", args.duration, self.meter)
                self.meter.sample()
                busy1, pg1, t1 = _busy_seconds(), self.pg.counters() if self.pg else {}, time.time()
                await self._drain()
        finally:
            await client.aclose()
        measured = {
            "cpu": self.meter.seconds(),
            "busy": busy1 - busy0,
            "pg": {k: pg1[k] - pg0[k] for k in pg0},
        }
        return t0, t1, measured

    async def _phase(
        self, client: AsyncClient, name: str, seconds: float, meter: CpuMeter | None = None
    ) -> None:
        """Keep the system fed for ``seconds``; progress every second."""
        task = self.bars.add_task(name, total=round(seconds), info="")
        start = time.monotonic()
        self.live.start()
        done0, last, last_line = self.done, start, start
        while (now := time.monotonic()) < start + seconds:
            await self.feed(client)
            if now - last >= 1.0:
                info = self._info((self.done - done0) / (now - start), now - last)
                self.bars.update(task, completed=round(now - start), info=info)
                if not self.console.is_terminal and now - last_line >= 5.0:
                    print_line(self.console, f"  {name} {now - start:5.0f}/{seconds:.0f} s  {info}")
                    last_line = now
                if meter is not None:
                    meter.sample()  # PostgreSQL backends may come and go
                last = now
                self.live.start()
            await asyncio.sleep(0.2)
        self.bars.update(task, completed=round(seconds))

    def _info(self, rate: float, seconds: float) -> str:
        self.live.sample()
        cores = {k: v / seconds for k, v in self.live.seconds().items()}
        servers = "+".join(f"{v:.2f}" for k, v in cores.items() if k.startswith("server"))
        runners = "+".join(f"{v:.2f}" for k, v in cores.items() if k.startswith("runner"))
        running = self.enqueued - self.done
        return f"{rate:6.1f} rollouts/s  in system {running}  cores: server {servers}  runners {runners}"

    async def _drain(self) -> None:
        """Stop enqueueing; wait until every enqueued rollout has ended."""
        args = self.args
        limit = 3 * (1 + args.jitter) * args.calls * args.tool_latency + 120
        task = self.bars.add_task("drain", total=self.enqueued, info="every rollout to end")
        deadline = time.monotonic() + limit
        while self.done < self.enqueued and time.monotonic() < deadline:
            self.bars.update(task, completed=self.done)
            await asyncio.sleep(0.2)
        self.bars.update(task, completed=self.done)
        if self.done < self.enqueued:
            print_line(
                self.console,
                f"  drain: {self.enqueued - self.done} rollouts still running after {limit:.0f} s",
            )


def _stop_runners(dep: Deployment) -> list[dict[str, Any]]:
    """Stop the runner processes; what each measured."""
    dep.stop.set()
    got = []
    for _ in dep.runners:
        try:
            got.append(dep.results.get(timeout=60))
        except Exception:
            break
    for proc in dep.runners:
        proc.join(30)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
    return got


def _from_store(db: str, t0: float, t1: float) -> dict[str, Any]:
    """What the store holds: the checks of the whole run and the window's figures."""
    rollouts = dict(_query(db, "SELECT status, COUNT(*) FROM rollouts GROUP BY status"))
    attempts = dict(_query(db, "SELECT status, COUNT(*) FROM attempts GROUP BY status"))
    events = dict(_query(db, "SELECT type, COUNT(*) FROM events GROUP BY type"))
    not_once = _query(
        db,
        "SELECT COUNT(*) FROM rollouts r WHERE r.attempts <> 1 OR "
        "(SELECT COUNT(*) FROM attempts a WHERE a.rollout_id = r.id) <> 1",
    )[0][0]
    ended = _query(
        db,
        "SELECT a.started_at, a.ended_at, t.data FROM attempts a JOIN rollouts r ON r.id = a.rollout_id "
        "JOIN tasks t ON t.id = r.task_id WHERE a.status = 'succeeded' AND a.ended_at >= ? AND a.ended_at < ?",
        t0,
        t1,
    )
    waits = _query(
        db,
        "SELECT a.started_at - r.created_at FROM attempts a JOIN rollouts r ON r.id = a.rollout_id "
        "WHERE a.started_at >= ? AND a.started_at < ?",
        t0,
        t1,
    )
    calls = _query(
        db, "SELECT COUNT(*) FROM events WHERE type = 'llm_call' AND timestamp >= ? AND timestamp < ?", t0, t1
    )[0][0]
    retried = _query(
        db,
        "SELECT data FROM events WHERE type = 'llm_call' AND data LIKE ? AND data NOT LIKE ?",
        '%"retries":%',
        '%"retries":0%',
    )
    failures = _query(
        db, "SELECT status, error FROM attempts WHERE status <> 'succeeded' ORDER BY started_at LIMIT 3"
    )
    durations = [end - start for start, end, _ in ended]
    overheads = [end - start - sum(json.loads(data)["tools"]) for start, end, data in ended]
    return {
        "rollouts": {str(k): int(v) for k, v in rollouts.items()},
        "attempts": {str(k): int(v) for k, v in attempts.items()},
        "events": {str(k): int(v) for k, v in events.items()},
        "not_exactly_once": int(not_once),
        "failures": [f"{status}: {error}" for status, error in failures],
        "retries": sum(int(json.loads(data)["retries"]) for (data,) in retried),
        "window_rollouts": len(ended),
        "window_calls": int(calls),
        "durations": durations,
        "overheads": overheads,
        "queue_waits": [w for (w,) in waits],
    }


def _calibrate(dep: Deployment, calls: int) -> dict[str, float]:
    """Gateway CPU per model call: ``calls`` calls straight to one attempt's gateway (on the
    first server), nothing else running; the server's and the stub's CPU per call."""
    server = dep.servers[0]
    assert server.process is not None and server.process.pid is not None
    with Client(server.url, token=dep.token, timeout=120) as client:
        client.enqueue([RolloutCreate(task=Task(data={"calibration": True}))])
        claim = client.dequeue("calibration", lease_seconds=600)
    assert claim is not None and claim.resources is not None
    llm = claim.resources.resources["llm"]
    assert isinstance(llm, LLM)
    concurrency = 16
    before = cpu_seconds(server.process.pid), cpu_seconds(dep.stub.pid)
    elapsed, _, named = asyncio.run(
        _phase([(llm.base_url, llm.api_key)], calls, concurrency, idempotent=True)
    )
    n = calls + concurrency  # _phase warms every connection up with one call first
    with Client(server.url, token=dep.token, timeout=120) as client:
        client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0, worker_id="calibration")
    return {
        "calls": n,
        "server_ms_per_call": (cpu_seconds(server.process.pid) - before[0]) / n * 1000,
        "stub_ms_per_call": (cpu_seconds(dep.stub.pid) - before[1]) / n * 1000,
        "calls_per_s": calls / elapsed,
        "named": named,
    }


# ---------------------------------------------------------------------------- the report


def _bottleneck(cores: dict[str, float], busy: float, ncpu: int, agents: int) -> str:
    """Which part runs out first, from the measured cores of each process."""
    ours = sum(cores.values())
    python = {k: v for k, v in cores.items() if not k.startswith("PostgreSQL")}
    top = max(python, key=lambda k: python[k])
    share = ", ".join(
        f"{k} {v / ncpu:.0%}" for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.005
    )
    other = max(0.0, busy - ours)
    if busy >= 0.9 * ncpu and other > 0.15:
        head = (
            f"cannot be told: the machine's {ncpu} cores were saturated ({busy:.2f} busy), {other:.2f} of "
            f"them by other work; run it on a quiet machine. This run's largest share is {top}'s "
            f"({python[top]:.2f} cores)"
        )
    elif busy >= 0.9 * ncpu:
        head = (
            f"the machine's {ncpu} cores saturate first ({busy:.2f} busy, {ours:.2f} of them this run's); "
            f"the largest share is {top}'s ({python[top]:.2f} cores)"
        )
    elif python[top] >= 0.8:
        head = (
            f"{top} saturates first: {python[top]:.2f} of the one core a Python process can use "
            f"(its interpreter runs on one core at a time)"
        )
    else:
        head = f"nothing saturated yet; nearest to its limit is {top} at {python[top]:.2f} of a core"
    at_top = agents / python[top] if python[top] > 0 else math.inf
    at_machine = agents * ncpu / ours if ours > 0 else math.inf
    return (
        f"{head}. Share of the {ncpu} cores: {share}. At this cost per rollout {top} would fill its core "
        f"at about {at_top:,.0f} agents, and this run's processes all {ncpu} cores at about {at_machine:,.0f}."
    )


def _estimate(r: dict[str, Any], replica_load: float) -> list[str]:
    """The paper estimate for TARGET_AGENTS agents, as formulas over the measured figures."""
    e = r["estimate"]
    k = r["config"]["calls"]
    lines = [
        f"Paper estimate for {TARGET_AGENTS:,} concurrent agents (the same workload: {k} model calls and "
        f"{k} tool calls of {r['config']['tool_latency']:g} s per rollout), from this run's costs:",
        f"  rollouts/s     = {TARGET_AGENTS:,} agents / {e['rollout_s']:.2f} s per rollout (measured mean)"
        f" = {e['rollouts_per_s']:,.0f}/s",
        f"  gateway calls  = {e['rollouts_per_s']:,.0f}/s x {k} = {e['calls_per_s']:,.0f}/s",
        f"  server cores   = {e['rollouts_per_s']:,.0f}/s x {r['per_rollout_ms']['server']:.2f} ms server CPU per rollout"
        f" = {e['server_cores']:.1f} cores -> {e['replicas']} replicas at {replica_load:.0%} of a core each",
        f"    gateway part = {e['calls_per_s']:,.0f}/s x {r['calibration']['server_ms_per_call']:.2f} ms per call"
        f" = {e['gateway_cores']:.1f} cores; store and queue part = {e['store_cores']:.1f} cores",
        f"  runner cores   = {e['rollouts_per_s']:,.0f}/s x {r['per_rollout_ms']['runners']:.2f} ms per rollout"
        f" (runner + agents' client) = {e['runner_cores']:.1f} cores",
    ]
    if "pg_rows_per_s" in e:
        pg = r["postgres"]
        lines.append(
            f"  PostgreSQL     = {e['rollouts_per_s']:,.0f}/s x {pg['rows_written_per_rollout']:.1f} rows written"
            f" = {e['pg_rows_per_s']:,.0f} row writes/s; x {pg['commits_per_rollout']:.1f} commits"
            f" = {e['pg_commits_per_s']:,.0f} commits/s; x {pg['wal_kb_per_rollout']:.1f} kB WAL"
            f" = {e['pg_wal_mb_per_s']:.1f} MB/s; x {r['per_rollout_ms']['postgres']:.2f} ms CPU"
            f" = {e['pg_cores']:.1f} cores"
        )
    else:
        lines.append("  PostgreSQL     = run with --backend postgres for the database's writes and CPU")
    lines.append(
        "  (rollouts with a real model last longer than with this instant stub, so the rates are an upper bound;"
        f" heartbeats grow with rollout time: one per {r['config']['lease'] / 3:.0f} s)"
    )
    return lines


def _summarise(
    args: argparse.Namespace,
    t0: float,
    t1: float,
    m: dict[str, Any],
    store: dict[str, Any],
    runs: list[dict[str, Any]],
    calib: dict[str, float],
    calls_made: int,
    enqueued: int,
    runner_urls: list[str],
) -> dict[str, Any]:
    window = t1 - t0
    ncpu = os.cpu_count() or 1
    n = store["window_rollouts"]
    cpu = m["cpu"]
    cores = {k: v / window for k, v in cpu.items()}
    group = {
        "server": sum(v for k, v in cpu.items() if k.startswith("server")),
        "runners": sum(v for k, v in cpu.items() if k.startswith("runner")),
        "stub": cpu.get("stub model", 0.0),
        "driver": cpu.get("driver", 0.0),
        "postgres": sum(v for k, v in cpu.items() if k.startswith("PostgreSQL")),
    }
    per_rollout = {k: v / n * 1000 if n else float("nan") for k, v in group.items()}
    claims = [d for run in runs for t, d in run["claims"] if t0 <= t < t1]
    model = [d for run in runs for t, d in run["model_calls"] if t0 <= t < t1]
    ours = sum(cores.values())
    busy = m["busy"] / window
    rollout_s = statistics.fmean(store["durations"]) if store["durations"] else float("nan")
    recorded = store["events"].get("llm_call", 0)
    check = {
        "enqueued": enqueued,
        "succeeded": store["rollouts"].get("succeeded", 0),
        "not_exactly_once": store["not_exactly_once"],
        "attempts": store["attempts"],
        "failures": store["failures"],
        "client_retries": store["retries"],
        "calls_made": calls_made,
        "calls_recorded": recorded,
        "tool_events": store["events"].get("tool_call", 0),
        "tools_expected": enqueued * args.calls,
        "gateway_answers_named": calib["named"] == calib["calls"],
    }
    check["ok"] = bool(
        check["succeeded"] == enqueued > 0
        and check["not_exactly_once"] == 0
        and calls_made == recorded == enqueued * args.calls
        and check["tool_events"] == check["tools_expected"]
        and check["gateway_answers_named"]
    )
    out: dict[str, Any] = {
        "config": {
            "agents": args.agents,
            "tool_latency": args.tool_latency,
            "calls": args.calls,
            "jitter": args.jitter,
            "backend": args.backend,
            "replicas": args.replicas,
            "runner_procs": args.runner_procs,
            "backlog": args.backlog,
            "warmup": args.warmup,
            "duration": args.duration,
            "lease": args.lease,
            "agent_retries": args.agent_retries,
            "runners_to_replicas": "runner i talks to replica i mod replicas (no load balancer)",
            "runner_urls": runner_urls,
        },
        "window_s": window,
        "rollouts_in_window": n,
        "rollouts_per_s": n / window,
        "gateway_calls_per_s": store["window_calls"] / window,
        "claim": _dist(claims),
        "queue_wait": _dist(store["queue_waits"]),
        "model_call": _dist(model),
        "rollout_overhead": _dist(store["overheads"]),
        "rollout_s_mean": rollout_s,
        "cpu_s": cpu,
        "cores": cores,
        "per_rollout_ms": per_rollout,
        "server_cpu_ms_per_rollout": per_rollout["server"],
        "calibration": calib,
        "machine": {
            "cores": ncpu,
            "busy_cores": busy,
            "this_run_cores": ours,
            "other_cores": max(0.0, busy - ours),
        },
        "check": check,
    }
    out["bottleneck"] = _bottleneck(cores, busy, ncpu, args.agents)
    if m["pg"] and n:
        out["postgres"] = {
            "rows_written_per_rollout": m["pg"]["rows_written"] / n,
            "commits_per_rollout": m["pg"]["commits"] / n,
            "wal_kb_per_rollout": m["pg"]["wal_bytes"] / n / 1024,
        }
    rate = TARGET_AGENTS / rollout_s
    gw = rate * args.calls * calib["server_ms_per_call"] / 1000
    server = rate * per_rollout["server"] / 1000
    est = {
        "agents": TARGET_AGENTS,
        "rollout_s": rollout_s,
        "rollouts_per_s": rate,
        "calls_per_s": rate * args.calls,
        "server_cores": server,
        "gateway_cores": gw,
        "store_cores": max(0.0, server - gw),
        "replicas": math.ceil(server / args.replica_load) if server == server else 0,
        "runner_cores": rate * per_rollout["runners"] / 1000,
    }
    if "postgres" in out:
        pg = out["postgres"]
        est |= {
            "pg_rows_per_s": rate * pg["rows_written_per_rollout"],
            "pg_commits_per_s": rate * pg["commits_per_rollout"],
            "pg_wal_mb_per_s": rate * pg["wal_kb_per_rollout"] / 1024,
            "pg_cores": rate * per_rollout["postgres"] / 1000,
        }
    out["estimate"] = est
    return out


def _print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.table import Table

    console = make_console()
    c = r["config"]
    title = (
        f"{c['agents']:,} agents x {c['calls']} calls, {c['tool_latency']:g} s tools (+-{c['jitter']:.0%}); "
        f"{c['backend']}, {c['replicas']} server replica(s), {c['runner_procs']} runner processes; "
        f"{r['window_s']:.0f} s measured"
    )
    figures = Table(title=title, title_justify="left", show_header=True)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    figures.add_column("how it is measured")
    figures.add_row(
        "rollouts/s", f"{r['rollouts_per_s']:.1f}", f"{r['rollouts_in_window']} ended in the window (store)"
    )
    figures.add_row(
        "gateway calls/s", f"{r['gateway_calls_per_s']:.1f}", "llm_call events recorded in the window"
    )
    for key, what in (
        ("claim", "the runner's dequeue call that brought a claim"),
        ("queue_wait", f"enqueued -> claimed (store), backlog of {c['backlog']}"),
        ("model_call", "an agent's chat call through the gateway (instant stub)"),
        ("rollout_overhead", "rollout time minus its tool sleeps"),
    ):
        d = r[key]
        figures.add_row(
            f"{key.replace('_', ' ')} p50 / p99",
            f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f} ms",
            f"{what}; n={d['n']}",
        )
    figures.add_row(
        "server CPU per rollout", f"{r['server_cpu_ms_per_rollout']:.2f} ms", "all replicas, user+sys (/proc)"
    )
    cal = r["calibration"]
    figures.add_row(
        "gateway CPU per call",
        f"{cal['server_ms_per_call']:.2f} ms",
        f"calibration: {cal['calls']} calls, nothing else running",
    )
    if "postgres" in r:
        pg = r["postgres"]
        figures.add_row(
            "PostgreSQL per rollout",
            f"{pg['rows_written_per_rollout']:.1f} rows, {pg['commits_per_rollout']:.1f} commits",
            f"{pg['wal_kb_per_rollout']:.1f} kB WAL (commits and WAL: the whole database/cluster)",
        )
    console.print(figures)
    cpu = Table(title="CPU in the measured window (user + system, /proc)", title_justify="left")
    for col in ("process", "CPU s", "cores", "share of machine", "ms per rollout"):
        cpu.add_column(col, justify="left" if col == "process" else "right")
    n = max(1, r["rollouts_in_window"])
    ncpu = r["machine"]["cores"]
    for name, seconds in r["cpu_s"].items():
        cores = r["cores"][name]
        cpu.add_row(
            name, f"{seconds:.1f}", f"{cores:.2f}", f"{cores / ncpu:.0%}", f"{seconds / n * 1000:.2f}"
        )
    mach = r["machine"]
    cpu.add_row(
        "machine (all)",
        f"{mach['busy_cores'] * r['window_s']:.1f}",
        f"{mach['busy_cores']:.2f}",
        f"{mach['busy_cores'] / ncpu:.0%}",
        "",
    )
    console.print(cpu)
    if mach["other_cores"] > 0.15:
        print_line(
            console,
            f"WARNING: other work used {mach['other_cores']:.2f} cores during the window: "
            "these figures are not for reporting",
        )
    print_line(console, f"First bottleneck: {r['bottleneck']}")
    ch = r["check"]
    print_line(
        console,
        f"Check: {'OK' if ch['ok'] else 'FAILED'} - {ch['succeeded']}/{ch['enqueued']} rollouts succeeded, "
        f"{ch['not_exactly_once']} not exactly once; model calls made {ch['calls_made']}, recorded "
        f"{ch['calls_recorded']} (expected {ch['tools_expected']}); tool events {ch['tool_events']}",
    )
    if ch["client_retries"]:
        print_line(
            console,
            f"  the agents' OpenAI clients retried {ch['client_retries']} model call tries "
            "(the gateway joined each to its call's record; with --agent-retries 0 those rollouts fail)",
        )
    for failure in ch["failures"]:
        print_line(console, f"  attempt not succeeded: {failure}")
    for line in _estimate(r, args.replica_load):
        print_line(console, line)


# ---------------------------------------------------------------------------- main


def _deploy(args: argparse.Namespace, db: str) -> Deployment:
    token = secrets.token_urlsafe(24)
    config = ServerConfig.with_token(token, db=db, lease_seconds=args.lease)
    profiles = Path(args.profile) if args.profile else None
    if profiles is not None:
        profiles.mkdir(parents=True, exist_ok=True)
    servers = [
        ServerProcess(config, profile=str(profiles / f"server-{i + 1}.prof") if profiles else None)
        for i in range(args.replicas)
    ]
    port = free_port()
    stub = SPAWN.Process(target=_serve_upstream, args=(port, args.model_latency_ms / 1000), daemon=True)
    stub.start()
    dep = Deployment(
        servers, stub, [], [], SPAWN.Event(), SPAWN.Queue(), token, f"http://127.0.0.1:{port}/v1"
    )
    try:
        start_together(servers)
        if _query(db, "SELECT COUNT(*) FROM rollouts")[0][0]:
            raise SystemExit("error: the store already holds rollouts; give an empty one (or no --store)")
        wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        with Client(dep.urls[0], token=token) as client:
            client.publish_resources({"llm": LLM(base_url=dep.stub_url, model="stub")})
    except BaseException:
        _teardown(dep)
        raise
    base, extra = divmod(args.agents, args.runner_procs)
    for i in range(args.runner_procs):
        shared = SPAWN.Array("d", 6, lock=False)
        slots = base + (i < extra)
        url = dep.urls[i % len(dep.urls)]
        dep.runner_urls.append(url)
        proc = SPAWN.Process(
            target=_runner_process,
            args=(
                i + 1,
                url,
                token,
                slots,
                args.lease,
                shared,
                dep.stop,
                dep.results,
                str(profiles / f"runner-{i + 1}.prof") if profiles else None,
            ),
            daemon=True,
        )
        dep.runners.append(proc)
        dep.shared.append(shared)
    return dep


def _teardown(dep: Deployment) -> None:
    for proc in dep.runners:
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
            proc.join(5)
    for s in dep.servers:
        s.stop()
    dep.stub.terminate()
    dep.stub.join(5)


def run(args: argparse.Namespace, db: str) -> dict[str, Any]:
    pg = None
    if args.backend == "postgres":
        schema = re.search(r"search_path%3D(\w+)", db)
        if schema is None:
            raise SystemExit(
                "error: a PostgreSQL store URL needs its own schema: ?options=-csearch_path%3DNAME"
            )
        app = f"scale_sim_{schema.group(1)}"
        pg = PgMonitor(db, app, schema.group(1))
        db = f"{db}&application_name={app}"
    dep = _deploy(args, db)
    try:
        driver = Driver(args, dep, db, pg)
        t0, t1, measured = asyncio.run(driver.run())
        runs = _stop_runners(dep)
        if len(runs) != len(dep.runners):
            raise SystemExit("error: a runner process ended without its figures")
        calls_made = sum(int(s[CALLS]) for s in dep.shared)
        store = _from_store(db, t0, t1)
        if not store["window_rollouts"]:
            raise SystemExit(
                f"error: no rollout ended in the {t1 - t0:.0f} s measured; lengthen --duration "
                "(or the machine is too busy with other work)"
            )
        calib = _calibrate(dep, args.calibration_calls)
    finally:
        _teardown(dep)
        if pg is not None:
            pg.close()
    return _summarise(
        args, t0, t1, measured, store, runs, calib, calls_made, driver.enqueued, dep.runner_urls
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", "-N", type=int, default=1000, help="concurrent agents (default 1000)")
    ap.add_argument("--tool-latency", type=float, default=5.0, help="seconds per tool call (default 5)")
    ap.add_argument(
        "--calls", type=int, default=2, help="model calls per rollout, each followed by a tool (default 2)"
    )
    ap.add_argument(
        "--jitter", type=float, default=0.5, help="tool sleeps drawn within +-this fraction (default 0.5)"
    )
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    ap.add_argument(
        "--warmup", type=float, default=None, help="seconds before measuring (default: one longest rollout)"
    )
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--replicas", type=int, default=1, help="server processes (PostgreSQL only above 1)")
    ap.add_argument(
        "--runner-procs", type=int, default=None, help="runner processes (default max(2, replicas))"
    )
    ap.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="rollouts kept queued beyond the running ones (default N/20, at least 10)",
    )
    ap.add_argument(
        "--agent-retries",
        type=int,
        default=2,
        help="the agents' OpenAI client max_retries (default 2, the openai package's own default)",
    )
    ap.add_argument(
        "--lease", type=float, default=30.0, help="the runners' lease in seconds (a heartbeat every third)"
    )
    ap.add_argument(
        "--model-latency-ms", type=float, default=0.0, help="the stub model's answer delay (default 0)"
    )
    ap.add_argument(
        "--calibration-calls", type=int, default=2000, help="gateway calls of the calibration phase"
    )
    ap.add_argument(
        "--replica-load",
        type=float,
        default=0.7,
        help="the estimate plans each replica at this share of a core",
    )
    ap.add_argument(
        "--pg", default=os.environ.get("AGENTBOLT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
    )
    ap.add_argument(
        "--store",
        metavar="URL",
        help="an existing, empty store instead of a fresh one (a SQLite file, or a postgresql:// URL whose "
        "options set its own search_path); it is kept afterwards, for an audit",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="write each server's (CPU time) and runner process's (wall time) cProfile statistics here; "
        "profiling slows them, so take no figures from such a run",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON here ('-' for stdout)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 100 agents, 1 s tools, 10 s measured")
    args = ap.parse_args()
    if args.quick:
        args.agents, args.tool_latency, args.duration, args.calibration_calls = 100, 1.0, 10.0, 300
    for name in ("agents", "calls", "replicas", "calibration_calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.agent_retries < 0:
        ap.error("--agent-retries must be at least 0")
    if args.tool_latency < 0 or args.duration <= 0 or not 0 <= args.jitter < 1 or args.lease <= 0:
        ap.error("--tool-latency must be >= 0, --duration and --lease > 0, --jitter in [0, 1)")
    if not 0 < args.replica_load <= 1:
        ap.error("--replica-load must be in (0, 1]")
    if args.store:
        args.backend = "postgres" if args.store.startswith("postgresql://") else "sqlite"
    if args.backend == "sqlite" and args.replicas != 1:
        ap.error("SQLite serves one server process; use --backend postgres for replicas")
    args.runner_procs = args.runner_procs or max(2, args.replicas)
    if args.runner_procs < args.replicas or args.runner_procs > args.agents:
        ap.error(
            "--runner-procs must be at least --replicas (each replica gets runners) and at most --agents"
        )
    if args.warmup is None:
        args.warmup = max(1.0, (1 + args.jitter) * args.calls * args.tool_latency)
    if args.backlog is None:
        args.backlog = max(10, args.agents // 20)
    if args.backend == "postgres":
        try:
            import psycopg

            psycopg.connect(args.store or args.pg, connect_timeout=5).close()
        except Exception as exc:
            ap.error(f"PostgreSQL at {args.store or args.pg} is unreachable ({type(exc).__name__}); set --pg")
    if args.store:
        result = run(args, args.store)
    else:
        with store_url(args.backend, args.pg) as db:
            try:
                result = run(args, db)
            finally:
                if args.backend == "sqlite":
                    shutil.rmtree(Path(db).parent, ignore_errors=True)
    _print_report(result, args)
    if args.json:
        text = json.dumps(result, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if not result["check"]["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
