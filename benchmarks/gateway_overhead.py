"""What the gateway costs per model call.

The same chat completion calls go (a) straight to an upstream on loopback and (b) through the
gateway, which forwards them to that upstream and records each as an ``llm_call`` event. The
upstream is a minimal OpenAI-compatible server in its own process that answers at once (with
token ids and logprobs when asked, as vLLM does), so what (b) adds is the gateway's own cost:
its HTTP hop, the request rewrite, the upstream call and the store write. The agentbolt server
runs in its own process (SQLite file, WAL). A lean keep-alive HTTP/1.1 client keeps the driver's
own CPU use small; ``C`` calls are in flight at once (one connection each).

By default the server runs as deployed: an admin token configured, each agent calling with its
attempt's agent key (as the claim hands it over), and each call carrying an ``Idempotency-Key``
and ``x-stainless-retry-count`` as OpenAI's clients send (``--plain`` drops all three).

Prints, per phase, p50/p99 latency per call and throughput, then the added latency, the
throughput ratio and the gateway's CPU per call (the server process's user + system CPU time
over the gateway phases, divided by the calls: the figure that does not depend on how loaded
the machine is), and checks that every gateway call was recorded and named its record.

    python benchmarks/gateway_overhead.py [--calls 4000 --concurrency 32 --upstream-delay-ms 0]

``--upstream-delay-ms`` makes the upstream wait before answering, as a real model would; the
throughput ratio then shows whether the gateway limits concurrency rather than its CPU cost.
``--upstream engine`` puts the real thing upstream instead: the embedded engine serving the
bundled SmolLM2-135M on this machine's CPU (start-up takes a minute; use fewer ``--calls``).
``--upstreams N`` puts N stubs (each its own process) behind the one ``LLM`` resource
(``base_url`` and ``upstreams``): the gateway spreads the attempts over them, one server per
attempt, and probes them; the direct phase spreads its connections over them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from bench_util import cpu_seconds, pct

from agentbolt.client import Client
from agentbolt.schemas import LLM, RolloutCreate, Task
from agentbolt.server import ServerConfig
from agentbolt.server.run import ServerProcess, free_port, wait_healthy

REQUEST = {
    "model": "bench",
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say OK."}],
    "max_tokens": 4,
}


# ---------------------------------------------------------------------------- the upstream


def _answer(body: dict, delay: float) -> bytes:
    extras = body.get("return_token_ids")
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "OK."},
        "finish_reason": "stop",
        "logprobs": {
            "content": [
                {"token": "OK", "logprob": -0.01, "bytes": [79, 75], "top_logprobs": []},
                {"token": ".", "logprob": -0.2, "bytes": [46], "top_logprobs": []},
            ]
        }
        if body.get("logprobs")
        else None,
    }
    if extras:
        choice["token_ids"] = [9906, 13]
    out = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": body.get("model"),
        "choices": [choice],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
    }
    if extras:
        out["prompt_token_ids"] = list(range(1, 13))
    return json.dumps(out).encode()


def _upstream_app(delay: float):
    async def app(scope, receive, send):  # a raw ASGI app: as little server-side cost as possible
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if delay:
            await asyncio.sleep(delay)
        payload = (
            _answer(json.loads(body or b"{}"), delay) if scope["method"] == "POST" else b'{"status":"ok"}'
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def _serve_upstream(port: int, delay: float) -> None:
    import uvicorn

    uvicorn.run(_upstream_app(delay), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------------------- a lean client


class Connection:
    """One keep-alive HTTP/1.1 connection; enough for JSON POSTs with a content-length answer.
    ``key``: the bearer token it sends (an attempt's agent key); ``idempotent``: each call
    carries an ``Idempotency-Key`` of its own and ``x-stainless-retry-count: 0``, as OpenAI's
    clients send."""

    def __init__(self, url: str, key: str | None = None, idempotent: bool = False) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.base = parts.hostname, parts.port, parts.path.rstrip("/")
        self.auth = f"authorization: Bearer {key}\r\n" if key else ""
        self.idempotent = idempotent
        self.calls = 0
        self.prefix = uuid.uuid4().hex  # keys unique across connections and runs
        self.call_ids = 0  # answers that named their record (X-Agentbolt-Call-Id)

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.calls += 1
        extra = (
            f"idempotency-key: {self.prefix}-{self.calls}\r\nx-stainless-retry-count: 0\r\n"
            if self.idempotent
            else ""
        )
        head = (
            f"POST {self.base}{path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n{self.auth}{extra}"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"x-agentbolt-call-id":
                self.call_ids += 1
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def _phase(
    targets: list[tuple[str, str | None]], calls: int, concurrency: int, idempotent: bool = False
) -> tuple[float, list[float], int]:
    """``calls`` POSTs spread over ``concurrency`` connections to ``targets`` (URL, bearer key);
    (seconds, latencies, answers that named their record)."""
    body = json.dumps(REQUEST).encode()
    conns = [
        await Connection(*targets[i % len(targets)], idempotent=idempotent).open() for i in range(concurrency)
    ]
    latencies: list[float] = []
    left = [calls]

    async def loop(conn: Connection) -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            status, _ = await conn.post("/chat/completions", body)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"HTTP {status} from {conn.base}")

    # warm up every connection (and the gateway's upstream pool) at once: one by one, a slow
    # upstream would let the first connections idle past the server's keep-alive timeout
    await asyncio.gather(*(conn.post("/chat/completions", body) for conn in conns))
    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for conn in conns:
        conn.close()
    return elapsed, latencies, sum(c.call_ids for c in conns)


def _gateway_targets(
    server_url: str, upstreams: list[str], n: int, token: str | None
) -> list[tuple[str, str | None]]:
    """``n`` running attempts, each with its own gateway URL and agent key (one per in-flight
    caller), as a runner hands them to its agents; ``upstreams``: the LLM resource's servers."""
    with Client(server_url, token=token) as client:
        llm = LLM(base_url=upstreams[0], upstreams=upstreams[1:], model="bench")
        client.publish_resources({"llm": llm})
        client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(n)])
        claims = [client.dequeue("bench", lease_seconds=3600) for _ in range(n)]
    llms = [c.resources.resources["llm"] for c in claims if c is not None and c.resources is not None]
    return [(llm.base_url, llm.api_key) for llm in llms if isinstance(llm, LLM)]


