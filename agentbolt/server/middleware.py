"""Pure ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware on the hot path):
request-size limit and bearer-token auth with roles."""

from __future__ import annotations

import hmac
from typing import Any

import orjson

from agentbolt.server.config import Role
from agentbolt.web import error_body

__all__ = ["AuthMiddleware", "BodyLimitMiddleware", "role_allows"]

Scope = dict[str, Any]

# Paths anyone may read without a token.
OPEN_PATHS = ("/health", "/", "/favicon.ico", "/dashboard", "/static/")
# Paths a runner may write to (besides reading). Everything else that writes needs admin.
RUNNER_WRITES = ("/api/dequeue", "/api/attempts/", "/gateway/", "/v1/traces")
# POSTs that only read (their bodies are too big for a query string): any role may send them.
READ_POSTS = ("/api/events/query", "/api/rollouts/wait")


async def _send_json(
    send: Any, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    payload = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodyLimitMiddleware:
    """Answer 413 when the declared or actual body is larger than ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await _send_json(
                    send, 413, error_body(f"body larger than {self.max_bytes} bytes", "too_large")
                )
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _send_json(send, 413, error_body(f"body larger than {self.max_bytes} bytes", "too_large"))


class _TooLarge(BaseException):  # not Exception: request parsing must not swallow it
    pass


def role_allows(role: Role, method: str, path: str) -> bool:
    if role == Role.ADMIN:
        return True
    if method in ("GET", "HEAD", "OPTIONS") or (method == "POST" and path in READ_POSTS):
        return True
    return role == Role.RUNNER and path.startswith(RUNNER_WRITES)


class AuthMiddleware:
    """Bearer tokens with roles; compared in constant time. Sets ``scope["agentbolt.role"]``."""

    def __init__(self, app: Any, tokens: dict[str, Role]) -> None:
        self.app = app
        self.tokens = [(t.encode(), r) for t, r in tokens.items()]

    def _role(self, scope: Scope) -> Role | None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given:
            return None
        found = None
        for token, role in self.tokens:  # no early exit: the time taken does not tell which matched
            if hmac.compare_digest(token, given.strip()):
                found = role
        return found

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens:
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        role = self._role(scope)
        if role is None and not (method == "GET" and (path in OPEN_PATHS or path.startswith("/static/"))):
            return await _send_json(
                send,
                401,
                error_body("missing or invalid bearer token", "unauthorized"),
                ((b"www-authenticate", b"Bearer"),),
            )
        if role is not None and not role_allows(role, method, path):
            return await _send_json(
                send, 403, error_body(f"role {role.value!r} may not {method} {path}", "forbidden")
            )
        scope["agentbolt.role"] = role
        await self.app(scope, receive, send)
