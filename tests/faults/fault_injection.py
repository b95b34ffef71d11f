"""Faults between a real client and the real server on 127.0.0.1.

One :class:`Plan` decides, request by request, which delivery gets a fault: the first
delivery of each logical call to the endpoint under test (a retry of that call passes). A
logical call is named by its ``Idempotency-Key`` when it has one, else by its method, path and
body (a client retry resends the same bytes). Two injectors read the plan:

- :class:`DropTransport` / :class:`AsyncDropTransport`, httpx transports given to agentbolt's
  ``Client`` / ``AsyncClient``: they forward the request, read the whole answer (the server has
  committed), and raise ``httpx.ReadError`` instead of returning it;
- :class:`FaultProxy`, a TCP proxy on 127.0.0.1 that frames HTTP/1.1 with h11, for any client
  (agentbolt's, a program agent's, the ``openai`` SDK, the OTLP exporter), with four faults:

  ``drop``: forward, read the whole answer, then reset the client's connection;
  ``delay``: hold the request while the client times out, deliver it ``delay`` seconds after it
  came (after the client's retry, usually), and throw the answer away;
  ``reset``: forward, then send the answer's head and one byte of its body, and reset;
  ``duplicate``: deliver the request twice at once, on two connections; the client gets the
  answer of the first.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
import struct
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import h11
import httpx

from agentbolt.http1 import Http1Transport

__all__ = [
    "ENDPOINTS",
    "FAULTS",
    "AsyncDropTransport",
    "DropTransport",
    "FaultProxy",
    "Plan",
    "endpoint_of",
]

FAULTS = ("drop", "delay", "reset", "duplicate")
# Every mutating endpoint, by method and path.
ENDPOINTS: dict[str, re.Pattern[str]] = {
    name: re.compile(pattern)
    for name, pattern in {
        "enqueue": r"POST /api/rollouts",
        "dequeue": r"POST /api/dequeue",
        "heartbeat": r"POST /api/attempts/[^/]+/heartbeat",
        "events": r"POST /api/attempts/[^/]+/events",
        "agent_events": r"POST /agent/[^/]+/[^/]+/events",
        "finish": r"POST /api/attempts/[^/]+/finish",
        "cancel": r"POST /api/rollouts/[^/]+/cancel",
        "publish": r"POST /api/resources",
        "otlp": r"POST /v1/traces",
        "gateway": r"POST /gateway/[^/]+/[^/]+/v1/chat/completions",
    }.items()
}
KEY_HEADER = "idempotency-key"
T = TypeVar("T")


def endpoint_of(method: str, path: str) -> str | None:
    request = f"{method.upper()} {path.split('?', 1)[0]}"
    return next((name for name, pattern in ENDPOINTS.items() if pattern.fullmatch(request)), None)


@dataclass
class Plan:
    """Faults of one ``kind`` on the first delivery of each logical call to ``endpoint``."""

    endpoint: str | None
    kind: str
    injected: int = 0
    deliveries: Counter[str] = field(default_factory=Counter)
    """Requests that reached an injector, per endpoint (retries and duplicates included)."""
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fault_for(self, method: str, path: str, key: str | None, body: bytes) -> str | None:
        endpoint = endpoint_of(method, path)
        call = key or hashlib.sha256(f"{method} {path}\n".encode() + body).hexdigest()
        with self._lock:
            if endpoint is not None:
                self.deliveries[endpoint] += 1
            if endpoint is None or endpoint != self.endpoint or call in self._seen:
                return None
            self._seen.add(call)
            self.injected += 1
            return self.kind


def _dropped(request: httpx.Request) -> httpx.ReadError:
    return httpx.ReadError("fault injected: the answer was dropped after the server sent it", request=request)


class DropTransport(httpx.BaseTransport):
    """For ``Client``: the answers that ``plan`` picks are read, then lost on the way back."""

    def __init__(self, plan: Plan, inner: httpx.BaseTransport | None = None) -> None:
        assert plan.kind == "drop", "a transport only drops; the proxy does the other faults"
        self.plan, self.inner = plan, inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        fault = self.plan.fault_for(request.method, request.url.path, request.headers.get(KEY_HEADER), body)
        response = self.inner.handle_request(request)
        if fault is None:
            return response
        response.read()
        response.close()
        raise _dropped(request)

    def close(self) -> None:
        self.inner.close()


class AsyncDropTransport(httpx.AsyncBaseTransport):
    """For ``AsyncClient``, around its own lean HTTP/1.1 transport: as :class:`DropTransport`."""

    def __init__(self, plan: Plan, inner: httpx.AsyncBaseTransport | None = None) -> None:
        assert plan.kind == "drop", "a transport only drops; the proxy does the other faults"
        self.plan, self.inner = plan, inner or Http1Transport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        fault = self.plan.fault_for(request.method, request.url.path, request.headers.get(KEY_HEADER), body)
        response = await self.inner.handle_async_request(request)
        if fault is None:
            return response
        await response.aread()
        await response.aclose()
        raise _dropped(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# ---------------------------------------------------------------------------- the proxy


@dataclass
class _Message:
    """A whole HTTP message: its head (an h11 Request or Response) and its body."""

    head: h11.Request | h11.Response
    body: bytes

    def header(self, name: bytes) -> str | None:
        return next((v.decode("latin-1") for k, v in self.head.headers if k == name), None)


async def _read_message(conn: h11.Connection, reader: asyncio.StreamReader) -> _Message | None:
    """The next message on ``conn``; None when the peer closed between messages."""
    head: h11.Request | h11.Response | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.ConnectionClosed):
            return None
        elif isinstance(event, h11.Request | h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return _Message(head, bytes(body))
        # an InformationalResponse (1xx) is not the answer: read on


class _Upstream:
    """One connection from the proxy to the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)
        self.reusable = True

    @classmethod
    async def open(cls, port: int) -> _Upstream:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def exchange(self, request: _Message) -> _Message:
        head = request.head
        assert isinstance(head, h11.Request)
        data = self.conn.send(h11.Request(method=head.method, target=head.target, headers=list(head.headers)))
        if request.body:
            data += self.conn.send(h11.Data(data=request.body))
        data += self.conn.send(h11.EndOfMessage())
        self.writer.write(data)
        await self.writer.drain()
        response = await _read_message(self.conn, self.reader)
        if response is None:
            raise ConnectionError("the server closed the connection without answering")
        self.reusable = self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE
        if self.reusable:
            self.conn.start_next_cycle()
        return response

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


