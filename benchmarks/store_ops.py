"""The store's hot operations called directly, one at a time: no HTTP, no concurrency.

What one rollout costs the store itself - dequeue, one batch of S events, finish - on the SQLite
file store or on PostgreSQL. Prints wall time and this process's CPU per operation (for
PostgreSQL the wall time includes the database's round trips and its own work). Each write
carries an idempotency key, as the client always sends (``--plain``: none; the store's code
before keyed event batches takes none for events, and is timed without).

    python benchmarks/store_ops.py [--backend sqlite|postgres] [--rollouts 2000 --events 6]
"""

from __future__ import annotations

import argparse
import inspect
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench_util import store_url

from agentbolt.schemas import AttemptFinish, AttemptStatus, EventCreate, RolloutCreate, Task
from agentbolt.store import SqlStore, open_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--rollouts", "-R", type=int, default=2000)
    ap.add_argument("--events", "-S", type=int, default=6)
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--plain", action="store_true", help="no idempotency keys on the writes")
    args = ap.parse_args()

    with store_url(args.backend, args.pg) as url:
        run(open_store(url), args.rollouts, args.events, args.backend, keyed=not args.plain)


def run(store: SqlStore, rollouts: int, events_per: int, backend: str, keyed: bool = True) -> None:
    try:
        store.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(rollouts)])
        events = [
            EventCreate(sequence=i, type="message", data={"i": i, "text": "x" * 64})
            for i in range(events_per)
        ]
        wall: dict[str, float] = defaultdict(float)
        cpu: dict[str, float] = defaultdict(float)

        def timed(name: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            out = fn(*a, **kw)
            wall[name] += time.perf_counter() - w
            cpu[name] += time.process_time() - c
            return out

        events_keyed = keyed and "key" in inspect.signature(store.add_events).parameters
        keys = [[uuid.uuid4().hex if keyed else None for _ in range(3)] for _ in range(rollouts)]
        for key in keys:
            claim = timed("dequeue", store.dequeue, "w1", None, key[0])
            if events_keyed:
                timed("events", store.add_events, claim.attempt.id, events, "w1", key=key[1])
            else:
                timed("events", store.add_events, claim.attempt.id, events, "w1")
            finish = AttemptFinish(status=AttemptStatus.SUCCEEDED, reward=1.0)
            timed("finish", store.finish_attempt, claim.attempt.id, finish, "w1", key[2])
        total = sum(wall.values())
        print(
            f"backend={backend} rollouts={rollouts} events/rollout={events_per} (one thread, no HTTP); "
            f"idempotency keys: {'on every write' if events_keyed else 'dequeue and finish' if keyed else 'none'}"
        )
        print(f"  {rollouts / total:8.1f} rollouts/s   {total / rollouts * 1000:.3f} ms per rollout")
        for name in ("dequeue", "events", "finish"):
            print(
                f"  {name:8s} {wall[name] / rollouts * 1000:6.3f} ms wall   "
                f"{cpu[name] / rollouts * 1000:6.3f} ms CPU here"
            )
        done = store.stats()["rollouts"]["succeeded"]
        print(f"  check: {'OK' if done == rollouts else 'FAILED'} - {done}/{rollouts} succeeded")
        if done != rollouts:
            raise SystemExit(1)
    finally:
        store.close()


if __name__ == "__main__":
    main()
