"""Sending a gateway call to its model server: the connections, the retries, the move to
another server of the attempt, and the extras an upstream rejects (see
:mod:`agentbolt.server.gateway` for the rules these follow).

Plain-http upstreams (model servers on the cluster network) go through a lean keep-alive
transport (:mod:`agentbolt.http1`); any other through one pooled httpx client. FastAPI routing
and httpx's default pool each cost more than the rest of a call
(``benchmarks/gateway_overhead.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from agentbolt.http1 import Http1Transport, lean_mounts
from agentbolt.server.config import ServerConfig
from agentbolt.server.gateway_access import UpstreamKeys
from agentbolt.server.gateway_call import ForwardedCall, LeanRequest, LeanResponse
from agentbolt.server.gateway_upstreams import Upstreams
from agentbolt.server.openai_format import CHAT, COMPLETIONS, RESPONSES

__all__ = ["EXTRAS", "MAX_TRIES", "RETRY_STATUSES", "UpstreamSender", "asked_in"]

log = logging.getLogger("agentbolt.gateway")

RETRY_STATUSES = (429, 502, 503)
MAX_TRIES = 4
# failures where nothing reached the server: retried, on another server where there is one
# (a pool timeout is this gateway's own limit: it says nothing about the server)
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.WriteTimeout, httpx.PoolTimeout)
_PATHS = {CHAT: "chat/completions", COMPLETIONS: "completions", RESPONSES: "responses"}
# What the gateway adds to a request, per endpoint, and may drop again when an upstream rejects
# it by name (a whole word: "top_logprobs" does not name "logprobs"). A Responses call asks for
# logprobs in its ``include`` (:mod:`.responses_ids`).
EXTRAS = {
    CHAT: ("return_token_ids", "logprobs"),
    COMPLETIONS: ("return_token_ids", "logprobs"),
    RESPONSES: ("enable_response_messages", "logprobs"),
}
_NAMED = {
    name: re.compile(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])".encode())
    for names in EXTRAS.values()
    for name in names
}
_JSON_HEADERS = [(b"content-type", b"application/json"), (b"accept", b"application/json")]

Build = Callable[[], "httpx.Request | LeanRequest"]


class UpstreamSender:
    """The gateway's way out: every upstream request goes through one of these, which also
    owns the health of multi-server resources (:attr:`upstreams`)."""

    def __init__(self, config: ServerConfig, keys: UpstreamKeys) -> None:
        self.config, self.keys = config, keys
        self.upstreams = Upstreams(self.status_of)
        self._http: httpx.AsyncClient | None = None
        # (base URL, a Responses call?) -> the extras it rejects
        self._rejected: dict[tuple[str, bool], frozenset[str]] = {}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        # as many calls at once to plain-http upstreams as the https client below allows
        self._h1 = Http1Transport(max_connections=1000)
        self._mounts = lean_mounts(self._h1)  # None when an http proxy is configured
        self._timeout = httpx.Timeout(config.upstream_timeout, connect=min(10.0, config.upstream_timeout))
        self._timeouts = self._timeout.as_dict()

    @property
    def http(self) -> httpx.AsyncClient:
        """One client for every upstream call the lean transport does not take: pooled
        keep-alive connections."""
        if self._http is None:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=256, keepalive_expiry=60)
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=limits, mounts=self._mounts)
        return self._http

    async def aclose(self) -> None:
        await self.upstreams.aclose()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self._h1.aclose()

    def rejected(self, server: str, endpoint: str = CHAT) -> frozenset[str]:
        """The extras (:data:`EXTRAS`) this server is known to reject on ``endpoint`` (chat
        and completions share theirs; a server's ``/responses`` has its own)."""
        return self._rejected.get((server, endpoint == RESPONSES), frozenset())

    async def status_of(self, url: str, timeout: float) -> int:
        """The status of ``GET url`` (no key), read within ``timeout``: a health probe."""
        target = httpx.URL(url)
        if target.scheme == "http" and self._mounts is not None:
            timeouts = {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
            origin = (target.host, target.port or 80)
            answer = await self._h1.request(
                "GET", origin, target.raw_path, [(b"accept", b"application/json")], b"", timeouts
            )
            return answer.status_code
        return (await self.http.get(target, timeout=timeout)).status_code

    async def post(self, url: str, content: bytes, key: str | None) -> httpx.Response:
        """POST a JSON body to a model server, unrecorded (the judge proxy's calls), with the
        gateway's connections, timeouts and retries; the response is streamed: read or close it."""
        return await self._send(functools.partial(self._post_request, url, content, key))

    async def send(self, call: ForwardedCall, payload: dict[str, Any]) -> httpx.Response:
        """Send ``payload``; where the upstream's 400 names extras the gateway added, send again
        without them (each at most once) and remember them for this upstream."""
        for _ in range(len(EXTRAS[call.endpoint]) + 1):
            response = await self._send(functools.partial(self._request, call, payload), call)
            named = await _rejected_extras(call, payload, response)
            if not named:
                return response
            await response.aclose()
            base = call.upstream
            log.info(
                "model server %s rejects %s; its calls are recorded text-only",
                self.upstreams.public(base),
                ", ".join(named),
            )
            self._rejected[(base, call.endpoint == RESPONSES)] = self.rejected(base, call.endpoint) | named
            payload = _without(call, payload, named)
        return response

    def _request(self, call: ForwardedCall, payload: dict[str, Any]) -> httpx.Request | LeanRequest:
        """Built directly (not client.build_request): URL parsing and header merging cost more
        than the rest of the call; the parsed URL is cached per upstream and endpoint. A
        plain-http upstream's answer read whole (not a stream) needs no httpx request at all."""
        key = (call.upstream, call.endpoint)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = httpx.URL(f"{call.upstream.rstrip('/')}/{_PATHS[call.endpoint]}")
        content = orjson.dumps(payload)
        if self._mounts is not None and url.scheme == "http" and not payload.get("stream"):
            headers = list(_JSON_HEADERS)
            if call.key:
                headers.append((b"authorization", b"Bearer " + call.key.encode()))
            return LeanRequest((url.host, url.port or 80), url.raw_path, headers, content)
        return self._post_request(url, content, call.key)

    def _post_request(self, url: httpx.URL | str, content: bytes, key: str | None) -> httpx.Request:
        headers = list(_JSON_HEADERS)
        if key:
            headers.append((b"authorization", f"Bearer {key}".encode()))
        return httpx.Request(
            "POST", url, content=content, headers=headers, extensions={"timeout": self._timeouts}
        )

    async def _dispatch(self, request: httpx.Request | LeanRequest) -> Any:
        """Plain-http upstreams: straight to the lean transport (the client's cookie, auth and
        redirect handling cost a quarter of a call and the gateway needs none of it); answers
        read whole skip httpx's request and response objects too (a :class:`LeanResponse`)."""
        if isinstance(request, LeanRequest):
            answer = await self._h1.request(
                "POST", request.origin, request.target, request.headers, request.content, self._timeouts
            )
            return LeanResponse(answer)
        if request.url.scheme != "http" or self._mounts is None:
            return await self.http.send(request, stream=True)
        response = await self._h1.handle_async_request(request)
        response.request = request
        return response

    async def _send(self, build: Build, call: ForwardedCall | None = None) -> httpx.Response:
        """Send (streamed), retrying with backoff where the upstream did not start work; a
        call of a resource with several servers moves to the next one at once instead."""
        deadline = time.monotonic() + self.config.upstream_timeout
        ranked = call.target.ranked.get(call.resource) if call is not None else None
        tries = MAX_TRIES if ranked is None else MAX_TRIES + len(ranked) - 1
        backoffs = 0
        for attempt in range(tries):
            last = attempt == tries - 1
            try:
                response = await self._dispatch(build())
            except _UNSENT as exc:
                if last or time.monotonic() > deadline:
                    raise
                if ranked is not None and call is not None and await self._fail_over(call, ranked, exc):
                    continue
                await asyncio.sleep(_backoff(backoffs))
                backoffs += 1
                if ranked is not None and call is not None:  # every server failed: start over
                    call.tried = ()
                    await self._move(call, self.upstreams.pick(ranked))
                continue
            if response.status_code not in RETRY_STATUSES or last:
                return response
            delay = _retry_after(response.headers.get("retry-after")) or _backoff(backoffs)
            backoffs += 1
            if time.monotonic() + delay > deadline:
                return response
            await response.aclose()
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _fail_over(self, call: ForwardedCall, ranked: tuple[str, ...], exc: Exception) -> bool:
        """After a try that sent nothing: mark its server down (unless the wait was this
        gateway's own pool) and move the call to the next server of its attempt's ranking that
        it has not tried, one that is up first; ``False`` when it has tried them all."""
        if not isinstance(exc, httpx.PoolTimeout):
            self.upstreams.mark_down(call.upstream, type(exc).__name__)
        call.tried = (*call.tried, call.upstream)
        left = [url for url in ranked if url not in call.tried]
        if not left:
            return False
        up = [url for url in left if url not in self.upstreams.down]
        await self._move(call, (up or left)[0])
        return True

    async def _move(self, call: ForwardedCall, server: str) -> None:
        if server != call.upstream:
            log.info(
                "a call of attempt %s sent nothing to %s: sent to %s",
                call.target.attempt_id,
                self.upstreams.public(call.upstream),
                self.upstreams.public(server),
            )
            call.upstream = server
            call.key = await self.keys.resolve(call.llm, call.target.resources_version, server)


async def _rejected_extras(
    call: ForwardedCall, payload: dict[str, Any], response: httpx.Response
) -> frozenset[str]:
    """The extras the gateway added that this error names; none for any other answer, and
    none for what the agent asked for itself (its own bad request is never altered)."""
    if response.status_code not in (400, 422):
        return frozenset()
    added = [n for n in EXTRAS[call.endpoint] if _added(call, payload, asked_in(call.endpoint, n))]
    if not added:
        return frozenset()
    text = await response.aread()
    return frozenset(n for n in added if _NAMED[n].search(text))


def asked_in(endpoint: str, extra: str) -> str:
    """The request field an extra is asked for with: a Responses call's logprobs in ``include``."""
    return "include" if endpoint == RESPONSES and extra == "logprobs" else extra


def _added(call: ForwardedCall, payload: dict[str, Any], field: str) -> bool:
    return field in payload and call.request.get(field) != payload[field]


def _without(call: ForwardedCall, payload: dict[str, Any], named: frozenset[str]) -> dict[str, Any]:
    """``payload`` with the fields of the ``named`` extras as the agent sent them (or without)."""
    out = dict(payload)
    for field in {asked_in(call.endpoint, n) for n in named}:
        if field in call.request:
            out[field] = call.request[field]
        else:
            out.pop(field, None)
    return out


def _backoff(attempt: int) -> float:
    return random.uniform(0.5, 1.0) * min(2.0, 0.1 * 2**attempt)


def _retry_after(value: str | None) -> float | None:
    try:
        return min(5.0, max(0.0, float(value))) if value else None
    except ValueError:
        return None
