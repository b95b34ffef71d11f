"""``agentbolt model serve`` as a process: the forward passes on the main thread, HTTP beside them,
a graceful SIGTERM, and a clear exit when the port is taken."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(tiny_dir: Path, port: int, *extra: str) -> Iterator[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "agentbolt.cli.model", "serve", "--model", str(tiny_dir)]
    cmd += ["--port", str(port), "--dtype", "float32", "--device", "cpu", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _wait_up(proc: subprocess.Popen[str], port: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.25)
    raise AssertionError("agentbolt model serve did not answer /health")


def test_serve_runs_the_engine_on_the_main_thread_and_sigterm_lets_a_stream_finish(tiny_dir: Path) -> None:
    port = _free_port()
    with _serve(tiny_dir, port) as proc:
        health = _wait_up(proc, port)
        assert health["loop_thread"] == "MainThread"  # see ModelEngine.run_here
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        chunks: list[dict] = []
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60
        ) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    proc.send_signal(signal.SIGTERM)  # the stream is in flight: it must still finish
        finishes = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
        assert finishes[-1] == "length"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text
        assert proc.wait(30) == 0
        with httpx.Client() as client:  # and it is gone
            try:
                client.get(f"http://127.0.0.1:{port}/health", timeout=2)
                raise AssertionError("still answering after SIGTERM")
            except httpx.ConnectError:
                pass


def test_serve_exits_with_a_message_when_the_port_is_taken(tiny_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with _serve(tiny_dir, port) as proc:
            code = proc.wait(120)  # no hang: the engine's loop ends with the HTTP server
            out = proc.stdout.read() if proc.stdout else ""
    assert code == 1
    assert f"did not start on 127.0.0.1:{port}" in out
    assert "Traceback" not in out


def test_serve_hands_idle_memory_back_and_runs_the_kernel_unless_told_not_to(tiny_dir: Path) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    releases, attention = {}, {}
    for extra in ((), ("--no-release-idle-memory", "--no-kernels")):
        port = _free_port()
        with _serve(tiny_dir, port, *extra) as proc:
            _wait_up(proc, port)
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 200
            deadline = time.monotonic() + (1.5 if extra else 10)  # kept: three idle waits of the loop
            while True:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                if health["idle_releases"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            releases[extra] = health["idle_releases"]
            attention[extra] = (health["attention"], health["attention_note"])
    assert list(releases.values()) == [1, 0]
    assert list(attention.values()) == [("kernel", ""), ("torch", "switched off (kernels=False)")]