def _answer(conn: h11.Connection, response: _Message) -> bytes:
    """``response`` as ``conn`` (the client's side) sends it: head, body, end."""
    head = response.head
    assert isinstance(head, h11.Response)
    data = conn.send(
        h11.Response(status_code=head.status_code, headers=list(head.headers), reason=head.reason)
    )
    if response.body:
        data += conn.send(h11.Data(data=response.body))
    return data + conn.send(h11.EndOfMessage())


async def _reset(writer: asyncio.StreamWriter, sent: bytes) -> None:
    """Send ``sent``, then reset the connection (RST, not a clean close)."""
    if sent:
        writer.write(sent)
        await writer.drain()
        await asyncio.sleep(0.05)  # let the client read what came before the reset lands
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """A TCP proxy in front of the server on 127.0.0.1, in its own thread and event loop."""

    HOLD_LIMIT = 60.0  # seconds a delayed request's client may keep its connection open

    def __init__(self, server_port: int, plan: Plan, delay: float = 1.5) -> None:
        self.server_port, self.plan, self.delay = server_port, plan, delay
        self.port = 0
        self.connections = 0
        """Client connections accepted."""
        self.extra: list[int | str] = []
        """What the extra deliveries (delayed originals, duplicates) got: a status or an error."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def settle(self, timeout: float = 30.0) -> None:
        """Wait for the delayed and duplicate deliveries still under way."""
        self._run(self._extra_done(), timeout)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the proxy's loop, from the test's thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _extra_done(self) -> None:
        while pending := [t for t in self._tasks if t.get_name().startswith("extra")]:
            await asyncio.wait(pending)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.connections += 1
        upstream: _Upstream | None = None
        try:
            upstream = await self._relay(reader, writer)
        except (ConnectionError, h11.RemoteProtocolError, h11.LocalProtocolError):
            pass  # a client or server that went away: its retry comes on a new connection
        finally:
            if upstream is not None:
                await upstream.close()
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Upstream | None:
        """Pass requests and answers until either side closes or a fault ends the connection;
        return the upstream connection to close."""
        client = h11.Connection(h11.SERVER)
        upstream: _Upstream | None = None
        while (request := await _read_message(client, reader)) is not None:
            head = request.head
            assert isinstance(head, h11.Request)
            method, path = head.method.decode(), head.target.decode()
            fault = self.plan.fault_for(method, path, request.header(KEY_HEADER.encode()), request.body)
            if fault == "delay":
                self._extra(request, after=self.delay)
                await _until_closed(reader, self.HOLD_LIMIT)
                return upstream
            if upstream is None or not upstream.reusable:
                if upstream is not None:
                    await upstream.close()
                upstream = await _Upstream.open(self.server_port)
            if fault == "duplicate":
                self._extra(request, after=0.0)
            response = await upstream.exchange(request)
            if fault in ("drop", "reset"):
                answer = _answer(client, response)
                await _reset(writer, answer[: _head_length(answer) + 1] if fault == "reset" else b"")
                return upstream
            writer.write(_answer(client, response))
            await writer.drain()
            if client.our_state is not h11.DONE or client.their_state is not h11.DONE:
                return upstream
            client.start_next_cycle()
        return upstream

    def _extra(self, request: _Message, after: float) -> None:
        """Deliver ``request`` once more on its own connection, ``after`` seconds from now."""
        task = self._track(self._deliver(request, after))
        task.set_name(f"extra-{id(task)}")

    async def _deliver(self, request: _Message, after: float) -> None:
        await asyncio.sleep(after)
        try:
            upstream = await _Upstream.open(self.server_port)
            try:
                response = await upstream.exchange(request)
            finally:
                await upstream.close()
            head = response.head
            assert isinstance(head, h11.Response)
            self.extra.append(head.status_code)
        except Exception as exc:  # recorded: a test shows what the extra delivery met
            self.extra.append(f"{type(exc).__name__}: {exc}")


def _head_length(answer: bytes) -> int:
    return answer.index(b"\r\n\r\n") + 4


async def _until_closed(reader: asyncio.StreamReader, limit: float) -> None:
    """Read and discard until the client closes (it gave up on a delayed answer)."""
    try:
        async with asyncio.timeout(limit):
            while await reader.read(65536):
                pass
    except TimeoutError:
        pass