def _count_llm_calls(server_url: str, token: str | None) -> int:
    with Client(server_url, timeout=120, token=token) as client:
        return int(client.stats()["events"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--upstream-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--upstreams", type=int, default=1, metavar="N", help="N stubs behind the one LLM resource"
    )
    parser.add_argument(
        "--upstream",
        choices=["stub", "engine"],
        default="stub",
        help="stub: a minimal server that answers at once; engine: the embedded model engine",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="direct/gateway pairs, alternating; best of each"
    )
    parser.add_argument("--db", default="file", choices=["file", "memory"], help="the server's SQLite store")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="without the features a deployment runs with (an admin token configured, each agent "
        "calling with its attempt's agent key, an Idempotency-Key per call); on by default",
    )
    parser.add_argument("--quick", action="store_true", help="a short run: 1000 calls, 2 rounds")
    parser.add_argument(
        "--profile", metavar="PATH", help="write the server process's cProfile statistics here"
    )
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds = 1000, 2
    if args.upstreams < 1 or (args.upstreams > 1 and args.upstream == "engine"):
        parser.error("--upstreams takes a number from 1, and more than 1 only with the stub upstream")

    ports = [free_port() for _ in range(args.upstreams)]
    upstream_urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
    ups: list[multiprocessing.process.BaseProcess | subprocess.Popen] = []
    token = None if args.plain else secrets.token_urlsafe(24)
    try:
        for port in ports:
            if args.upstream == "engine":
                ups.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "agentbolt.cli.model", "serve", "--port", str(port)]
                        + ["--name", "bench"],
                        stdout=subprocess.DEVNULL,
                    )
                )
            else:
                ups.append(
                    multiprocessing.get_context("spawn").Process(
                        target=_serve_upstream, args=(port, args.upstream_delay_ms / 1000), daemon=True
                    )
                )
                ups[-1].start()
        for port in ports:
            wait_healthy(f"http://127.0.0.1:{port}", timeout=300 if args.upstream == "engine" else 30)
        with tempfile.TemporaryDirectory() as tmp:
            db = str(Path(tmp) / "bench.db") if args.db == "file" else ":memory:"
            # the call quota counted as deployed, set past what one attempt makes here (1 in flight
            # sends every call through one attempt)
            config = ServerConfig.with_token(token, db=db, quota_calls=10**9)
            server = ServerProcess(config, profile=args.profile).start()
            try:
                targets = _gateway_targets(server.url, upstream_urls, args.concurrency, token)
                if args.plain:
                    targets = [(url, None) for url, _ in targets]
                results: dict[str, list[tuple[float, list[float], int]]] = {"direct": [], "gateway": []}
                cpu = {"upstream": 0.0, "gateway": 0.0}
                assert server.process is not None and server.process.pid is not None
                direct: list[tuple[str, str | None]] = [(url, None) for url in upstream_urls]
                for _ in range(args.rounds):
                    results["direct"].append(asyncio.run(_phase(direct, args.calls, args.concurrency)))
                    before = cpu_seconds(server.process.pid), sum(cpu_seconds(u.pid) for u in ups)
                    results["gateway"].append(
                        asyncio.run(_phase(targets, args.calls, args.concurrency, idempotent=not args.plain))
                    )
                    cpu["gateway"] += cpu_seconds(server.process.pid) - before[0]
                    cpu["upstream"] += sum(cpu_seconds(u.pid) for u in ups) - before[1]
                recorded = _count_llm_calls(server.url, token)
            finally:
                server.stop()
    finally:  # the engines are separate processes: never leave one running
        for up in ups:
            up.terminate()
            up.wait(30) if isinstance(up, subprocess.Popen) else up.join(5)

    summary = {}
    upstream = (
        "the embedded engine (SmolLM2-135M, CPU)"
        if args.upstream == "engine"
        else (f"a stub answering after {args.upstream_delay_ms:g} ms")
    )
    if args.upstreams > 1:
        upstream = f"{args.upstreams} x {upstream}, behind one LLM resource"
    features = (
        "plain (no tokens, no agent keys, no idempotency keys)"
        if args.plain
        else "admin token configured, agent key per attempt, Idempotency-Key per call"
    )
    print(
        f"{args.calls} chat calls x {args.rounds} rounds, {args.concurrency} in flight, upstream: {upstream}"
    )
    print(f"  gateway features: {features}")
    for name, runs in results.items():
        elapsed, lat, _ = min(runs, key=lambda r: r[0])  # the best round: least disturbed by other load
        summary[name] = (args.calls / elapsed, pct(lat, 50), pct(lat, 99))
        print(
            f"  {name:8s} {summary[name][0]:8.0f} calls/s   p50 {summary[name][1]:6.2f} ms   p99 {summary[name][2]:6.2f} ms"
        )
    added50 = summary["gateway"][1] - summary["direct"][1]
    added99 = summary["gateway"][2] - summary["direct"][2]
    ratio = summary["gateway"][0] / summary["direct"][0]
    print(f"  added latency per call: p50 {added50:.2f} ms, p99 {added99:.2f} ms")
    print(f"  throughput ratio gateway/direct: {ratio:.2f}x")
    n = (args.calls + args.concurrency) * args.rounds
    print(
        f"  gateway CPU per call (server process, user+sys / calls): {cpu['gateway'] / n * 1000:.3f} ms"
        f"   [upstream stub process{'es' if args.upstreams > 1 else ''}: {cpu['upstream'] / n * 1000:.3f} ms]"
    )
    named = sum(r[2] for r in results["gateway"])
    print(
        f"  llm_call events recorded: {recorded} (expected {n}) {'ok' if recorded == n else 'MISMATCH'}; "
        f"answers naming their record (X-Agentbolt-Call-Id): {named}/{n}"
    )
    if recorded != n or named != n:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
