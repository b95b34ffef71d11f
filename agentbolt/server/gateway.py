"""The gateway: an OpenAI-compatible endpoint per attempt that records every model call.

``/gateway/{rollout_id}/{attempt_id}/v1/{chat/completions,completions,responses,models}`` forwards
to the upstream named by the rollout's ``LLM`` resource (the ``base_url`` as published; with
``upstreams`` too, one of those servers per attempt: :mod:`.gateway_upstreams`). A
Responses call goes to an upstream's own ``/responses`` as the agent wrote it, plus vLLM's asks
for token ids and logprobs (``enable_response_messages``, ``include``: :mod:`.responses_ids`),
and is recorded with those ids (text-only where the upstream gives none: a hosted API, a
gpt-oss model); where that is a 404 or 405 (remembered per upstream: the embedded engine,
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
- An upstream that rejects ``return_token_ids`` or ``logprobs`` the gateway added (on
  ``/responses``: ``enable_response_messages`` or ``logprobs``; a 400 naming it) is asked again
  without just that one, and that is remembered per upstream; an extra the
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
  through a lean keep-alive transport (:mod:`.gateway_send`).

One module each: sending to the model server (:mod:`.gateway_send`), recording
(:mod:`.gateway_record`), streams (:mod:`.gateway_stream`), the Responses pass-through and
history (:mod:`.gateway_responses`); this one resolves a call and puts them together.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from agentbolt.errors import AttemptEnded
from agentbolt.schemas import LLM, AttemptStatus
from agentbolt.server.config import ServerConfig
from agentbolt.server.gateway_access import UpstreamKeys
from agentbolt.server.gateway_call import CallTry, ForwardedCall, Refused, Target, json_answer
from agentbolt.server.gateway_quota import CallQuota, key_reused
from agentbolt.server.gateway_record import CallRecorder
from agentbolt.server.gateway_responses import ResponsesUpstream, chat_for
from agentbolt.server.gateway_send import UpstreamSender
from agentbolt.server.gateway_stream import relay
from agentbolt.server.gateway_upstreams import rank_servers
from agentbolt.server.openai_format import CHAT, RESPONSES, check_request, openai_error, prepare
from agentbolt.server.responses import Untranslatable, new_id, with_history
from agentbolt.server.store_caller import StoreCaller
from agentbolt.turns import insert_examples

__all__ = ["Gateway"]


class Gateway:
    """What the routes use: :meth:`forward` (or :meth:`forward_raw`) a call, :meth:`models`,
    and :meth:`post` for the judge proxy's unrecorded calls."""

    def __init__(self, call: StoreCaller, config: ServerConfig) -> None:
        self.call, self.store, self.config = call, call.store, config
        self.keys = UpstreamKeys(call, config)
        self.sender = UpstreamSender(config, self.keys)
        self.upstreams = self.sender.upstreams
        self.recorder = CallRecorder(call, self.upstreams)
        self.responses = ResponsesUpstream(self.sender, self.recorder, call)
        self._targets: OrderedDict[str, Target] = OrderedDict()
        self.quota = CallQuota(config.quota_calls)

    async def aclose(self) -> None:
        await self.sender.aclose()

    async def post(self, url: str, content: bytes, key: str | None) -> httpx.Response:
        """POST a JSON body to a model server, unrecorded (see :meth:`UpstreamSender.post`)."""
        return await self.sender.post(url, content, key)

    # ------------------------------------------------------------------ resolving a call

    async def target(self, rollout_id: str, attempt_id: str, try_of: CallTry | None = None) -> Target:
        """The attempt's target, if it takes this call: running, under its quota, and (for a
        try with an idempotency key) the key unused or sent with the same body."""
        key = try_of.key if try_of is not None else None
        # read on every call; with a key, the hash of the body its record was made with too
        state = await self.call.read(self.store.attempt_state, attempt_id, key)
        if state is None:
            raise Refused(404, f"attempt {attempt_id!r} not found", "not_found_error")
        if state[0] != rollout_id:
            raise Refused(
                404, f"attempt {attempt_id!r} is not part of rollout {rollout_id!r}", "not_found_error"
            )
        if state[1] != AttemptStatus.RUNNING:
            message = f"attempt {attempt_id!r} is {state[1]}, not running: it takes no more calls"
            raise Refused(409, message, AttemptEnded.__name__)
        if try_of is not None:
            if key is not None and state[2] is not None and state[2] != try_of.body_sha256:
                raise key_reused(key)
            self.quota.take(attempt_id)
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

    async def _route(
        self,
        rollout_id: str,
        attempt_id: str,
        model: Any,
        try_of: CallTry | None = None,
        role: str | None = None,
    ) -> tuple[Target, str, LLM, str, str | None]:
        """The attempt, the resource serving the call (``role``'s, else ``model``'s), its
        server and that server's key."""
        target = await self.target(rollout_id, attempt_id, try_of)
        resource, llm = target.pick(model, role)
        server = self.server(target, resource, llm)
        return target, resource, llm, server, await self.keys.resolve(llm, target.resources_version, server)

    # ------------------------------------------------------------------ forwarding

    async def forward(
        self, request: Request, rollout_id: str, attempt_id: str, endpoint: str, role: str | None = None
    ) -> Response:
        started, t0 = time.time(), time.perf_counter()
        return await self.forward_raw(
            await request.body(), request.headers, rollout_id, attempt_id, endpoint, started, t0, role
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
        role: str | None = None,
    ) -> Response:
        """Forward one call: its body as sent, and its headers (``idempotency-key`` and
        ``x-stainless-retry-count`` are read, in lower case); ``started``: its wall-clock time,
        ``t0``: its ``perf_counter``; ``role``: the LLM resource its URL named, if any."""
        asked = _asked(raw, endpoint)
        if isinstance(asked, Response):
            return asked
        try_of = CallTry.of(headers, raw)
        try:
            target, resource, llm, server, key = await self._route(
                rollout_id, attempt_id, (asked.responses or asked.body).get("model"), try_of, role
            )
        except Refused as exc:
            return exc.response()
        responses = asked.responses
        # example turns go into the chat form: a Responses call that carries them is translated
        if responses is not None and not llm.examples and self.responses.may_serve(server):
            payload, wants = self.responses.prepare(server, responses)
            passed = ForwardedCall(
                target, resource, llm, RESPONSES, responses, wants, key, started, t0, try_of, upstream=server
            )
            answer = await self.responses.send(passed, payload)
            if answer is not None:
                return answer
            server, key = passed.upstream, passed.key  # where the pass-through went
        body = await self._chat_body(asked, target)
        if isinstance(body, Response):
            return body
        body, examples = insert_examples(body, llm.examples)
        rejected = self.sender.rejected(server)
        payload, wants = prepare(
            asked.endpoint, body, "return_token_ids" not in rejected, "logprobs" not in rejected
        )
        response_id = new_id("resp") if responses is not None else None
        call = ForwardedCall(
            target,
            resource,
            llm,
            asked.endpoint,
            body,
            wants,
            key,
            started,
            t0,
            try_of,
            responses,
            response_id,
            upstream=server,
            examples=examples,
        )
        return await self._send(call, payload)

    async def _chat_body(self, asked: _Asked, target: Target) -> dict[str, Any] | Response:
        """The request to send; for a Responses call its chat form, with the history its
        ``previous_response_id`` brings (or the 400 the call gets)."""
        if asked.untranslatable is not None:
            error = openai_error(
                str(asked.untranslatable), "invalid_request_error", param=asked.untranslatable.param
            )
            return json_answer(error, 400)
        responses = asked.responses
        if responses is None or responses.get("previous_response_id") is None:
            return asked.body
        try:
            history = await self.responses.history(target, responses["previous_response_id"])
        except Refused as exc:
            return exc.response()
        return with_history(asked.body, responses, history)

    async def _send(self, call: ForwardedCall, payload: dict[str, Any]) -> Response:
        """Send the call and answer the agent: its answer (streamed as it came) or its error,
        recorded either way."""
        try:
            upstream = await self.sender.send(call, payload)
        except httpx.HTTPError as exc:
            return await self.recorder.unsent(call, exc)
        if upstream.status_code >= 400:
            return await self.recorder.upstream_error(call, upstream)
        if call.request.get("stream"):
            return StreamingResponse(
                relay(self.recorder, call, upstream),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            full = orjson.loads(await upstream.aread())
        except (orjson.JSONDecodeError, httpx.HTTPError) as exc:
            return await self.recorder.unreadable(call, exc, upstream.status_code)
        out, call_id = await self.recorder.success(call, full, upstream.status_code, upstream.headers)
        return json_answer(out, upstream.status_code, call_id)

    # ------------------------------------------------------------------ models

    async def models(self, rollout_id: str, attempt_id: str, role: str | None = None) -> Response:
        """The upstream's model list, or one built from the rollout's LLM resources."""
        try:
            target, _, _, server, key = await self._route(rollout_id, attempt_id, None, role=role)
        except Refused as exc:
            return exc.response()
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with contextlib.suppress(httpx.HTTPError, orjson.JSONDecodeError):
            answer = await self.sender.http.get(f"{server.rstrip('/')}/models", headers=headers, timeout=10)
            if answer.status_code == 200:
                return json_answer(orjson.loads(answer.content))
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "agentbolt"}
            for m in dict.fromkeys(x.model for x in target.llms.values())
        ]
        return json_answer({"object": "list", "data": data})


@dataclass(frozen=True)
class _Asked:
    """A call's request as the gateway sends it: for a Responses call, ``responses`` is the
    agent's request and ``body`` its chat form (none when it has none: ``untranslatable``)."""

    endpoint: str
    body: dict[str, Any]
    responses: dict[str, Any] | None = None
    untranslatable: Untranslatable | None = None


def _asked(raw: bytes, endpoint: str) -> _Asked | Response:
    """The request in ``raw``, or the 400 a malformed one gets."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        return json_answer(
            openai_error("the request body must be a JSON object", "invalid_request_error"), 400
        )
    if endpoint != RESPONSES:
        return _malformed(endpoint, body) or _Asked(endpoint, body)
    try:  # its chat form; an upstream that serves /responses needs none
        chat = chat_for(body)
    except Untranslatable as exc:
        return _Asked(CHAT, {}, body, exc)
    return _malformed(CHAT, chat) or _Asked(CHAT, chat, body)


def _malformed(endpoint: str, body: dict[str, Any]) -> Response | None:
    malformed = check_request(endpoint, body)
    if malformed is None:
        return None
    return json_answer(openai_error(malformed[0], "invalid_request_error", param=malformed[1]), 400)
