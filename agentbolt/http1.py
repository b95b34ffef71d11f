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
transfer encoding or connection close. A request whose reused keep-alive connection turns out
closed by the server before any response byte is sent once more on a fresh connection (the
server never answered it), as urllib3 and httpcore do.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["Http1Transport", "lean_mounts"]

_NO_BODY = {204, 304}


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class _Stale(Exception):
    """The server closed a reused connection without answering."""


async def _within(
    seconds: float | None, awaitable: Any, request: httpx.Request, kind: type[httpx.TimeoutException]
) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        raise kind(f"no answer within {seconds} s", request=request) from None


class _Body(httpx.AsyncByteStream):
    """A response body read from the connection; the connection goes back to the pool once the
    body was read to its end and both sides allow keep-alive."""

    def __init__(
        self,
        transport: Http1Transport,
        origin: tuple[str, int],
        conn: _Conn,
        request: httpx.Request,
        headers: httpx.Headers,
        no_body: bool,
    ) -> None:
        self.transport, self.origin, self.conn, self.request = transport, origin, conn, request
        self.timeout = request.extensions.get("timeout", {}).get("read")
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.length = 0 if no_body else (int(length) if length is not None and not self.chunked else None)
        self.reusable = headers.get("connection", "").lower() != "close" and (
            self.chunked or self.length is not None
        )
        self.complete = False

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
        return await _within(self.timeout, awaitable, self.request, httpx.ReadTimeout)  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        if self.conn is None:
            return
        conn, self.conn = self.conn, None  # type: ignore[assignment]
        if self.complete and self.reusable:
            self.transport._release(self.origin, conn)
        else:
            conn.close()


def lean_mounts(transport: Http1Transport) -> dict[str, httpx.AsyncBaseTransport] | None:
    """httpx ``mounts`` sending plain-http requests through ``transport``; None (httpx's own
    transport for everything) when the environment names an http proxy, which it would bypass."""
    return None if urllib.request.getproxies().get("http") else {"http://": transport}


class Http1Transport(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_origin: int = 256, keepalive_expiry: float = 60.0) -> None:
        self.max_idle, self.expiry = max_idle_per_origin, keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"Http1Transport speaks plain http, not {request.url.scheme}", request=request
            )
        origin = (request.url.host, request.url.port or 80)
        payload = self._head(request) + await request.aread()
        timeouts = request.extensions.get("timeout", {})
        while True:
            conn, reused = await self._acquire(origin, request, timeouts.get("connect"))
            try:
                status, headers = await self._exchange(conn, payload, request, timeouts)
            except _Stale:
                conn.close()
                if reused:
                    continue  # the server closed it while idle: it never saw this request
                raise httpx.RemoteProtocolError(
                    "server closed the connection without answering", request=request
                ) from None
            except BaseException:
                conn.close()
                raise
            no_body = request.method == "HEAD" or status in _NO_BODY or status < 200
            stream = _Body(self, origin, conn, request, headers, no_body)
            return httpx.Response(
                status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"}
            )

    @staticmethod
    def _head(request: httpx.Request) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
        lines += [b"%s: %s" % (k, v) for k, v in request.headers.raw]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _exchange(
        self, conn: _Conn, payload: bytes, request: httpx.Request, timeouts: dict[str, Any]
    ) -> tuple[int, httpx.Headers]:
        try:
            conn.writer.write(payload)
            if conn.writer.transport.get_write_buffer_size():
                await _within(timeouts.get("write"), conn.writer.drain(), request, httpx.WriteTimeout)
            head = await _within(
                timeouts.get("read"), conn.reader.readuntil(b"\r\n\r\n"), request, httpx.ReadTimeout
            )
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _Stale from None
            raise httpx.RemoteProtocolError(
                "connection closed in the response head", request=request
            ) from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("response head too large", request=request) from None
        except ConnectionError:
            raise _Stale from None
        first, *lines = head.split(b"\r\n")
        try:
            status = int(first.split(None, 2)[1])
        except (IndexError, ValueError):
            raise httpx.RemoteProtocolError(
                f"malformed status line {first[:80]!r}", request=request
            ) from None
        raw = [
            (name.strip(), value.strip())
            for name, _, value in (line.partition(b":") for line in lines if line)
        ]
        return status, httpx.Headers(raw)

    async def _acquire(
        self, origin: tuple[str, int], request: httpx.Request, timeout: float | None
    ) -> tuple[_Conn, bool]:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable() and now - conn.idle_since < self.expiry:
                return conn, True
            conn.close()
        try:
            reader, writer = await _within(
                timeout, asyncio.open_connection(*origin), request, httpx.ConnectTimeout
            )
        except OSError as exc:
            raise httpx.ConnectError(
                f"cannot connect to {origin[0]}:{origin[1]}: {exc}", request=request
            ) from exc
        return _Conn(reader, writer), False

    def _release(self, origin: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self.max_idle or not conn.usable():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
