"""OpenAI clients for an ``LLM`` resource, cheap to make once per rollout.

Inside a rollout the ``LLM`` resource points at the gateway of that attempt, so agents build a
client per rollout. A fresh ``openai.AsyncOpenAI`` builds its own HTTP client and TLS context
(~0.1 s of CPU here); these helpers share one HTTP connection pool per event loop (per thread
for the sync client) instead, which makes a new client cost about a millisecond.

The async pool sends plain-http calls (the gateway is plain http) through the lean keep-alive
transport of :mod:`agentbolt.http1` rather than httpcore's pool, which scans and polls every
pooled connection on each request and again when each response closes: with 32 rollouts in
flight in one runner that was most of the runner's CPU per rollout (a GRPO step's 32 requests
left the runner one after another over ~0.3 s, so the engine's batch filled late). Responses
still stream (``stream=True``); https and configured http proxies keep the SDK's own transport.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx

from agentbolt.http1 import Http1Transport, lean_mounts
from agentbolt.schemas import LLM

__all__ = ["async_openai", "sync_openai"]

_async_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
_local = threading.local()


def async_openai(llm: LLM, timeout: float = 300.0, max_retries: int = 0, **kwargs: Any) -> Any:
    """An ``openai.AsyncOpenAI`` for ``llm`` sharing this event loop's connection pool."""
    import openai

    loop = asyncio.get_running_loop()
    pool = _async_pools.get(loop)
    if pool is None:
        pool = _async_pools[loop] = openai.DefaultAsyncHttpxClient(
            mounts=_lean_mounts(openai.DefaultAsyncHttpxClient)
        )
    return openai.AsyncOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key or "none",
        timeout=timeout,
        max_retries=max_retries,
        http_client=pool,
        **kwargs,
    )


def sync_openai(llm: LLM, timeout: float = 300.0, max_retries: int = 0, **kwargs: Any) -> Any:
    """An ``openai.OpenAI`` for ``llm`` sharing this thread's connection pool."""
    import openai

    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = openai.DefaultHttpxClient()
    return openai.OpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key or "none",
        timeout=timeout,
        max_retries=max_retries,
        http_client=pool,
        **kwargs,
    )


MAX_CONNECTIONS = 1000
"""Connections the lean pool opens at most (the OpenAI SDK's own limit); calls beyond wait."""


def _lean_mounts(client_class: type) -> dict[str, Any] | None:
    """``mounts`` for the SDK's async HTTP client that send plain http through
    :class:`~agentbolt.http1.Http1Transport`: directly when the SDK is built on httpx, through
    :class:`_Bridge` when it is built on an httpx fork with the same interface (``httpx2``);
    None (the SDK's transport) for anything else, or where an http proxy is configured."""
    base = next((c for c in client_class.__mro__ if c.__name__ == "AsyncClient"), None)
    module = sys.modules.get(base.__module__.split(".", 1)[0]) if base is not None else None
    transport = Http1Transport(max_connections=MAX_CONNECTIONS)
    if module is httpx:
        return lean_mounts(transport)
    if module is None or not hasattr(module, "AsyncBaseTransport") or not hasattr(module, "Response"):
        return None
    return lean_mounts(_in_fork(_Bridge, module, "AsyncBaseTransport")(transport, module))


_fork_classes: dict[tuple[type, str], type] = {}


def _in_fork(mixin: type, module: Any, base: str) -> type:
    """``mixin`` as a subclass of ``module.<base>`` (``module``: an httpx fork), made once."""
    key = (mixin, module.__name__)
    found = _fork_classes.get(key)
    if found is None:
        found = _fork_classes[key] = type(mixin.__name__, (mixin, getattr(module, base)), {})
    return found


class _Bridge:
    """Hands a request of an httpx fork to :class:`Http1Transport` (which reads only what both
    share: method, URL parts, raw headers, body, timeout extensions) and its answer back as the
    fork's response, its body still streamed; httpx's errors become the fork's errors of the
    same name (the SDK tells timeouts from connection failures by them)."""

    def __init__(self, transport: Http1Transport, module: Any) -> None:
        self._transport, self._module = transport, module

    async def handle_async_request(self, request: Any) -> Any:
        try:
            answer = await self._transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise self._error(exc, request) from exc
        return self._module.Response(
            answer.status_code,
            headers=answer.headers.raw,
            stream=_in_fork(_BridgeStream, self._module, "AsyncByteStream")(answer.stream, self, request),
            extensions=answer.extensions,
        )

    def _error(self, exc: httpx.HTTPError, request: Any) -> Exception:
        kind = getattr(self._module, type(exc).__name__, None) or self._module.TransportError
        return kind(str(exc), request=request)

    async def aclose(self) -> None:
        await self._transport.aclose()


class _BridgeStream:
    """A response body of :class:`Http1Transport` as the fork's byte stream."""

    def __init__(self, stream: Any, bridge: _Bridge, request: Any) -> None:
        self._stream, self._bridge, self._request = stream, bridge, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except httpx.HTTPError as exc:
            raise self._bridge._error(exc, self._request) from exc

    async def aclose(self) -> None:
        await self._stream.aclose()
