"""The gateway: an OpenAI-compatible endpoint per attempt that records every model call.

``/gateway/{rollout_id}/{attempt_id}/v1/{chat/completions,completions,responses,models}`` forwards
to the upstream named by the rollout's ``LLM`` resource (the ``base_url`` as published; with
``upstreams`` too, one of those servers per attempt: :mod:`.gateway_upstreams`). A
Responses call goes to an upstream's own ``/responses`` as it is (recorded text-only unless the
answer carries ids); where that is a 404 or 405 (remembered per upstream: the embedded engine,
most model servers) it goes out as a chat completion (:mod:`.responses`) and is recorded as
one, with ``endpoint: "responses"``, the agent's request and the ``chat_request`` it became;
``previous_response_id`` then continues from the attempt's recorded call. It asks the
upstream for token ids and logprobs, records one ``llm_call`` event per call (see
``docs/events.md``) and returns to the agent only what the agent asked for. Dequeued claims
get their ``LLM`` resources pointed here (:func:`~agentbolt.server.gateway_access.rewrite_claim`),
so agents are captured with no code change.

Choices worth knowing:

- The event is recorded before the answer is returned (after the last chunk for streams), so
  when an agent's call returns its record is in the store.
- Upstream API keys (see :mod:`.gateway_access`) travel only in the upstream request's header;
  they are scrubbed from upstream error messages before those are recorded or returned.
- Retries (with backoff) only where the upstream cannot have started work: connection failures
  (and a request that could not be written whole), and 429/502/503 answers. A read timeout or a
  broken stream is reported, not retried.
- Several servers behind one resource: a call goes to its attempt's server (the same for the
  whole attempt) unless that one is down. Only a call that sent nothing (the connection failed,
  or failed before the request was written) moves to another server, at once, and marks its
  server down; an answer the server may have started (a read timeout, a dropped connection
  after the request went out, a broken stream) is reported, never sent elsewhere. A 429/502/503
  is retried on the same server. Each record names the server in ``upstream`` (its URL, no key).
- An upstream that rejects ``return_token_ids`` or ``logprobs`` the gateway added (a 400 naming
  it) is asked again without just that one, and that is remembered per upstream; an extra the
  agent asked for itself is never dropped (its 400 goes back to the agent). A call answered
  without ids is recorded text-only: ``token_ids: false`` in its data.
- A call the agent's client retried is one record: a try with the same ``Idempotency-Key``, or
  with ``x-stainless-retry-count`` above 0 and the same body as an earlier call of the attempt,
  joins that call's record (:mod:`agentbolt.store.calls`).
- Every answer whose call was recorded names its record, the call id an agent rewards a turn
  by: header ``X-Agentbolt-Call-Id`` and body field ``agentbolt.call_id``; a stream carries it
  on its last chunk (a Responses stream in its final event), since the record is made after
  the last chunk came. A retry gets the id of the record it joined; a call the store failed to
  record gets none (the answer still goes out).
- An attempt that is no longer running (finished, cancelled, lease expired) takes no calls:
  409 ``AttemptEnded`` naming its state.
- Cost: the POST routes are served by a pure ASGI fast path
  (:class:`~agentbolt.server.routes.gateway.GatewayFastPath`) and plain-http upstreams go
  through a lean keep-alive transport (:mod:`agentbolt.http1`); FastAPI routing and httpx's
  default pool each cost more than the rest of a call (``benchmarks/gateway_overhead.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from agentbolt.errors import AttemptEnded
from agentbolt.http1 import Http1Transport, lean_mounts
from agentbolt.schemas import LLM, AttemptStatus, EventType
from agentbolt.server.config import ServerConfig
from agentbolt.server.gateway_access import UpstreamKeys
from agentbolt.server.gateway_call import (
    CallTry,
    ForwardedCall,
    LeanRequest,
    LeanResponse,
    Refused,
    Target,
    json_answer,
    with_call_id,
)
from agentbolt.server.gateway_responses import PASSED, ResponsesUpstream, chat_for, sse
from agentbolt.server.gateway_upstreams import Upstreams, rank_servers
from agentbolt.server.openai_format import (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    StreamAssembler,
    check_request,
    count_usage,
    extract,
    openai_error,
    prepare,
    strip,
)
from agentbolt.server.responses import (
    EventStream,
    Untranslatable,
    new_id,
    to_response,
    with_history,
)
from agentbolt.server.store_caller import StoreCaller
from agentbolt.store.calls import CallEvent

__all__ = ["Gateway", "upstream_error_body"]

log = logging.getLogger("agentbolt.gateway")

_LLM_CALL = EventType.LLM_CALL.value
RETRY_STATUSES = (429, 502, 503)
MAX_TRIES = 4
# failures where nothing reached the server: retried, on another server where there is one
# (a pool timeout is this gateway's own limit: it says nothing about the server)
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.WriteTimeout, httpx.PoolTimeout)
_PATHS = {CHAT: "chat/completions", COMPLETIONS: "completions", RESPONSES: "responses"}
# What the gateway adds to a request and may drop again when an upstream rejects it by name
# (a whole word: "top_logprobs" does not name "logprobs").
_EXTRAS = {
    name: re.compile(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])".encode())
    for name in ("return_token_ids", "logprobs")
}


class Gateway:
    def __init__(self, call: StoreCaller, config: ServerConfig) -> None:
        self.call, self.store, self.config = call, call.store, config
        self._http: httpx.AsyncClient | None = None
        self._targets: OrderedDict[str, Target] = OrderedDict()
        self._rejected: dict[str, frozenset[str]] = {}  # base URL -> the extras it rejects
        self.responses = ResponsesUpstream(self)
        self.keys = UpstreamKeys(call, config)
        self.upstreams = Upstreams(self)
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        # plain-http upstreams (model servers on the cluster network), as many calls at once as
        # the https client below allows
        self._h1 = Http1Transport(max_connections=1000)
        self._mounts = lean_mounts(self._h1)  # None when an http proxy is configured
        self._timeout = httpx.Timeout(config.upstream_timeout, connect=min(10.0, config.upstream_timeout))
        self._timeouts = self._timeout.as_dict()

    @property
    def http(self) -> httpx.AsyncClient:
        """One client for every upstream call: pooled keep-alive connections."""
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

    # ------------------------------------------------------------------ resolving a call

    async def target(self, rollout_id: str, attempt_id: str) -> Target:
        state = await self.call.read(self.store.attempt_state, attempt_id)  # read on every call
        if state is None:
            raise Refused(404, f"attempt {attempt_id!r} not found", "not_found_error")
        if state[0] != rollout_id:
            raise Refused(
                404, f"attempt {attempt_id!r} is not part of rollout {rollout_id!r}", "not_found_error"
            )
        if state[1] != AttemptStatus.RUNNING:
            message = f"attempt {attempt_id!r} is {state[1]}, not running: it takes no more calls"
            raise Refused(409, message, AttemptEnded.__name__)
        found = self._targets.get(attempt_id)
        if found is None:
            found = await self._load_target(rollout_id, attempt_id)
            self._targets[attempt_id] = found
            while len(self._targets) > 10_000:
                self._targets.popitem(last=False)
        return found

    async def _load_target(self, rollout_id: str, attempt_id: str) -> Target:
        rollout = await self.call(self.store.get_rollout, rollout_id)
        version = rollout.resources_version
        resources = await self.call(self.store.get_resources, version) if version is not None else None
        llms = {k: r for k, r in resources.resources.items() if isinstance(r, LLM)} if resources else {}
        # several servers: the attempt's order of them, fixed for the attempt
        ranked = {k: rank_servers(attempt_id, llm.servers) for k, llm in llms.items() if llm.upstreams}
        if ranked:
            self.upstreams.watch(url for urls in ranked.values() for url in urls)
        return Target(rollout_id, attempt_id, version, llms, ranked)

    def server(self, target: Target, resource: str, llm: LLM) -> str:
        """The model server this call of the attempt goes to: the resource's only one, or the
        first of the attempt's ranking that is up."""
        ranked = target.ranked.get(resource)
        return llm.base_url if ranked is None else self.upstreams.pick(ranked)

    # ------------------------------------------------------------------ forwarding

    async def forward(self, request: Request, rollout_id: str, attempt_id: str, endpoint: str) -> Response:
        started, t0 = time.time(), time.perf_counter()
        return await self.forward_raw(
            await request.body(), request.headers, rollout_id, attempt_id, endpoint, started, t0
        )

    async def forward_raw(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        rollout_id: str,
        attempt_id: str,
        endpoint: str,
        started: float,
        t0: float,
    ) -> Response:
        """Forward one call: its body as sent, and its headers (``idempotency-key`` and
        ``x-stainless-retry-count`` are read, in lower case); ``started``: its wall-clock time,
        ``t0``: its ``perf_counter``."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return json_answer(
                openai_error("the request body must be a JSON object", "invalid_request_error"), 400
            )
        responses, untranslatable = None, None
        if endpoint == RESPONSES:  # its chat form; an upstream that serves /responses needs none
            responses, endpoint = body, CHAT
            try:
                body = chat_for(responses)
            except Untranslatable as exc:
                untranslatable, body = exc, {}
        malformed = check_request(endpoint, body) if untranslatable is None else None
        if malformed is not None:
            return json_answer(openai_error(malformed[0], "invalid_request_error", param=malformed[1]), 400)
        try:
            target = await self.target(rollout_id, attempt_id)
            resource, llm = target.pick((responses or body).get("model"))
            server = self.server(target, resource, llm)
            key = await self.keys.resolve(llm, target.resources_version, server)
        except Refused as exc:
            return exc.response()
        if responses is not None and self.responses.may_serve(server):
            passed = ForwardedCall(
                target,
                resource,
                llm,
                RESPONSES,
                responses,
                PASSED,
                key,
                started,
                t0,
                CallTry.of(headers, raw),
                upstream=server,
            )
            answer = await self.responses.send(passed)
            if answer is not None:
                return answer
            server, key = passed.upstream, passed.key  # where the pass-through went
        if untranslatable is not None:
            error = openai_error(str(untranslatable), "invalid_request_error", param=untranslatable.param)
            return json_answer(error, 400)
        if responses is not None and responses.get("previous_response_id") is not None:
            try:
                body = with_history(
                    body, responses, await self.responses.history(target, responses["previous_response_id"])
                )
            except Refused as exc:
                return exc.response()
        rejected = self._rejected.get(server, frozenset())
        payload, wants = prepare(
            endpoint, body, "return_token_ids" not in rejected, "logprobs" not in rejected
        )
        call = ForwardedCall(
            target,
            resource,
            llm,
            endpoint,
            body,
            wants,
            key,
            started,
            t0,
            CallTry.of(headers, raw),
            responses,
            new_id("resp") if responses is not None else None,
            upstream=server,
        )
        try:
            upstream = await self._send_with_fallback(call, payload)
        except httpx.TimeoutException as exc:
            return await self._failed(
                call, 504, "upstream_timeout", f"the model server timed out ({type(exc).__name__})"
            )
        except httpx.HTTPError as exc:
            return await self._unreachable(call, exc)
        if upstream.status_code >= 400:
            return await self._upstream_error(call, upstream)
        if body.get("stream"):
            return StreamingResponse(
                self._relay(call, upstream),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            full = orjson.loads(await upstream.aread())
        except (orjson.JSONDecodeError, httpx.HTTPError) as exc:
            return await self._failed(
                call,
                502,
                "upstream_invalid_response",
                f"unreadable model server answer: {exc}",
                upstream.status_code,
            )
        out, call_id = await self._record_success(call, full, upstream.status_code, upstream.headers)
        return json_answer(out, upstream.status_code, call_id)

    def _upstream_request(self, call: ForwardedCall, payload: dict[str, Any]) -> httpx.Request | LeanRequest:
        # built directly (not client.build_request): URL parsing and header merging cost more
        # than the rest of the call; the parsed URL is cached per upstream and endpoint. A
        # plain-http upstream's answer read whole (not a stream) needs no httpx request at all.
        key = (call.upstream, call.endpoint)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = httpx.URL(f"{call.upstream.rstrip('/')}/{_PATHS[call.endpoint]}")
        content = orjson.dumps(payload)
        if self._mounts is not None and url.scheme == "http" and not payload.get("stream"):
            headers = [(b"content-type", b"application/json"), (b"accept", b"application/json")]
            if call.key:
                headers.append((b"authorization", b"Bearer " + call.key.encode()))
            return LeanRequest((url.host, url.port or 80), url.raw_path, headers, content)
        return self._post_request(url, content, call.key)

    def _post_request(self, url: httpx.URL | str, content: bytes, key: str | None) -> httpx.Request:
        headers = [(b"content-type", b"application/json"), (b"accept", b"application/json")]
        if key:
            headers.append((b"authorization", f"Bearer {key}".encode()))
        return httpx.Request(
            "POST", url, content=content, headers=headers, extensions={"timeout": self._timeout.as_dict()}
        )

    async def post(self, url: str, content: bytes, key: str | None) -> httpx.Response:
        """POST a JSON body to a model server, unrecorded (the judge proxy's calls), with the
        gateway's connections, timeouts and retries; the response is streamed: read or close it."""
        return await self._send(functools.partial(self._post_request, url, content, key))

    async def _send_with_fallback(self, call: ForwardedCall, payload: dict[str, Any]) -> httpx.Response:
        """Send; where the upstream's 400 names extras the gateway added, send again without
        them (each at most once) and remember them for this upstream."""
        for _ in range(len(_EXTRAS) + 1):
            response = await self._send(functools.partial(self._upstream_request, call, payload), call)
            named = await self._rejected_extras(call, payload, response)
            if not named:
                return response
            await response.aclose()
            base = call.upstream
            log.info(
                "model server %s rejects %s; its calls are recorded text-only",
                self.upstreams.public(base),
                ", ".join(named),
            )
            self._rejected[base] = self._rejected.get(base, frozenset()) | named
            payload = {k: v for k, v in payload.items() if k not in named}
        return response

    @staticmethod
    async def _rejected_extras(
        call: ForwardedCall, payload: dict[str, Any], response: httpx.Response
    ) -> frozenset[str]:
        """The extras the gateway added that this error names; none for any other answer, and
        none for what the agent asked for itself (its own bad request is never altered)."""
        if response.status_code not in (400, 422):
            return frozenset()
        added = [n for n in _EXTRAS if n in payload and call.request.get(n) != payload[n]]
        if not added:
            return frozenset()
        text = await response.aread()
        return frozenset(n for n in added if _EXTRAS[n].search(text))

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

    async def _send(self, build: Any, call: ForwardedCall | None = None) -> httpx.Response:
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

    async def _relay(self, call: ForwardedCall, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Pass a stream through chunk by chunk (stripped); record it reassembled before the
        final ``[DONE]``, so the record exists when the agent's call returns. The call's id
        rides on the last chunk (``agentbolt``): a closing chunk (finish reasons, or usage with
        no choices) waits for the next one, so that the last can carry it; a stream that ends
        with another chunk gets one more, with no choices."""
        assembler = StreamAssembler(call.endpoint)
        events = EventStream(call.responses, call.response_id or "") if call.responses is not None else None
        if events is not None:
            yield sse(events.start())
        error: dict[str, Any] | None = None
        extra: dict[str, Any] = {"time_to_first_token_ms": None}
        recorded = False
        held: dict[str, Any] | None = None  # a closing chunk, kept back to carry the call's id
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    error = (
                        chunk
                        if isinstance(chunk["error"], dict)
                        else openai_error(str(chunk["error"]), "upstream_error")
                    )
                    if held is not None:
                        yield _sse_chunk(held)
                        held = None
                    yield sse(events.error(error)) if events else _sse_chunk(error)
                    continue
                if extra["time_to_first_token_ms"] is None:
                    extra["time_to_first_token_ms"] = call.elapsed_ms()
                assembler.add(chunk)
                if events is not None:
                    yield sse(events.add(chunk))
                    continue
                out = strip(chunk, call.wants, stream=True)
                if out is not None:
                    if held is not None:
                        yield _sse_chunk(held)
                        held = None
                    if _closing(out):
                        held = out
                    else:
                        yield _sse_chunk(out)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            error = openai_error(
                f"the model server's stream broke: {call.scrub(str(exc))}", "upstream_stream_error", 502
            )
            if held is not None:
                yield _sse_chunk(held)
                held = None
            yield sse(events.error(error)) if events else _sse_chunk(error)
        except BaseException:  # the agent went away: still record what came
            error = openai_error("the client disconnected before the stream ended", "client_disconnected")
            raise
        else:
            recorded = True
            answer, call_id = await self._record_stream(call, upstream, assembler, error, extra)
            if events is None:
                if held is not None:
                    yield _sse_chunk(with_call_id(held, call_id))
                elif call_id is not None:
                    yield _sse_chunk(_id_chunk(call.endpoint, answer, call_id))
                yield b"data: [DONE]\n\n"
            elif answer is not None:
                yield sse(events.finish(with_call_id(answer, call_id)))
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                if not recorded:
                    await self._record_stream(call, upstream, assembler, error, extra)

    async def _record_stream(
        self,
        call: ForwardedCall,
        upstream: httpx.Response,
        assembler: StreamAssembler,
        error: dict[str, Any] | None,
        extra: dict[str, Any],
    ) -> tuple[dict[str, Any] | None, int | None]:
        """Record a finished stream; the answer as the agent gets it (``None`` after an error)
        and the id of its record."""
        if error is not None:
            call_id = await self._record(
                call, self._error_data(call, upstream.status_code, error, assembler.response(), extra)
            )
            return None, call_id
        return await self._record_success(
            call, assembler.response(), upstream.status_code, upstream.headers, extra
        )

    # ------------------------------------------------------------------ recording

    async def _record_success(
        self,
        call: ForwardedCall,
        full: dict[str, Any],
        status: int,
        headers: httpx.Headers,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], int | None]:
        """Record a successful call; return the body as the agent gets it (without the call's
        id) and the id of its record (``None`` when recording failed)."""
        prompt_ids, choices = extract(call.endpoint, full)
        model_version = headers.get("x-model-version") or full.get("model_version")
        mixed = bool(full.get("model_version_mixed"))
        out = strip(full, call.wants)
        assert out is not None
        usage = out.get("usage") or count_usage(prompt_ids, choices)
        if call.responses is not None:
            out = to_response({**out, "usage": usage}, call.responses, call.response_id or new_id("resp"))
        data = self._base_data(call, status, out)
        data.update(
            prompt_token_ids=prompt_ids,
            choices=choices,
            usage=usage,
            model=full.get("model") or data["model"],
            model_version=str(model_version) if model_version is not None else None,
            **(extra or {}),
        )
        if mixed:
            data["model_version_mixed"] = True
        # text-only (the upstream gave no ids): counted, usable from text, skipped by token trainers
        data["token_ids"] = prompt_ids is not None and all(c.get("token_ids") is not None for c in choices)
        return out, await self._record(call, data)

    def _base_data(self, call: ForwardedCall, status: int | None, response: Any) -> dict[str, Any]:
        asked = call.request if call.responses is None else call.responses
        data = {
            "endpoint": call.endpoint if call.responses is None else RESPONSES,
            "request": asked,
            "response": response,
            "stream": bool(asked.get("stream")),
            "prompt_token_ids": None,
            "choices": [],
            "usage": None,
            "latency_ms": call.elapsed_ms(),
            "upstream_status": status,
            "model": call.request.get("model") or call.llm.model,
            "model_version": None,
            "resources_version": call.target.resources_version,
            "resource": call.resource,
            "upstream": self.upstreams.public(call.upstream),
            "error": None,
        }
        if call.responses is not None:  # what the model was actually asked, as a chat call
            data["chat_request"] = call.request
        return data

    def _error_data(
        self,
        call: ForwardedCall,
        status: int | None,
        error: dict[str, Any],
        response: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        data = self._base_data(call, status, response)
        data.update(error=error, **(extra or {}))
        return data

    async def _unreachable(self, call: ForwardedCall, exc: httpx.HTTPError) -> Response:
        """A call no server answered: 502. The agent's message names no server (the log does)."""
        message = f"the model server is unreachable ({type(exc).__name__})"
        return await self._failed(call, 502, "upstream_unavailable", message, detail=str(exc))

    async def _failed(
        self,
        call: ForwardedCall,
        status: int,
        type: str,
        message: str,
        upstream_status: int | None = None,
        detail: str | None = None,
    ) -> Response:
        """Answer and record a failed call; ``detail``: logged only."""
        body = openai_error(call.scrub(message), type, status)
        log.warning(
            "gateway call for attempt %s to %s failed: %s%s",
            call.target.attempt_id,
            self.upstreams.public(call.upstream),
            body["error"]["message"],
            f": {call.scrub(detail)}" if detail else "",
        )
        call_id = await self._record(call, self._error_data(call, upstream_status, body))
        return json_answer(body, status, call_id)

    async def _upstream_error(self, call: ForwardedCall, upstream: httpx.Response) -> Response:
        """Pass the upstream's error on (OpenAI-style; keys scrubbed) and record it."""
        try:
            raw = call.scrub((await upstream.aread()).decode(errors="replace"))
        finally:
            await upstream.aclose()
        body = upstream_error_body(raw, upstream.status_code)
        log.warning("model server answered %d for attempt %s", upstream.status_code, call.target.attempt_id)
        call_id = await self._record(call, self._error_data(call, upstream.status_code, body))
        return json_answer(body, upstream.status_code, call_id)

    async def _record(self, call: ForwardedCall, data: dict[str, Any]) -> int | None:
        """Record the call; the id of its record (the call id the agent gets), or ``None``
        when the store failed (the agent still gets its answer; the lost record is logged)."""
        event = CallEvent(_LLM_CALL, call.started, data)
        tried = call.try_of
        try:
            recorded = await self.call(
                self.store.record_call,
                call.target.attempt_id,
                event,
                tried.key,
                tried.body_sha256,
                tried.retry,
            )
        except Exception:  # the agent still gets its answer; the lost record is logged
            log.exception("could not record an llm_call for attempt %s", call.target.attempt_id)
            return None
        return recorded.id

    # ------------------------------------------------------------------ models

    async def models(self, rollout_id: str, attempt_id: str) -> Response:
        """The upstream's model list, or one built from the rollout's LLM resources."""
        try:
            target = await self.target(rollout_id, attempt_id)
            resource, llm = target.pick(None)
            server = self.server(target, resource, llm)
            key = await self.keys.resolve(llm, target.resources_version, server)
        except Refused as exc:
            return exc.response()
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with contextlib.suppress(httpx.HTTPError, orjson.JSONDecodeError):
            answer = await self.http.get(f"{server.rstrip('/')}/models", headers=headers, timeout=10)
            if answer.status_code == 200:
                return json_answer(orjson.loads(answer.content))
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "agentbolt"}
            for m in dict.fromkeys(x.model for x in target.llms.values())
        ]
        return json_answer({"object": "list", "data": data})


