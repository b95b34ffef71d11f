"""Pure ASGI middleware (cheaper than Starlette's BaseHTTPMiddleware on the hot path):
request-size limit and bearer-token auth with roles.

Two kinds of bearer token: those the server was configured with (admin, runner, reader), and
those the store issued: a worker token (``wt_...``, a runner bound to its worker id) and an
attempt's agent key (``ak_...``, only that attempt's gateway routes and events URL). Issued
credentials are checked whether or not tokens are configured: with none configured, a request
without a token may still do anything (loopback use), but a foreign or unknown issued
credential is refused.

With ``registered_runners_only`` a configured runner token may only read and register: every
write then comes with a worker token, bound to its worker (no runner can name another's worker
id). A worker token is refused (401) once an admin revoked its worker (``WorkerRevoked``) or when its
worker has not been seen for ``ServerConfig.worker_token_ttl`` seconds (``WorkerTokenExpired``:
the runner registers again). Issued credentials are looked up in the store once and kept
(:class:`IssuedCredentials`); a worker token is looked up again after :data:`RECHECK_S` seconds,
so a revocation reaches every replica within that time, and the replica that revoked at once.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

import orjson

from agentbolt.errors import NotFound, WorkerRevoked, WorkerTokenExpired
from agentbolt.evaluators.model import JUDGE_PROXY_PATH
from agentbolt.server.config import Role
from agentbolt.server.store_caller import StoreCaller
from agentbolt.store.sql import AGENT_KEY_PREFIX, WORKER_TOKEN_PREFIX, token_sha256
from agentbolt.web import error_body

__all__ = ["RECHECK_S", "AuthMiddleware", "BodyLimitMiddleware", "Caller", "IssuedCredentials", "role_allows"]

Scope = dict[str, Any]

# Paths anyone may read without a token.
OPEN_PATHS = ("/health", "/", "/favicon.ico", "/dashboard", "/static/")
# Paths a runner may write to (besides reading): these prefixes, and registration (exactly: a
# worker id may start with "register"). Everything else that writes needs admin.
RUNNER_WRITES = (
    "/api/dequeue",
    "/api/attempts/",
    "/gateway/",
    "/agent/",
    "/v1/traces",
)
RUNNER_REGISTERS = "/api/workers/register"
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


@dataclass(frozen=True)
class Caller:
    """Who sent a request (``scope["agentbolt.caller"]``): its role, the name its configured
    token was given, and what an issued credential binds it to: a worker id, or one attempt."""

    role: Role
    name: str | None = None  # who holds a configured token (ServerConfig.token_names)
    worker_id: str | None = None
    rollout_id: str | None = None
    attempt_id: str | None = None

    def allows(self, method: str, path: str) -> bool:
        if self.role == Role.AGENT:
            return _own_attempt_path(path, self.rollout_id, self.attempt_id) or (
                method == "GET" and _open(path)
            )
        return role_allows(self.role, method, path)


def role_allows(role: Role, method: str, path: str) -> bool:
    if role == Role.ADMIN:
        return True
    if role == Role.AGENT:  # only through Caller.allows, which knows its attempt
        return False
    if method in ("GET", "HEAD", "OPTIONS") or (method == "POST" and path in READ_POSTS):
        return True
    if role == Role.RUNNER:
        return path.startswith(RUNNER_WRITES) or path == RUNNER_REGISTERS
    scores = method == "POST" and _rewards_path(path)
    if role == Role.REVIEWER:
        return scores
    return role == Role.EVALUATOR and (scores or (method == "POST" and path == JUDGE_PROXY_PATH))


def _rewards_path(path: str) -> bool:
    """``/api/rollouts/{rollout_id}/rewards``: where reviewers and evaluators score."""
    parts = path.split("/")  # "", "api", "rollouts", id, "rewards"
    return len(parts) == 5 and parts[1:3] == ["api", "rollouts"] and bool(parts[3]) and parts[4] == "rewards"


def _own_attempt_path(path: str, rollout_id: str | None, attempt_id: str | None) -> bool:
    """The attempt's gateway routes and its events URL, and no other path."""
    gateway = f"/gateway/{rollout_id}/{attempt_id}/"
    return path.startswith(gateway) or path == f"/agent/{rollout_id}/{attempt_id}/events"


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/static/")


