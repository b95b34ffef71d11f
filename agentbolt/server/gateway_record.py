"""Recording gateway calls: one ``llm_call`` event per call (see ``docs/events.md``), made
before the agent gets its answer, and the failed calls the gateway answers and records itself
(see :mod:`agentbolt.server.gateway`)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
from fastapi.responses import Response

from agentbolt.schemas import EventType
from agentbolt.server.gateway_call import ForwardedCall, json_answer
from agentbolt.server.gateway_upstreams import Upstreams
from agentbolt.server.openai_format import RESPONSES, count_usage, extract, openai_error, strip
from agentbolt.server.responses import new_id, to_response
from agentbolt.server.store_caller import StoreCaller
from agentbolt.store.calls import CallEvent

__all__ = ["CallRecorder", "upstream_error_body"]

log = logging.getLogger("agentbolt.gateway")

_LLM_CALL = EventType.LLM_CALL.value


class CallRecorder:
    """Writes a call's record to the store; every record names its model server in
    ``upstream`` (its public URL: no key)."""

    def __init__(self, call: StoreCaller, upstreams: Upstreams) -> None:
        self.call, self.upstreams = call, upstreams

    async def record(self, call: ForwardedCall, data: dict[str, Any]) -> int | None:
        """Record the call; the id of its record (the call id the agent gets), or ``None``
        when the store failed (the agent still gets its answer; the lost record is logged)."""
        event = CallEvent(_LLM_CALL, call.started, data)
        tried = call.try_of
        try:
            recorded = await self.call(
                self.call.store.record_call,
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

    async def success(
        self,
        call: ForwardedCall,
        full: dict[str, Any],
        status: int,
        headers: Any,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], int | None]:
        """Record a successful call (``headers``: the upstream's answer's); return the body as
        the agent gets it (without the call's id) and the id of its record (``None`` when
        recording failed)."""
        prompt_ids, choices = extract(call.endpoint, full)
        model_version = headers.get("x-model-version") or full.get("model_version")
        out = strip(full, call.wants)
        assert out is not None
        usage = out.get("usage") or count_usage(prompt_ids, choices)
        if call.responses is not None:
            out = to_response({**out, "usage": usage}, call.responses, call.response_id or new_id("resp"))
        data = self.base_data(call, status, out)
        data.update(
            prompt_token_ids=prompt_ids,
            choices=choices,
            usage=usage,
            model=full.get("model") or data["model"],
            model_version=str(model_version) if model_version is not None else None,
            **(extra or {}),
        )
        if full.get("model_version_mixed"):
            data["model_version_mixed"] = True
        # text-only (the upstream gave no ids): counted, usable from text, skipped by token trainers
        data["token_ids"] = prompt_ids is not None and all(c.get("token_ids") is not None for c in choices)
        return out, await self.record(call, data)

    def base_data(self, call: ForwardedCall, status: int | None, response: Any) -> dict[str, Any]:
        """The fields every record has, for an answer with ``status`` and ``response``."""
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
        if call.examples:  # the request holds example turns the gateway put in
            data["examples"] = call.examples
        return data

    def error_data(
        self,
        call: ForwardedCall,
        status: int | None,
        error: dict[str, Any],
        response: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        data = self.base_data(call, status, response)
        data.update(error=error, **(extra or {}))
        return data

    async def unsent(self, call: ForwardedCall, exc: httpx.HTTPError) -> Response:
        """A call that got no answer: 504 for a timeout, else 502. The agent's message names no
        server (the log does)."""
        if isinstance(exc, httpx.TimeoutException):
            return await self.failed(
                call, 504, "upstream_timeout", f"the model server timed out ({type(exc).__name__})"
            )
        message = f"the model server is unreachable ({type(exc).__name__})"
        return await self.failed(call, 502, "upstream_unavailable", message, detail=str(exc))

    async def unreadable(self, call: ForwardedCall, exc: Exception, status: int) -> Response:
        """An answer that is not JSON, or broke while it was read: 502."""
        message = f"unreadable model server answer: {exc}"
        return await self.failed(call, 502, "upstream_invalid_response", message, status)

    async def failed(
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
        call_id = await self.record(call, self.error_data(call, upstream_status, body))
        return json_answer(body, status, call_id)

    async def upstream_error(self, call: ForwardedCall, upstream: httpx.Response) -> Response:
        """Pass the upstream's error on (OpenAI-style; keys scrubbed) and record it."""
        try:
            raw = call.scrub((await upstream.aread()).decode(errors="replace"))
        finally:
            await upstream.aclose()
        body = upstream_error_body(raw, upstream.status_code)
        log.warning("model server answered %d for attempt %s", upstream.status_code, call.target.attempt_id)
        call_id = await self.record(call, self.error_data(call, upstream.status_code, body))
        return json_answer(body, upstream.status_code, call_id)


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