def upstream_error_body(raw: str, status: int) -> dict[str, Any]:
    """A model server's error answer as an OpenAI-style error body: its own when it is one,
    else one carrying its message (or the start of its text)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    message = (body.get("message") or body.get("detail")) if isinstance(body, dict) else None
    return openai_error(f"model server error: {message or raw[:2000]}", "upstream_error", status)


def _sse_chunk(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _closing(chunk: dict[str, Any]) -> bool:
    """A chunk that may be a stream's last: every choice finished, or none (usage)."""
    return all(isinstance(c, dict) and c.get("finish_reason") for c in chunk.get("choices") or [])


def _id_chunk(endpoint: str, answer: dict[str, Any] | None, call_id: int) -> dict[str, Any]:
    """The chunk that ends a stream with the call's id: no choices (as the usage chunk OpenAI
    sends), the stream's id, model and time, and the ``agentbolt`` field."""
    top = answer or {}
    chunk: dict[str, Any] = {
        "id": top.get("id") or "",
        "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion",
        "created": top.get("created") or int(time.time()),
        "model": top.get("model") or "",
        "choices": [],
    }
    return with_call_id(chunk, call_id)


def _backoff(attempt: int) -> float:
    return random.uniform(0.5, 1.0) * min(2.0, 0.1 * 2**attempt)


def _retry_after(value: str | None) -> float | None:
    try:
        return min(5.0, max(0.0, float(value))) if value else None
    except ValueError:
        return None