def _bearer(scope: Scope) -> bytes:
    header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, given = header.partition(b" ")
    return given.strip() if scheme.lower() == b"bearer" else b""


_ISSUED = (AGENT_KEY_PREFIX.encode(), WORKER_TOKEN_PREFIX.encode())  # an issued credential's prefixes

_CACHE_LIMIT = 100_000
RECHECK_S = 10.0
"""Seconds a worker token found valid is trusted before the store is asked again (revocation,
expiry). An agent key's binding never changes: it is kept."""


class IssuedCredentials:
    """Issued credentials found in the store, kept per process (one object for the app's two
    auth middleware instances and the routes that revoke): unknown ones are not kept, so
    guesses do not fill memory."""

    def __init__(self, limit: int = _CACHE_LIMIT, recheck_s: float | None = None) -> None:
        self.limit = limit
        self.recheck_s = RECHECK_S if recheck_s is None else recheck_s
        self._found: dict[bytes, tuple[Caller, float]] = {}

    def get(self, given: bytes) -> Caller | None:
        entry = self._found.get(given)
        if entry is None:
            return None
        caller, found_at = entry
        if caller.worker_id is not None and time.monotonic() - found_at > self.recheck_s:
            del self._found[given]
            return None
        return caller

    def put(self, given: bytes, caller: Caller) -> None:
        if len(self._found) >= self.limit:
            self._found.clear()
        self._found[given] = (caller, time.monotonic())

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's token (just revoked): its next request is looked up again."""
        for given in [g for g, (c, _) in self._found.items() if c.worker_id == worker_id]:
            del self._found[given]


