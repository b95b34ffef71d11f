"""The runner's OpenAI clients: plain-http calls go through the lean keep-alive transport, with
the SDK's behaviour kept (answers, streaming, timeouts and connection errors as its own errors)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from agentbolt.http1 import Http1Transport
from agentbolt.runner.llm import _async_pools, async_openai
from agentbolt.schemas import LLM


def _answer(content: str) -> bytes:
    return json.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
        }
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[int] = []  # noqa: RUF012 - the client ports of the requests, shared by the test

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _Handler.seen.append(self.client_address[1])
        prompt = body["messages"][0]["content"]
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(3):
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
                }
                data = f"data: {json.dumps(chunk)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.3)
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            return
        if prompt == "slow":
            time.sleep(1.5)
        out = _answer(f"echo {prompt}")
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def llm() -> Iterator[LLM]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Handler.seen.clear()
    try:
        yield LLM(base_url=f"http://127.0.0.1:{server.server_port}/v1", model="m")
    finally:
        server.shutdown()
        server.server_close()


def _ask(llm: LLM, prompt: str, **kwargs: object) -> object:
    return async_openai(llm, **kwargs).chat.completions.create(  # type: ignore[arg-type]
        model="m", messages=[{"role": "user", "content": prompt}]
    )


def test_plain_http_goes_through_the_lean_transport_and_reuses_connections(llm: LLM) -> None:
    async def main() -> list[str]:
        first = await _ask(llm, "a")
        pool = _async_pools[asyncio.get_running_loop()]
        transport = pool._transport_for_url(pool._merge_url(llm.base_url))  # what http:// is sent with
        lean = transport if isinstance(transport, Http1Transport) else getattr(transport, "_transport", None)
        assert isinstance(lean, Http1Transport)
        rest = await asyncio.gather(*[_ask(llm, str(i)) for i in range(8)])
        again = await _ask(llm, "b")
        return [r.choices[0].message.content for r in [first, *rest, again]]  # type: ignore[attr-defined]

    assert asyncio.run(main()) == ["echo a", *[f"echo {i}" for i in range(8)], "echo b"]
    # at most one connection per call in flight: the later calls reused kept-alive ones
    assert len(set(_Handler.seen)) <= 9 < len(_Handler.seen)


def test_streamed_answers_arrive_as_they_are_sent(llm: LLM) -> None:
    async def main() -> list[tuple[str, float]]:
        stream = await async_openai(llm).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "s"}], stream=True
        )
        t0 = time.monotonic()
        return [(chunk.choices[0].delta.content, time.monotonic() - t0) async for chunk in stream]

    got = asyncio.run(main())
    assert [text for text, _ in got] == ["t0", "t1", "t2"]
    assert got[0][1] < 0.25 < got[2][1]  # the first chunk came before the server sent the last


def test_timeouts_and_refused_connections_are_the_sdks_errors(llm: LLM) -> None:
    async def main() -> tuple[type, type]:
        errors = []
        for target, prompt in ((llm, "slow"), (LLM(base_url="http://127.0.0.1:9/v1", model="m"), "x")):
            try:
                await _ask(target, prompt, timeout=0.3)
            except openai.APIError as exc:
                errors.append(type(exc))
        return errors[0], errors[1]

    timed_out, refused = asyncio.run(main())
    assert timed_out is openai.APITimeoutError
    assert refused is openai.APIConnectionError
