"""A lean HTTP/1.1 keep-alive transport for httpx, for plain-http loopback and cluster traffic:
the runners' calls to the server and the gateway's calls to upstream model servers.

Why not httpx's default transport: measured here with 32 calls in flight, httpcore's pool cost
1.4-3.8 ms of CPU per request (it scans and polls every pooled connection on each one), which
capped the whole gateway near 200 calls/s (and a benchmark client's CPU, not the server's,
was what limited store throughput). This transport keeps idle connections on a LIFO
stack per origin and costs tens of microseconds. It is injected as an httpx transport (the
client API, timeouts and errors stay httpx's) and only mounted for ``http://``; ``https://``
upstreams keep httpx's default transport (TLS, HTTP/2, proxies).

Scope: HTTP/1.1 requests with a known body; responses framed by content-length, chunked
transfer encoding or connection close. Interim answers (``100 Continue``, ``103 Early Hints``)
are skipped: the final answer follows them on the same connection.

Sent at most once: a reused keep-alive connection may turn out closed by the server. If it
failed before the whole request was written, the server cannot have acted on it, and it is
sent again on another connection (a fresh connection failing so raises ``httpx.WriteError``:
nothing reached the server, the caller may send it anywhere). Once written, the server may have processed it before the
connection dropped, so it is sent again only when that is harmless: a safe method (GET, HEAD,
OPTIONS, TRACE) or a request carrying an ``Idempotency-Key`` (the server answers a repeated key
with its first result). Otherwise the error goes to the caller, whose retry policy decides.

At most ``max_connections`` connections are open per transport, idle ones included; a caller
beyond that waits for one (httpx's ``pool`` timeout), and takes an idle connection to another
origin if there is one.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["IDEMPOTENCY_KEY", "Answer", "Http1Transport", "lean_mounts"]

IDEMPOTENCY_KEY = "Idempotency-Key"
"""The header naming one logical write: every retry of it carries the same value."""

_NO_BODY = {204, 304}
# RFC 9110 safe methods: a repeat changes nothing on the server.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

Origin = tuple[str, int]


class _Conn:
    def __init__(self, origin: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.origin, self.reader, self.writer = origin, reader, writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class Answer:
    """A whole answer read by :meth:`Http1Transport.request`: status, headers (names in lower
    case, as sent) and body."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    def header(self, name: bytes) -> str | None:
        """The first value of the header ``name`` (lower case), if it was sent."""
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None


class _Unanswered(Exception):
    """The connection dropped before any byte of the answer; ``written``: whether the whole
    request had reached the socket (so the server may have acted on it)."""

    def __init__(self, written: bool) -> None:
        super().__init__()
        self.written = written


async def _within(
    seconds: float | None, awaitable: Any, request: httpx.Request | None, kind: type[httpx.TimeoutException]
) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        raise kind(f"no answer within {seconds} s", request=request) from None


