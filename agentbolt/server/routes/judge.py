"""The judge proxy: ``POST /judge/v1/chat/completions``, an evaluator's model calls made with an
API key only the server holds.

An LLM judge running beside the runners (``agentbolt judge --judge-via-server``) names the model server
it wants in the header ``X-Agentbolt-Upstream`` (a base URL, e.g. ``https://api.openai.com/v1``);
the server forwards the body to ``<base_url>/chat/completions`` with the key configured for that
URL in ``ServerConfig.upstream_api_keys``, so the key never leaves the server. Only a URL listed
there (or any, where ``"*"`` is listed) is proxied: the server never calls a URL its admin did
not configure. Calls go through the gateway's connections, timeouts and retries
(:meth:`~agentbolt.server.gateway.Gateway.post`) but are not recorded as a rollout's events:
the judge records them with its score. Evaluator and admin tokens only.
"""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import orjson
from fastapi import APIRouter, Header, Request
from fastapi.responses import Response

from agentbolt.evaluators.model import UPSTREAM_HEADER
from agentbolt.server.gateway import Gateway
from agentbolt.server.gateway_call import json_answer
from agentbolt.server.gateway_record import upstream_error_body
from agentbolt.server.openai_format import CHAT, REQUEST_SCHEMAS, check_request, openai_error

__all__ = ["router"]
_DOCUMENTED: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": REQUEST_SCHEMAS[CHAT]}}}
}
_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The judge model's answer",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}

Upstream = Annotated[
    str,
    Header(
        alias=UPSTREAM_HEADER,
        max_length=2000,
        pattern=r"^https?://[!-~]+$",
        description="the judge model's base URL; the server must hold a key for it (upstream_api_keys)",
    ),
]


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(prefix="/judge/v1", tags=["rewards"])

    @api.post("/chat/completions", openapi_extra=_DOCUMENTED, responses=_ANSWER)
    async def judge_chat(request: Request, upstream: Upstream) -> Response:
        """An OpenAI chat completion forwarded to the judge model named by
        ``X-Agentbolt-Upstream``, with the key the server holds for it; 403 for a URL the
        server holds no key for. The model server's errors come back with their status, a
        timeout as 504."""
        return await forward(gateway, upstream, await request.body())

    return api


def _refused(status: int, message: str, type: str = "invalid_request_error") -> Response:
    return json_answer(openai_error(message, type, status), status)


def _key_for(gateway: Gateway, base_url: str) -> tuple[bool, str | None]:
    """Whether the server may call ``base_url``, and with which key."""
    keys = gateway.config.upstream_api_keys
    for url in (base_url, base_url.rstrip("/")):
        if url in keys:
            return True, keys[url]
    return "*" in keys, keys.get("*")


async def forward(gateway: Gateway, base_url: str, raw: bytes) -> Response:
    """Check the request, then forward it (see the module docstring)."""
    if not base_url.startswith(("http://", "https://")):
        return _refused(400, f"{UPSTREAM_HEADER} must be an http(s) base URL, got {base_url[:200]!r}")
    allowed, key = _key_for(gateway, base_url)
    if not allowed:
        message = f"the server holds no key for {base_url!r} and proxies only to the upstream URLs it was configured with"
        return _refused(403, message, "permission_error")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        return _refused(400, "the request body must be a JSON object")
    malformed = check_request(CHAT, body)
    if malformed is not None:
        return json_answer(openai_error(malformed[0], "invalid_request_error", param=malformed[1]), 400)
    if body.get("stream"):
        return _refused(400, "the judge proxy does not stream: send stream=false", "invalid_request_error")
    return await _send(gateway, f"{base_url.rstrip('/')}/chat/completions", raw, key)


async def _send(gateway: Gateway, url: str, raw: bytes, key: str | None) -> Response:
    def scrub(text: str) -> str:
        return text.replace(key, "***") if key else text

    try:
        answer = await gateway.post(url, raw, key)
        try:
            text = (await answer.aread()).decode(errors="replace")
        finally:
            await answer.aclose()
    except httpx.TimeoutException as exc:
        return _refused(504, f"the judge model timed out ({type(exc).__name__})", "upstream_timeout")
    except httpx.HTTPError as exc:
        return _refused(502, f"the judge model is unreachable: {scrub(str(exc))}", "upstream_unavailable")
    if answer.status_code >= 400:
        return json_answer(upstream_error_body(scrub(text), answer.status_code), answer.status_code)
    try:
        return json_answer(orjson.loads(text), answer.status_code)
    except orjson.JSONDecodeError:
        return _refused(
            502, f"unreadable judge model answer: {scrub(text)[:200]}", "upstream_invalid_response"
        )
