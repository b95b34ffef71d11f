"""The lean HTTP/1.1 transport against scripted raw servers on 127.0.0.1: framing, keep-alive,
what is sent again after a dropped connection (and what never is), interim answers, and the
cap on open connections."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from agentbolt.http1 import IDEMPOTENCY_KEY, Http1Transport
from agentbolt.server.run import free_port


@dataclass
class Raw:
    """A raw server: its URL, the connections made (and open now), the request heads seen."""

    server: asyncio.Server
    url: str
    connections: int = 0
    open: int = 0
    most_open: int = 0
    heads: list[bytes] = field(default_factory=list)

    def keys(self) -> list[str | None]:
        """Each request's Idempotency-Key, None where it had none."""
        return [_header(head, b"idempotency-key") for head in self.heads]


async def _serve(handler) -> Raw:
    """A raw server; ``handler(reader, writer, n)`` answers the n-th request of a connection
    (its head and body read already) and returns whether to keep the connection."""

    async def on_connect(reader, writer):
        raw.connections += 1
        raw.open += 1
        raw.most_open = max(raw.most_open, raw.open)
        n = 0
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                raw.heads.append(head)
                await reader.readexactly(_content_length(head))
                n += 1
                if not await handler(reader, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        raw.open -= 1
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    raw = Raw(server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    return raw


def _header(head: bytes, name: bytes) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode()
    return None


def _content_length(head: bytes) -> int:
    return int(_header(head, b"content-length") or 0)


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

    raw = await _serve(handler)
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        assert (await _get(client, raw.url)).json() == {"ok": True}
        assert (await _get(client, raw.url)).text == "hello world"
        assert (await _get(client, raw.url)).text == "until close"
        assert raw.connections == 1  # one connection for all three
        assert (await _get(client, raw.url)).json() == {"ok": True}  # the closed one is not reused
        assert raw.connections == 2


async def test_a_keep_alive_connection_closed_by_the_server_is_retried_once():
    async def handler(reader, writer, n):
        writer.write(_ok())
        await writer.drain()
        return False  # close after each answer, without saying so

    raw = await _serve(handler)
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        for _ in range(3):
            assert (await _get(client, raw.url)).status_code == 200
        assert raw.connections == 3


async def test_errors_are_httpx_errors():
    async def silent(reader, writer, n):
        await asyncio.sleep(5)
        return False

    raw = await _serve(silent)
    async with (
        raw.server,
        httpx.AsyncClient(transport=Http1Transport(), timeout=httpx.Timeout(0.2)) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await client.get(raw.url)
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


async def _until(condition, seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _answer_all_but(dropped: set[int]) -> Raw:
    """Answers every request (keep-alive) except those whose number (counting from 1 over all
    connections) is in ``dropped``: it reads them whole, then closes without a byte of answer,
    as a server that crashed after acting on them would."""

    async def handler(reader, writer, n):
        if len(raw.heads) in dropped:
            return False
        writer.write(_ok())
        await writer.drain()
        return True

    raw = await _serve(handler)
    return raw


@pytest.mark.parametrize(
    ("method", "headers", "sent_again"),
    [("POST", {}, False), ("POST", {IDEMPOTENCY_KEY: "k-1"}, True), ("GET", {}, True)],
    ids=["post-without-key", "post-with-key", "get"],
)
async def test_a_request_the_server_may_have_processed_is_sent_again_only_when_harmless(
    method, headers, sent_again
):
    raw = await _answer_all_but({2})
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        assert (await client.post(raw.url, content=b"first")).status_code == 200
        body = b"second" if method == "POST" else None
        second = client.request(method, f"{raw.url}/second", content=body, headers=headers)
        if sent_again:
            assert (await second).status_code == 200
            assert raw.connections == 2  # the kept-alive one dropped it: sent again on a new one
            assert raw.keys()[1:] == [headers.get(IDEMPOTENCY_KEY)] * 2
        else:
            with pytest.raises(httpx.RemoteProtocolError, match="not sent again"):
                await second
            await asyncio.sleep(0.1)  # time for a second copy to arrive, were one sent
            assert raw.connections == 1
        assert len(raw.heads) == (3 if sent_again else 2)


async def test_a_new_connection_that_drops_the_request_is_not_tried_again():
    raw = await _answer_all_but({1})
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="without answering"):
            await client.post(raw.url, content=b"x", headers={IDEMPOTENCY_KEY: "k-1"})
        await asyncio.sleep(0.1)
    assert len(raw.heads) == 1 and raw.connections == 1


async def test_a_request_not_written_whole_is_sent_again_even_without_a_key():
    """The connection breaks after the pool handed it out, before the request is written: the
    server cannot have seen the request, so sending it again is safe."""
    raw = await _answer_all_but(set())
    transport = Http1Transport()
    acquire = transport._pool.acquire

    async def acquire_then_reset(origin, request, timeouts):
        conn = await acquire(origin, request, timeouts)
        if conn.reused:
            conn.writer.transport.abort()  # as if the server's reset arrived at this moment
        return conn

    transport._pool.acquire = acquire_then_reset
    async with raw.server, httpx.AsyncClient(transport=transport) as client:
        assert (await client.post(raw.url, content=b"first")).status_code == 200
        assert (await client.post(raw.url, content=b"second")).status_code == 200
    assert raw.connections == 2
    assert len(raw.heads) == 2  # each request reached the server once


async def test_interim_answers_are_skipped_for_the_final_one():
    async def handler(reader, writer, n):
        if n == 1:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # the final answer comes in a later read
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            writer.write(_ok(b'{"final": true}'))
        else:
            writer.write(_ok())
        await writer.drain()
        return True

    raw = await _serve(handler)
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        response = await client.post(raw.url, content=b"body")
        assert response.status_code == 200
        assert response.json() == {"final": True}
        assert "link" not in response.headers  # the interim answer's headers are not the final's
        assert (await _get(client, raw.url)).json() == {"ok": True}
    assert raw.connections == 1  # the connection stayed in step for the next request


async def test_a_connection_closed_after_an_interim_answer_is_an_error():
    async def handler(reader, writer, n):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        return False

    raw = await _serve(handler)
    async with raw.server, httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.RemoteProtocolError, match="interim 100"):
            await client.post(raw.url, content=b"body")


async def _held() -> tuple[Raw, asyncio.Semaphore]:
    """A server that answers one request per release of the semaphore it returns."""
    answers = asyncio.Semaphore(0)

    async def handler(reader, writer, n):
        await answers.acquire()
        writer.write(_ok())
        await writer.drain()
        return True

    return await _serve(handler), answers


async def test_open_connections_are_capped_and_callers_wait_for_one():
    raw, answers = await _held()
    async with raw.server, httpx.AsyncClient(transport=Http1Transport(max_connections=2)) as client:
        calls = [asyncio.create_task(_get(client, raw.url)) for _ in range(6)]
        await _until(lambda: len(raw.heads) == 2)
        await asyncio.sleep(0.1)  # time for a connection beyond the cap to show up, were one opened
        assert raw.connections == 2
        for _ in calls:
            answers.release()
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 6
    assert raw.connections == 2  # the waiting callers took over the two connections
    assert raw.most_open == 2


async def test_a_caller_gives_up_waiting_at_the_pool_timeout_and_the_cap_still_holds():
    raw, answers = await _held()
    timeout = httpx.Timeout(5.0, pool=0.2)
    async with (
        raw.server,
        httpx.AsyncClient(transport=Http1Transport(max_connections=1), timeout=timeout) as client,
    ):
        first = asyncio.create_task(_get(client, raw.url))
        await _until(lambda: len(raw.heads) == 1)
        with pytest.raises(httpx.PoolTimeout):
            await client.get(raw.url)
        more = [asyncio.create_task(_get(client, raw.url)) for _ in range(2)]
        answers.release()
        assert (await first).status_code == 200
        await _until(lambda: len(raw.heads) == 2)
        await asyncio.sleep(0.1)
        assert raw.connections == 1  # the one connection passed on; the timed-out caller took no slot
        answers.release()
        answers.release()
        assert [r.status_code for r in await asyncio.gather(*more)] == [200, 200]


async def test_a_caller_for_another_origin_takes_an_idle_connections_slot():
    a, b = await _answer_all_but(set()), await _answer_all_but(set())
    timeout = httpx.Timeout(5.0, pool=0.5)
    async with (
        a.server,
        b.server,
        httpx.AsyncClient(transport=Http1Transport(max_connections=1), timeout=timeout) as client,
    ):
        assert (await _get(client, a.url)).status_code == 200  # its connection stays open, idle
        assert (await _get(client, b.url)).status_code == 200  # no wait for the pool timeout
        await _until(lambda: a.open == 0)  # a's idle connection was closed to make room
    assert (a.connections, b.connections) == (1, 1)


async def test_the_async_client_caps_its_connections():
    from agentbolt.client import AsyncClient

    raw, answers = await _held()
    client = AsyncClient(raw.url, max_connections=2)
    async with raw.server:
        calls = [asyncio.create_task(client.health()) for _ in range(4)]
        await _until(lambda: len(raw.heads) == 2)
        await asyncio.sleep(0.1)
        assert raw.connections == 2
        for _ in calls:
            answers.release()
        assert await asyncio.gather(*calls) == [{"ok": True}] * 4
        await client.aclose()