class AuthMiddleware:
    """Bearer tokens with roles: configured ones compared in constant time, issued ones (see
    the module docstring) looked up in the store. Sets ``scope["agentbolt.role"]`` and
    ``scope["agentbolt.caller"]``."""

    def __init__(
        self,
        app: Any,
        tokens: dict[str, Role],
        call: StoreCaller,
        names: dict[str, str] | None = None,
        issued: IssuedCredentials | None = None,
        worker_token_ttl: float | None = None,
        registered_runners_only: bool = False,
    ) -> None:
        self.app, self.call = app, call
        names = names or {}
        self.tokens = [(t.encode(), Caller(r, name=names.get(t))) for t, r in tokens.items()]
        self.issued = issued or IssuedCredentials()
        self.worker_token_ttl = worker_token_ttl
        self.registered_runners_only = registered_runners_only

    def _configured(self, given: bytes) -> Caller | None:
        if not given:
            return None
        found = None
        for token, caller in self.tokens:  # no early exit: the time taken does not tell which matched
            if hmac.compare_digest(token, given):
                found = caller
        return found

    async def _issued_caller(self, given: bytes) -> Caller | str | None:
        """The caller an issued credential names; None when the store issued no such one; the
        error type (``WorkerRevoked``, ``WorkerTokenExpired``) of a worker token no longer valid."""
        caller = self.issued.get(given)
        if caller is not None:
            return caller
        text = given.decode("ascii", "replace")
        if text.startswith(AGENT_KEY_PREFIX):
            found = await self.call(self.call.store.attempt_of_agent_key, text)
            if found is not None:
                caller = Caller(Role.AGENT, rollout_id=found[0], attempt_id=found[1])
        else:
            worker = await self.call(self.call.store.worker_of_token_sha256, token_sha256(text))
            if worker is None:
                return None
            if worker.revoked_at is not None:
                return WorkerRevoked.__name__
            ttl = self.worker_token_ttl
            if ttl is not None and time.time() - worker.last_seen > ttl:
                return WorkerTokenExpired.__name__
            caller = Caller(Role.RUNNER, worker_id=worker.worker_id)
        if caller is not None:
            self.issued.put(given, caller)
        return caller

    async def _caller(self, given: bytes) -> Caller | str | None:
        caller = self._configured(given)
        if caller is None and given.startswith(_ISSUED):
            return await self._issued_caller(given)
        return caller

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method, given = scope["path"], scope["method"], _bearer(scope)
        issued = given.startswith(_ISSUED)
        if not self.tokens and not issued:  # no auth configured: see the module docstring
            return await self.app(scope, receive, send)
        caller = await self._caller(given)
        if isinstance(caller, str):
            return await _send_json(
                send, 401, error_body(_INVALID[caller], caller), ((b"www-authenticate", b"Bearer"),)
            )
        if caller is None and (issued or not (method == "GET" and _open(path))):
            what = "unknown agent key or worker token" if issued else "missing or invalid bearer token"
            return await _send_json(
                send, 401, error_body(what, "unauthorized"), ((b"www-authenticate", b"Bearer"),)
            )
        if caller is not None and not caller.allows(method, path):
            return await _send_json(send, 403, error_body(_refusal(caller, method, path), "forbidden"))
        if self.registered_runners_only and _unregistered_runner_write(caller, method, path):
            return await _send_json(send, 403, error_body(_REGISTER_FIRST, "forbidden"))
        if caller is not None and caller.worker_id is not None and await self._held_elsewhere(caller, path):
            message = (
                f"this worker token belongs to worker {caller.worker_id!r}, which does not hold this attempt"
            )
            return await _send_json(send, 403, error_body(message, "forbidden"))
        scope["agentbolt.role"] = caller.role if caller is not None else None
        scope["agentbolt.caller"] = caller
        await self.app(scope, receive, send)

    async def _held_elsewhere(self, caller: Caller, path: str) -> bool:
        """A worker token on the gateway of an attempt its worker does not hold (an unknown
        attempt is left to the gateway's 404)."""
        parts = path.split("/", 4)  # "", "gateway", rollout, attempt, ...
        if len(parts) < 4 or parts[1] != "gateway":
            return False
        try:
            attempt = await self.call(self.call.store.get_attempt, parts[3])
        except NotFound:
            return False
        return attempt.worker_id != caller.worker_id


_INVALID = {
    WorkerRevoked.__name__: "this worker token's worker was revoked by an admin: the token no longer works",
    WorkerTokenExpired.__name__: (
        "this worker token expired (its worker was not seen for longer than the server's "
        "worker_token_ttl): register again with the runner token"
    ),
}


_REGISTER_FIRST = (
    "this server takes work only from registered runners (registered_runners_only): a runner "
    "token may read and register (POST /api/workers/register), then acts with the worker token "
    "it is issued"
)


def _unregistered_runner_write(caller: Caller | None, method: str, path: str) -> bool:
    """A configured runner token (not a worker token) writing anything but a registration."""
    if caller is None or caller.role != Role.RUNNER or caller.worker_id is not None:
        return False
    reads = method in ("GET", "HEAD", "OPTIONS") or (method == "POST" and path in READ_POSTS)
    return not reads and path != RUNNER_REGISTERS


def _refusal(caller: Caller, method: str, path: str) -> str:
    if caller.role == Role.AGENT:
        return (
            f"an agent key may only call its own attempt's gateway and events URL "
            f"(/gateway/{caller.rollout_id}/{caller.attempt_id}/..., "
            f"/agent/{caller.rollout_id}/{caller.attempt_id}/events), not {method} {path}"
        )
    return f"role {caller.role.value!r} may not {method} {path}"


async def read_body(receive: Any) -> bytes | None:
    """A request's whole body straight from ASGI (the fast paths'); None when the client went
    away before sending it."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    if not message.get("more_body"):  # the whole body in one message: the usual case
        body: bytes = message.get("body", b"")
        return body
    chunks = [message.get("body", b"")]
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
