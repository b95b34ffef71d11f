"""The gateway's lean HTTP/1.1 transport against scripted raw servers on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentbolt.http1 import Http1Transport
from agentbolt.server.run import free_port


async def _serve(handler) -> tuple[asyncio.Server, str, list[int]]:
    """A raw server; ``handler(reader, writer, n)`` answers the n-th request of a connection.
    Returns the server, its base URL and a list holding the number of connections made."""
    connections = [0]

    async def on_connect(reader, writer):
        connections[0] += 1
        n = 0
        try:
            while await reader.readuntil(b"\r\n\r\n"):  # the tests send GETs: no body
                n += 1
                if not await handler(reader, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def _ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def _get(client: httpx.AsyncClient, url: str) -> httpx.Response:
    response = await client.get(url)
    await response.aread()
    return response


async def test_keep_alive_chunked_and_close_framing():
    async def handler(reader, writer, n):
        if n == 1:
            writer.write(_ok())
        elif n == 2:
            writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            )
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil close")
            await writer.drain()
            return False
        await writer.drain()
        return True

    server, url, connections = await _serve(handler)
    async with server, httpx.AsyncClient(transport=Http1Transport()) as client:
        assert (await _get(client, url)).json() == {"ok": True}
        assert (await _get(client, url)).text == "hello world"
        assert (await _get(client, url)).text == "until close"
        assert connections[0] == 1  # one connection for all three
        assert (await _get(client, url)).json() == {"ok": True}  # the closed one is not reused
        assert connections[0] == 2


async def test_a_keep_alive_connection_closed_by_the_server_is_retried_once():
    async def handler(reader, writer, n):
        writer.write(_ok())
        await writer.drain()
        return False  # close after each answer, without saying so

    server, url, connections = await _serve(handler)
    async with server, httpx.AsyncClient(transport=Http1Transport()) as client:
        for _ in range(3):
            assert (await _get(client, url)).status_code == 200
        assert connections[0] == 3


async def test_errors_are_httpx_errors():
    async def silent(reader, writer, n):
        await asyncio.sleep(5)
        return False

    server, url, _ = await _serve(silent)
    async with server, httpx.AsyncClient(transport=Http1Transport(), timeout=httpx.Timeout(0.2)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url)
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/")


def test_lean_mounts_step_aside_for_an_http_proxy(monkeypatch):
    from agentbolt.client import AsyncClient
    from agentbolt.http1 import lean_mounts

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    transport = Http1Transport()
    assert lean_mounts(transport) == {"http://": transport}
    client = AsyncClient("http://127.0.0.1:9")
    assert isinstance(client.http._transport_for_url(httpx.URL("http://127.0.0.1:9/x")), Http1Transport)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert lean_mounts(transport) is None
    proxied = AsyncClient("http://10.0.0.5:8000")
    assert not isinstance(
        proxied.http._transport_for_url(httpx.URL("http://10.0.0.5:8000/x")), Http1Transport
    )