class _Pool:
    """The open connections of one transport: idle ones on a LIFO stack per origin, and the
    callers waiting because ``max_connections`` are open. Every open connection holds one
    slot; a slot freed while callers wait passes to the first of them."""

    def __init__(self, max_connections: int, max_idle_per_origin: int, keepalive_expiry: float) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections, self.max_idle, self.expiry = (
            max_connections,
            max_idle_per_origin,
            keepalive_expiry,
        )
        self.open = 0
        self.idle: dict[Origin, list[_Conn]] = {}
        # Each waiter's future gets a connection to its origin, or None: a slot to open one with.
        self.waiters: collections.deque[tuple[Origin, asyncio.Future[_Conn | None]]] = collections.deque()

    async def acquire(self, origin: Origin, request: httpx.Request | None, timeouts: dict[str, Any]) -> _Conn:
        conn = self._reuse(origin)
        if conn is not None:
            return conn
        if not self._take_slot():
            conn = await self._wait(origin, request, timeouts.get("pool"))
            if conn is not None:
                return conn
        try:
            reader, writer = await _within(
                timeouts.get("connect"), asyncio.open_connection(*origin), request, httpx.ConnectTimeout
            )
        except OSError as exc:
            self._free_slot()
            raise httpx.ConnectError(
                f"cannot connect to {origin[0]}:{origin[1]}: {exc}", request=request
            ) from exc
        except BaseException:
            self._free_slot()
            raise
        return _Conn(origin, reader, writer)

    def _reuse(self, origin: Origin) -> _Conn | None:
        idle = self.idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable() and now - conn.idle_since < self.expiry:
                conn.reused = True
                return conn
            self.discard(conn)
        return None

    def _take_slot(self) -> bool:
        """Claim a slot for a new connection: a free one, or an idle connection's (closed)."""
        if self.open < self.max_connections:
            self.open += 1
            return True
        for idle in self.idle.values():
            if idle:
                idle.pop(0).close()  # the oldest: its slot passes to the caller
                return True
        return False

    async def _wait(
        self, origin: Origin, request: httpx.Request | None, timeout: float | None
    ) -> _Conn | None:
        waiter: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
        entry = (origin, waiter)
        self.waiters.append(entry)
        try:
            return await _within(timeout, waiter, request, httpx.PoolTimeout)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._pass_on(waiter.result())  # handed over just as this caller gave up
            else:
                waiter.cancel()
                self.waiters.remove(entry)
            raise

    def _pass_on(self, conn: _Conn | None) -> None:
        if conn is None:
            self._free_slot()
        else:
            self.release(conn)

    def _next_waiter(self, origin: Origin | None) -> asyncio.Future[_Conn | None] | None:
        """The first waiter still waiting (for ``origin`` only, unless None), taken off the queue."""
        for entry in self.waiters:
            if origin is None or entry[0] == origin:
                self.waiters.remove(entry)
                return entry[1]
        return None

    def release(self, conn: _Conn) -> None:
        """A connection whose exchange ended cleanly: to a waiter for its origin, else idle
        (its slot to a waiter for another origin, if any)."""
        if not conn.usable():
            self.discard(conn)
            return
        waiter = self._next_waiter(conn.origin)
        if waiter is not None:
            conn.reused = True
            waiter.set_result(conn)
            return
        idle = self.idle.setdefault(conn.origin, [])
        if self.waiters or len(idle) >= self.max_idle:
            self.discard(conn)
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def discard(self, conn: _Conn) -> None:
        conn.close()
        self._free_slot()

    def _free_slot(self) -> None:
        waiter = self._next_waiter(None)
        if waiter is not None:
            waiter.set_result(None)  # the slot passes on: ``open`` stays the same
        else:
            self.open -= 1

    def close_idle(self) -> None:
        for idle in self.idle.values():
            for conn in idle:
                self.discard(conn)
        self.idle.clear()


