"""Store throughput over HTTP, the way runners use it.

The server runs in its own process (SQLite file in WAL mode by default, or PostgreSQL with
``--backend postgres``, optionally several replicas). W concurrent workers loop
dequeue -> post S events -> finish until R rollouts are done. Prints rollouts/s, events/s and
p50/p99 latency per call and the CPU time per rollout of the client (this process: the
runner SDK's path) and of the server processes, then verifies that every rollout succeeded exactly once and that
exactly R x S events are stored.

By default the server runs as deployed: an admin token configured, and each worker registered
and calling with the worker token the server issued it (``--plain`` drops both); every write
carries an idempotency key, as the client always sends.

    python benchmarks/store_throughput.py [--rollouts 2000 --workers 32 --events 6]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from collections import defaultdict

from bench_util import cpu_seconds, pct, pids_named, store_url

from agentbolt.client import AsyncClient, Client
from agentbolt.schemas import AttemptStatus, EventCreate, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig
from agentbolt.server.run import ServerProcess

CALLS = ("dequeue", "events", "finish")


async def worker(
    url: str, wid: str, target: int, done: list[int], events_per: int, lat: dict, token: str | None
) -> None:
    client = AsyncClient(url, token=token, max_connections=4)
    try:
        if token is not None:  # as a runner does: its own worker id and token from the server
            registration = await client.register_worker(wid)
            assert registration is not None
            wid = registration.worker_id
        while done[0] < target:
            t0 = time.perf_counter()
            claim = await client.dequeue(wid)
            lat["dequeue"].append(time.perf_counter() - t0)
            if claim is None:
                await asyncio.sleep(0.005)
                continue
            aid = claim.attempt.id
            events = [
                EventCreate(sequence=i, type="message", data={"i": i, "text": "x" * 64})
                for i in range(events_per)
            ]
            t0 = time.perf_counter()
            await client.add_events(aid, events, wid)
            lat["events"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await client.finish(aid, AttemptStatus.SUCCEEDED, 1.0, None, wid)
            lat["finish"].append(time.perf_counter() - t0)
            done[0] += 1
    finally:
        await client.aclose()


async def drive(
    urls: list[str], rollouts: int, workers: int, events_per: int, token: str | None
) -> tuple[float, dict]:
    lat: dict[str, list[float]] = defaultdict(list)
    done = [0]
    t0 = time.perf_counter()
    await asyncio.gather(
        *(
            worker(urls[i % len(urls)], f"w{i}", rollouts, done, events_per, lat, token)
            for i in range(workers)
        )
    )
    return time.perf_counter() - t0, lat


def verify(url: str, ids: list[str], events_per: int, token: str | None) -> tuple[bool, str]:
    with Client(url, timeout=120, token=token) as client:
        stats = client.stats()
        ok_rollouts = 0
        once = True
        for start in range(0, len(ids), 1000):
            for r in client.wait(ids[start : start + 1000], timeout=1).rollouts:
                ok_rollouts += r.status == RolloutStatus.SUCCEEDED
                once &= r.attempts == 1
        events = stats["events"]
    good = ok_rollouts == len(ids) and once and events == len(ids) * events_per
    return good, (
        f"{ok_rollouts}/{len(ids)} succeeded, each exactly once: {once}; "
        f"events stored {events} (expected {len(ids) * events_per})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", "-R", type=int, default=2000)
    ap.add_argument("--workers", "-W", type=int, default=32)
    ap.add_argument("--events", "-S", type=int, default=6)
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument(
        "--synchronous-commit",
        choices=["on", "off"],
        default="on",
        help="PostgreSQL's synchronous_commit: 'off' gives SQLite's durability here (WAL, synchronous=NORMAL): "
        "a crash of the database host may lose the last commits, a crash of the database never does",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="without the features a deployment runs with (a configured admin token, each worker "
        "registered and calling with its issued worker token); on by default. Idempotency keys on "
        "every write are the client's own and always on",
    )
    ap.add_argument("--quick", action="store_true", help="a short run: 500 rollouts")
    ap.add_argument("--profile", metavar="PATH", help="write the server process's cProfile statistics here")
    ap.add_argument(
        "--client-profile", metavar="PATH", help="write this (client) process's cProfile statistics here"
    )
    args = ap.parse_args()
    if args.quick:
        args.rollouts = 500

    if args.backend == "sqlite" and args.replicas != 1:
        raise SystemExit("SQLite serves one server process; use --backend postgres for replicas")
    with store_url(args.backend, args.pg, {"synchronous_commit": args.synchronous_commit}) as db:
        run(args, db)


def run(args: argparse.Namespace, db: str) -> None:
    token = None if args.plain else secrets.token_urlsafe(24)
    config = ServerConfig.with_token(token, db=db, lease_seconds=60)
    servers = [ServerProcess(config, profile=args.profile) for _ in range(args.replicas)]
    for s in servers:
        s.start()
    try:
        urls = [s.url for s in servers]
        with Client(urls[0], timeout=120, token=token) as client:
            ids: list[str] = []
            for start in range(0, args.rollouts, 1000):
                n = min(1000, args.rollouts - start)
                ids += [
                    r.id
                    for r in client.enqueue(
                        [RolloutCreate(task=Task(data={"i": start + i})) for i in range(n)]
                    )
                ]
        # CPU of every process in the run, drive phase only: this one (the workers), the server
        # processes, and for PostgreSQL all its processes (backends, WAL writer, ...)
        procs = {"servers": [s.process.pid for s in servers if s.process and s.process.pid]}
        if args.backend == "postgres":
            procs["PostgreSQL"] = pids_named("postgres")
        before = {k: sum(map(cpu_seconds, v)) for k, v in procs.items()}
        profiler = None
        if args.client_profile:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        client_before = time.process_time()
        elapsed, lat = asyncio.run(drive(urls, args.rollouts, args.workers, args.events, token))
        client_cpu = time.process_time() - client_before
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.client_profile)
        procs["PostgreSQL"] = pids_named("postgres") if args.backend == "postgres" else []
        cpu = {"client": client_cpu} | {
            k: sum(map(cpu_seconds, v)) - before.get(k, 0.0) for k, v in procs.items() if v
        }
        durability = f" synchronous_commit={args.synchronous_commit}" if args.backend == "postgres" else ""
        print(
            f"backend={args.backend}{durability} replicas={args.replicas} rollouts={args.rollouts} "
            f"workers={args.workers} events/rollout={args.events}"
        )
        print(
            "  features: "
            + (
                "plain (no tokens; idempotency keys on writes)"
                if args.plain
                else "admin token configured, registered workers with issued worker tokens, "
                "idempotency keys on writes"
            )
        )
        print(
            f"  {args.rollouts / elapsed:8.1f} rollouts/s   {args.rollouts * args.events / elapsed:9.1f} events/s"
            f"   ({elapsed:.2f} s)"
        )
        for call in CALLS:
            print(
                f"  {call:8s} p50 {pct(lat[call], 50):7.2f} ms   p99 {pct(lat[call], 99):7.2f} ms   n={len(lat[call])}"
            )
        per = ", ".join(f"{k} {v / args.rollouts * 1000:.3f} ms" for k, v in cpu.items())
        print(
            f"  CPU per rollout (user+sys / rollouts): {per}; {sum(cpu.values()) / elapsed:.2f} cores busy in all"
        )
        good, detail = verify(urls[0], ids, args.events, token)
        print(f"  check: {'OK' if good else 'FAILED'} - {detail}")
        if not good:
            raise SystemExit(1)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
