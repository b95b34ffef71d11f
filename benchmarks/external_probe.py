"""How the untrained bundled model does on external tasks: held-out success, sampled and greedy.

For each task spec (``reasoning_gym:<dataset>?...``, ``gymnasium:<env id>?...``; see
docs/training.md), N held-out tasks are played once at temperature 1 and once at temperature 0
by the task's own agent, through a real server, runner and gateway and the embedded engine
(bfloat16 weights, as ``agentbolt demo`` serves them), the same evaluation path the demo's
before/after figures take (``run_sampled_and_greedy``). Success is a reward of 1.0 (a
reasoning-gym scorer may give partial credit: the mean reward is printed beside it). Used to
choose tasks on which the untrained model has a foothold (5-40% sampled) for training.

    python benchmarks/external_probe.py 'reasoning_gym:spell_backward?max_word_len=4' \\
        'gymnasium:FrozenLake-v1' [--n 32] [--seed 2] [--concurrency 16] [--json probe.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def serving() -> Iterator[tuple[Any, Any]]:
    """The bundled SmolLM2 in the embedded engine and a server beside it: (engine server, server)."""
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model
    from agentbolt.server import ServerConfig, ServerThread

    engine = ModelEngine.from_pretrained(str(ensure_model("smollm2")), device="cpu", dtype="bfloat16")
    try:
        with tempfile.TemporaryDirectory(prefix="external-probe-") as folder:
            config = ServerConfig(db=str(Path(folder) / "store.db"))
            with EngineServer(engine) as served, ServerThread(config) as server:
                yield served, server
    finally:
        engine.close()


def probe(
    spec: str, n: int, seed: int, concurrency: int, served: Any, server: Any, show: int = 0
) -> dict[str, Any]:
    """Held-out success and mean reward of ``spec``'s first ``n`` held-out tasks, both decodings."""
    from agentbolt.algorithms.base import run_sampled_and_greedy
    from agentbolt.client import Client
    from agentbolt.runner.worker import Runner
    from agentbolt.schemas import LLM, Mode, PromptTemplate
    from agentbolt.tasks import get_task

    task = get_task(spec)
    tasks = task.heldout_tasks(n, seed=seed)
    t0 = time.perf_counter()
    with Client(server.url) as client:
        client.publish_resources(
            {
                "llm": LLM(base_url=served.base_url, model="smollm2"),
                "system_prompt": PromptTemplate(template=task.system_prompt, engine="plain"),
            }
        )
        runner = Runner(
            task.agent(), server.url, max_rollouts=2 * n, concurrency=concurrency, flush_interval=0.1
        )
        thread = threading.Thread(target=lambda: asyncio.run(runner.run()), daemon=True)
        thread.start()
        sampled, greedy = run_sampled_and_greedy(
            client, tasks, mode=Mode.VAL, resources_version=None, greedy=True, timeout=1800
        )
        thread.join(60)
        seconds = round(time.perf_counter() - t0, 1)
        row: dict[str, Any] = {"spec": spec, "n": n, "seed": seed, "seconds": seconds}
        for name, batch in (("sampled", sampled), ("greedy", greedy)):
            values = batch.values if batch is not None else []
            row[name] = sum(v >= 1.0 for v in values) / n
            row[f"{name}_mean_reward"] = sum(values) / n
            row[f"{name}_failed"] = len(batch.failed) if batch is not None else n
            replies = _replies(client, batch.rollouts if batch is not None else [])
            row[f"{name}_turns"] = sum(map(len, replies)) / max(1, len(replies))
            row[f"{name}_examples"] = replies[:show]
    return row


def _replies(client: Any, rollouts: list[Any]) -> list[list[str]]:
    """Each rollout's model replies in order (from the gateway's recorded calls)."""
    from agentbolt.schemas import EventType

    events = client.events_of([r.id for r in rollouts], type=[EventType.LLM_CALL.value])
    out = []
    for rollout in rollouts:
        calls = sorted(events[rollout.id], key=lambda e: e.id)
        texts = []
        for event in calls:
            choices = (event.data.get("response") or {}).get("choices") or [{}]
            texts.append(str((choices[0].get("message") or {}).get("content")))
        out.append(texts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("specs", nargs="+", help="task specs")
    parser.add_argument("--n", type=int, default=32, help="held-out tasks per spec")
    parser.add_argument("--seed", type=int, default=2, help="seed of the held-out draw")
    parser.add_argument("--concurrency", type=int, default=16, help="rollouts in flight")
    parser.add_argument("--show", type=int, default=0, help="print this many sampled rollouts' replies")
    parser.add_argument("--json", type=Path, help="append one JSON line per spec to this file")
    args = parser.parse_args()
    print(
        f"{'task spec':<60} {'n':>3} {'sampled':>8} {'greedy':>7} {'mean r s/g':>11} {'time':>6}", flush=True
    )
    with serving() as (served, server):
        for spec in args.specs:
            try:
                row = probe(spec, args.n, args.seed, args.concurrency, served, server, args.show)
            except ValueError as exc:  # a bad spec, or too few distinct held-out tasks
                print(f"{spec:<60} error: {exc}", flush=True)
                continue
            means = f"{row['sampled_mean_reward']:.2f}/{row['greedy_mean_reward']:.2f}"
            print(
                f"{spec:<60} {row['n']:>3} {row['sampled']:>8.0%} {row['greedy']:>7.0%} {means:>11} "
                f"{row['seconds']:>5.0f}s",
                flush=True,
            )
            if row["sampled_failed"] or row["greedy_failed"]:
                print(
                    f"  rollouts that did not finish: {row['sampled_failed']} sampled, {row['greedy_failed']} greedy"
                )
            print(
                f"  model turns per rollout: {row['sampled_turns']:.1f} sampled, {row['greedy_turns']:.1f} greedy"
            )
            for replies in row["sampled_examples"]:
                print("  sampled:", " | ".join(r.replace("\n", "\\n") for r in replies))
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