class _Body(httpx.AsyncByteStream):
    """A response body read from the connection; the connection goes back to the pool once the
    body was read to its end and both sides allow keep-alive."""

    def __init__(
        self,
        pool: _Pool,
        conn: _Conn,
        request: httpx.Request | None,
        headers: list[tuple[bytes, bytes]],
        no_body: bool,
        timeout: float | None,
    ) -> None:
        self.pool, self.conn, self.request, self.timeout = pool, conn, request, timeout
        self.status, self.headers = 0, headers
        chunked, length, close = False, None, False
        for name, value in headers:  # names are lower case (see _read_head)
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = value
            elif name == b"connection":
                close = value.lower() == b"close"
        self.chunked = chunked
        self.length = 0 if no_body else (int(length) if length is not None and not chunked else None)
        self.reusable = not close and (chunked or self.length is not None)
        self.complete = False

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool (or is closed)."""
        try:
            if not self.chunked and self.length is not None:  # the usual case: one read
                content = await self._read(self.conn.reader.readexactly(self.length)) if self.length else b""
                self.complete = True
                return content
            return b"".join([chunk async for chunk in self])
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise httpx.ReadError(f"reading the response failed: {exc!r}", request=self.request) from exc
        finally:
            await self.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self.conn.reader
        try:
            if self.chunked:
                while True:
                    size = int((await self._read(reader.readline())).split(b";")[0], 16)
                    if size == 0:
                        while (await self._read(reader.readline())) not in (b"\r\n", b""):
                            pass  # trailers
                        break
                    yield (await self._read(reader.readexactly(size + 2)))[:-2]
            elif self.length:
                yield await self._read(reader.readexactly(self.length))
            elif self.length is None:
                while data := await self._read(reader.read(1 << 16)):
                    yield data
            self.complete = True
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            raise httpx.ReadError(f"reading the response failed: {exc!r}", request=self.request) from exc

    async def _read(self, awaitable: Any) -> bytes:
        if self.timeout is None:
            return await awaitable
        return await _within(self.timeout, awaitable, self.request, httpx.ReadTimeout)

    async def aclose(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if self.complete and self.reusable:
            self.pool.release(conn)
        else:
            self.pool.discard(conn)


def lean_mounts(transport: Http1Transport) -> dict[str, httpx.AsyncBaseTransport] | None:
    """httpx ``mounts`` sending plain-http requests through ``transport``; None (httpx's own
    transport for everything) when the environment names an http proxy, which it would bypass."""
    return None if urllib.request.getproxies().get("http") else {"http://": transport}


def _resendable(request: httpx.Request) -> bool:
    """Whether sending ``request`` twice does no harm (see the module docstring)."""
    return request.method in _SAFE_METHODS or IDEMPOTENCY_KEY in request.headers


class Http1Transport(httpx.AsyncBaseTransport):
    def __init__(
        self, max_connections: int = 64, max_idle_per_origin: int = 256, keepalive_expiry: float = 4.0
    ) -> None:
        """``keepalive_expiry``: an idle connection older than this is closed, not reused. Under
        uvicorn's 5 s keep-alive timeout (the agentbolt server, its model engine and vLLM all
        run on uvicorn), so a request seldom meets a connection the server is closing: one
        without a key would not be sent again."""
        self._pool = _Pool(max_connections, max_idle_per_origin, keepalive_expiry)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"Http1Transport speaks plain http, not {request.url.scheme}", request=request
            )
        origin = (request.url.host, request.url.port or 80)
        payload = self._head(request) + await request.aread()
        timeouts = request.extensions.get("timeout", {})
        stream = await self._send(origin, payload, request.method, _resendable(request), timeouts, request)
        return httpx.Response(
            stream.status, headers=stream.headers, stream=stream, extensions={"http_version": b"HTTP/1.1"}
        )

    async def request(
        self,
        method: str,
        origin: Origin,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes,
        timeouts: dict[str, Any],
        resendable: bool = False,
    ) -> Answer:
        """Send one request and read its whole answer, without httpx's request and response
        objects (their construction costs more than the exchange): for callers on the hot path
        (the gateway's upstream calls, the runner's calls to the server). ``headers`` are sent
        as given, after ``host`` and ``content-length``; ``resendable``: whether a request the
        server may have received may be sent again (see the module docstring). Raises httpx's
        errors, as the transport does. The read timeout bounds the whole answer (not each read,
        as httpx's does): a whole answer comes at once, after the model is done."""
        host = origin[0].encode() if origin[1] == 80 else b"%s:%d" % (origin[0].encode(), origin[1])
        lines = [b"%s %s HTTP/1.1" % (method.encode(), target), b"host: " + host]
        lines += [b"%s: %s" % header for header in headers]
        lines.append(b"content-length: %d" % len(content))
        payload = b"\r\n".join(lines) + b"\r\n\r\n" + content
        resend = resendable or method in _SAFE_METHODS
        read = timeouts.get("read")
        if read is None:
            return await self._whole(origin, payload, method, resend, timeouts)
        # one deadline for the whole answer rather than one per read (each costs a timer)
        exchange = self._whole(origin, payload, method, resend, {**timeouts, "read": None})
        return await _within(read, exchange, None, httpx.ReadTimeout)

    async def _whole(
        self, origin: Origin, payload: bytes, method: str, resendable: bool, timeouts: dict[str, Any]
    ) -> Answer:
        body = await self._send(origin, payload, method, resendable, timeouts, None)
        return Answer(body.status, body.headers, await body.read())

    async def _send(
        self,
        origin: Origin,
        payload: bytes,
        method: str,
        resendable: bool,
        timeouts: dict[str, Any],
        request: httpx.Request | None,
    ) -> _Body:
        while True:
            conn = await self._pool.acquire(origin, request, timeouts)
            try:
                status, headers = await self._exchange(conn, payload, request, timeouts)
            except _Unanswered as exc:
                self._pool.discard(conn)
                # A stale keep-alive connection: another one is fresh, or less likely stale.
                if conn.reused and (not exc.written or resendable):
                    continue
                if not exc.written:  # a fresh connection that failed mid-write
                    raise httpx.WriteError(_UNSENT, request=request) from None
                raise httpx.RemoteProtocolError(_unanswered_message(conn), request=request) from None
            except BaseException:
                self._pool.discard(conn)
                raise
            no_body = method == "HEAD" or status in _NO_BODY or status < 200
            body = _Body(self._pool, conn, request, headers, no_body, timeouts.get("read"))
            body.status = status
            return body

    @staticmethod
    def _head(request: httpx.Request) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
        lines += [b"%s: %s" % (k, v) for k, v in request.headers.raw]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _exchange(
        self, conn: _Conn, payload: bytes, request: httpx.Request | None, timeouts: dict[str, Any]
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        await _write(conn, payload, request, timeouts.get("write"))
        status, headers = await _read_head(conn, request, timeouts.get("read"))
        while 100 <= status < 200 and status != 101:  # interim: the final answer follows
            try:
                status, headers = await _read_head(conn, request, timeouts.get("read"))
            except _Unanswered:
                raise httpx.RemoteProtocolError(
                    f"connection closed after an interim {status} answer", request=request
                ) from None
        return status, headers

    async def aclose(self) -> None:
        self._pool.close_idle()


_UNSENT = "the connection failed before the whole request was written: the server cannot have acted on it"


def _unanswered_message(conn: _Conn) -> str:
    if not conn.reused:
        return "the server closed the connection without answering"
    return (
        "the server closed a kept-alive connection without answering; the request may have been "
        f"processed, so it is not sent again (not a safe method and no {IDEMPOTENCY_KEY} header)"
    )


async def _write(conn: _Conn, payload: bytes, request: httpx.Request | None, timeout: float | None) -> None:
    """Hand the whole request to the socket; :class:`_Unanswered` (not written) if it fails."""
    try:
        conn.writer.write(payload)
        # A failed send closes the transport at once (write() itself never raises): the
        # server got part of the request at most.
        if conn.writer.is_closing():
            raise _Unanswered(written=False)
        if conn.writer.transport.get_write_buffer_size():
            await _within(timeout, conn.writer.drain(), request, httpx.WriteTimeout)
    except ConnectionError:
        raise _Unanswered(written=False) from None


async def _read_head(
    conn: _Conn, request: httpx.Request | None, timeout: float | None
) -> tuple[int, list[tuple[bytes, bytes]]]:
    """The status and the headers (names in lower case) of the next answer."""
    try:
        until = conn.reader.readuntil(b"\r\n\r\n")
        head = await (until if timeout is None else _within(timeout, until, request, httpx.ReadTimeout))
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise _Unanswered(written=True) from None
        raise httpx.RemoteProtocolError("connection closed in the response head", request=request) from None
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError("response head too large", request=request) from None
    except ConnectionError:
        raise _Unanswered(written=True) from None
    first, *lines = head.split(b"\r\n")
    try:
        status = int(first.split(None, 2)[1])
    except (IndexError, ValueError):
        raise httpx.RemoteProtocolError(f"malformed status line {first[:80]!r}", request=request) from None
    raw = []
    for line in lines:
        if line:
            name, _, value = line.partition(b":")
            raw.append((name.strip().lower(), value.strip()))
    return status, raw
