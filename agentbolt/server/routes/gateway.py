"""The gateway's routes: ``/gateway/{rollout_id}/{attempt_id}/v1/...``, and for one role of a
system of several agents ``/gateway/{rollout_id}/{attempt_id}/role/{role}/v1/...``: a call
there is the role's where its model is the role's (even when other roles share that model; a
model of another role only goes to that role, one no role has is a 404) (see
:mod:`agentbolt.server.gateway` for what a call does).

The POST routes are documented by the router but served by :class:`GatewayFastPath`, a pure
ASGI app in front of FastAPI's router, whose route matching and dependency solving cost about
as much as the rest of a call (``benchmarks/gateway_overhead.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentbolt.server.gateway import Gateway
from agentbolt.server.middleware import read_body
from agentbolt.server.openai_format import CHAT, COMPLETIONS, REQUEST_SCHEMAS, RESPONSES
from agentbolt.server.responses import REQUEST_SCHEMA as RESPONSES_SCHEMA
from agentbolt.web import error_response

__all__ = ["GatewayFastPath", "router"]

log = logging.getLogger("agentbolt.gateway")

_CALL_HEADERS = (b"idempotency-key", b"x-stainless-retry-count")  # what CallTry reads
_ENDPOINTS = {"chat/completions": CHAT, "completions": COMPLETIONS, "responses": RESPONSES}
_SCHEMAS = {**REQUEST_SCHEMAS, RESPONSES: RESPONSES_SCHEMA}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The model server's answer (a stream of server-sent events with stream=true)",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    }
}


def _openapi_body(endpoint: str) -> dict[str, Any]:
    """The request body, for the OpenAPI document (the route reads it raw)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _SCHEMAS[endpoint]}},
        }
    }


_DESCRIPTIONS = {
    CHAT: "OpenAI chat completions, forwarded to the rollout's LLM and recorded.",
    COMPLETIONS: "OpenAI (legacy) completions, forwarded to the rollout's LLM and recorded.",
    RESPONSES: (
        "OpenAI Responses API: passed to an upstream that serves it, else answered through the"
        " rollout's LLM as a chat completion and recorded with its token ids."
    ),
}
_NAMES = {CHAT: "chat_completions", COMPLETIONS: "completions", RESPONSES: "responses"}
_ROLE_DOC = " The LLM resource named in the path serves it where several share its model."


def router(gateway: Gateway) -> APIRouter:
    """The routes under ``/gateway/{rollout_id}/{attempt_id}/v1`` and under
    ``.../role/{role}/v1`` (only the latter takes a role)."""
    api = APIRouter(tags=["gateway"])
    for prefix, roles in (
        ("/gateway/{rollout_id}/{attempt_id}/v1", False),
        ("/gateway/{rollout_id}/{attempt_id}/role/{role}/v1", True),
    ):
        for path, endpoint in _ENDPOINTS.items():
            api.add_api_route(
                f"{prefix}/{path}",
                _forward(gateway, endpoint, roles),
                methods=["POST"],
                name=_NAMES[endpoint],
                openapi_extra=_openapi_body(endpoint),
                responses=_RESPONSES,
                description=_DESCRIPTIONS[endpoint] + (_ROLE_DOC if roles else ""),
            )
        api.add_api_route(f"{prefix}/models", _models(gateway, roles), methods=["GET"], name="models")
    return api


def _forward(gateway: Gateway, endpoint: str, roles: bool) -> Any:
    """The route handler forwarding ``endpoint`` calls; with ``roles``, for a role's URL."""
    if roles:

        async def forward_role(rollout_id: str, attempt_id: str, role: str, request: Request) -> Response:
            return await gateway.forward(request, rollout_id, attempt_id, endpoint, role)

        return forward_role

    async def forward(rollout_id: str, attempt_id: str, request: Request) -> Response:
        return await gateway.forward(request, rollout_id, attempt_id, endpoint)

    return forward


def _models(gateway: Gateway, roles: bool) -> Any:
    """The model-list handler; with ``roles``, for a role's URL."""
    if roles:

        async def models_role(rollout_id: str, attempt_id: str, role: str) -> Response:
            return await gateway.models(rollout_id, attempt_id, role)

        return models_role

    async def models(rollout_id: str, attempt_id: str) -> Response:
        return await gateway.models(rollout_id, attempt_id)

    return models


class GatewayFastPath:
    """Serves gateway POSTs before FastAPI's router sees them. It sits inside the auth and
    body-limit middleware, like every route."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        call = _gateway_post(scope)
        if call is None:
            await self.app(scope, receive, send)
            return
        rollout_id, attempt_id, endpoint, role = call
        started, t0 = time.time(), time.perf_counter()
        # the body and the two headers a call reads, straight from ASGI: Starlette's request
        # object costs more than they do
        body = await read_body(receive)
        if body is None:
            return  # the agent went away before its call was sent: nothing to answer
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _CALL_HEADERS
        }
        try:
            response = await self.gateway.forward_raw(
                body, headers, rollout_id, attempt_id, endpoint, started, t0, role
            )
        except Exception:
            log.exception("gateway call on %s failed", scope["path"])
            response = error_response(
                500, "internal gateway error (see the server log)", "internal_error", param=None, code=None
            )
        await response(scope, receive, send)


def _gateway_post(scope: dict[str, Any]) -> tuple[str, str, str, str | None] | None:
    """(rollout id, attempt id, endpoint, role or None) of a gateway POST; ``None`` for any
    other request."""
    path = scope.get("path", "")
    if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith("/gateway/"):
        return None
    parts = path.split("/", 5)  # "", "gateway", rollout, attempt, "v1", endpoint
    role = None
    if len(parts) == 6 and parts[4] == "role":  # ... attempt, "role", name/v1/endpoint
        role, slash, rest = parts[5].partition("/v1/")
        parts = [*parts[:4], "v1", rest] if slash and role and "/" not in role else []
    endpoint = _ENDPOINTS.get(parts[5]) if len(parts) == 6 and parts[4] == "v1" else None
    if endpoint is None or not (parts[2] and parts[3]):
        return None
    return parts[2], parts[3], endpoint, role
