"""The server's HTTP API as the clients (:mod:`agentbolt.client`) see it: each endpoint's
request described once (:class:`Api`, :class:`ApiRequest`), and what an answer means: the
parsed value, or the error the server named (``{"error": {"type": "NotFound", ...}}`` →
:class:`NotFound`), or else one chosen by status (404 :class:`NotFound`, 409
:class:`LeaseLost`/:class:`InvalidTransition`, else :class:`RequestError`); 5xx answers are
:class:`ServerError`, which the clients retry."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import orjson
from pydantic import TypeAdapter

from agentbolt.errors import (
    AgentboltError,
    AttemptEnded,
    ConfigError,
    Conflict,
    IdempotencyKeyReused,
    InvalidInput,
    InvalidTransition,
    LeaseLost,
    NotFound,
    QuotaExceeded,
    WorkerRevoked,
    WorkerTokenExpired,
)
from agentbolt.http1 import IDEMPOTENCY_KEY
from agentbolt.schemas import (
    Attempt,
    AttemptStatus,
    Claim,
    Event,
    EventCreate,
    Page,
    Resource,
    Resources,
    RewardCreate,
    RewardScore,
    RewardSlot,
    RewardSource,
    Rollout,
    RolloutCreate,
    WaitResult,
    Worker,
    new_id,
)

__all__ = [
    "EVENTS_BATCH",
    "Api",
    "ApiRequest",
    "gateway_url",
    "Registration",
    "RequestError",
    "ServerError",
    "answer_of",
    "json_bytes",
    "raise_for",
]

T = TypeVar("T")
# Rollout ids per events query, and events per page: the most the server takes (EventsQuery).
EVENTS_BATCH = 1000


class RequestError(AgentboltError, ValueError):
    """The server rejected a request (4xx other than 404/409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status_code = status


class ServerError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status = status


@dataclass
class ApiRequest(Generic[T]):
    """One request to the server: what to send, and how to parse the answer."""

    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    key: str | None = None
    """The ``Idempotency-Key`` of a write: made with the request, so every retry sends it again."""
    token: str | None = None
    """A bearer token for this request instead of the client's (a registration sends the token
    the client enrolled with, not the worker token it acts with since)."""

    @property
    def headers(self) -> dict[str, str] | None:
        headers = {IDEMPOTENCY_KEY: self.key} if self.key else {}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return headers or None


def _write(
    path: str, parse: Callable[[Any], T], json: Any = None, timeout: float | None = None
) -> ApiRequest[T]:
    """A mutating POST: a new idempotency key for this one logical call."""
    return ApiRequest("POST", path, parse, json=json, timeout=timeout, key=uuid.uuid4().hex)


# The errors a server body may name (``{"error": {"type": ...}}``), rebuilt from its message.
_ERRORS_BY_TYPE: dict[str, type[AgentboltError]] = {
    cls.__name__: cls
    for cls in (
        NotFound,
        LeaseLost,
        AttemptEnded,
        InvalidTransition,
        Conflict,
        ConfigError,
        InvalidInput,
        IdempotencyKeyReused,
        QuotaExceeded,
        WorkerRevoked,
        WorkerTokenExpired,
    )
}


def raise_for(response: httpx.Response) -> None:
    error_type = None
    try:
        body = response.json()
        message = body["error"]["message"] if "error" in body else str(body)
        error_type = body["error"].get("type") if "error" in body else None
    except Exception:
        message = response.text[:500]
    if error_type in _ERRORS_BY_TYPE:
        raise _ERRORS_BY_TYPE[error_type].from_message(message)
    # A body without a known type (a proxy's page, an older server): the status decides.
    status = response.status_code
    if status == 404:
        raise NotFound.from_message(message)
    if status == 409:
        raise (InvalidTransition.from_message(message) if "cannot go from" in message else LeaseLost(message))
    raise RequestError(status, message)


def answer_of(call: ApiRequest[T], response: httpx.Response) -> T:
    """The parsed answer to ``call``; raises :class:`ServerError` (5xx: retried) or the error
    a 4xx names."""
    if response.status_code >= 500:
        raise ServerError(response.status_code, response.text)
    if response.status_code >= 400:
        raise_for(response)
    return call.parse(response.json())


def _adapter(tp: Any) -> Callable[[Any], Any]:
    ta = TypeAdapter(tp)
    return ta.validate_python


_rollout = _adapter(Rollout)
_rollouts = _adapter(list[Rollout])
_claim = _adapter(Claim | None)
_attempt = _adapter(Attempt)
_attempts = _adapter(list[Attempt])
_resources = _adapter(Resources)
_resources_opt = _adapter(Resources | None)
_page_rollouts = _adapter(Page[Rollout])
_page_events = _adapter(Page[Event])
_page_resources = _adapter(Page[Resources])
_workers = _adapter(list[Worker])
_worker = _adapter(Worker)
_wait = _adapter(WaitResult)
_reward_slot = _adapter(RewardSlot)
_reward_scores = _adapter(list[RewardScore])


def _identity(x: Any) -> Any:
    return x


def json_bytes(value: Any) -> bytes:
    """``value`` as JSON (what httpx's ``json=`` sends; orjson where it can: integers beyond
    64 bits and other types it refuses go through the standard library)."""
    if value is None:
        return b"null"
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(value).encode()


@dataclass(frozen=True)
class Registration:
    """The identity the server issued a worker: its id, and the token bound to that id."""

    worker_id: str
    worker_token: str
    token_ttl_seconds: float | None = None
    """How long the token stays valid once the worker goes unseen; None: never expires (or a
    server that does not say)."""


def _registration(body: Any) -> Registration:
    ttl = body.get("token_ttl_seconds")
    return Registration(
        worker_id=str(body["worker_id"]),
        worker_token=str(body["worker_token"]),
        token_ttl_seconds=None if ttl is None else float(ttl),
    )


class Api:
    """Every endpoint's request, described once: both clients send these, so they cannot
    drift apart."""

    @staticmethod
    def health() -> ApiRequest[dict[str, Any]]:
        return ApiRequest("GET", "/health", _identity)

    @staticmethod
    def get_rollout(rollout_id: str) -> ApiRequest[Rollout]:
        return ApiRequest("GET", f"/api/rollouts/{rollout_id}", _rollout)

    @staticmethod
    def list_attempts(rollout_id: str) -> ApiRequest[list[Attempt]]:
        return ApiRequest("GET", f"/api/rollouts/{rollout_id}/attempts", _attempts)

    @staticmethod
    def get_resources(version: int) -> ApiRequest[Resources]:
        return ApiRequest("GET", f"/api/resources/{version}", _resources)

    @staticmethod
    def latest_resources() -> ApiRequest[Resources | None]:
        return ApiRequest("GET", "/api/resources/latest", _resources_opt)

    @staticmethod
    def list_resources(limit: int, cursor: str | None) -> ApiRequest[Page[Resources]]:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return ApiRequest("GET", "/api/resources", _page_resources, params=params)

    @staticmethod
    def list_workers() -> ApiRequest[list[Worker]]:
        return ApiRequest("GET", "/api/workers", _workers)

    @staticmethod
    def stats() -> ApiRequest[dict[str, Any]]:
        return ApiRequest("GET", "/api/stats", _identity)

    @staticmethod
    def enqueue(items: Sequence[RolloutCreate]) -> ApiRequest[list[Rollout]]:
        """Items without an id get one here: with its ids fixed, a retry finds the rollouts its
        first try stored, even on a server that no longer holds the key."""
        rollouts = [i.model_dump(mode="json", exclude_none=True) for i in items]
        for rollout in rollouts:
            rollout.setdefault("id", new_id("ro"))
        return _write("/api/rollouts", _rollouts, json={"rollouts": rollouts})

    @staticmethod
    def register_worker(name: str | None, token: str | None) -> ApiRequest[Registration]:
        call = _write("/api/workers/register", _registration, json={"name": name})
        call.token = token
        return call

    @staticmethod
    def revoke_worker(worker_id: str) -> ApiRequest[Worker]:
        return _write(f"/api/workers/{worker_id}/revoke", _worker)

    @staticmethod
    def dequeue(worker_id: str, lease_seconds: float | None, wait: float = 0.0) -> ApiRequest[Claim | None]:
        body = {"worker_id": worker_id, "lease_seconds": lease_seconds, "wait": wait}
        return _write("/api/dequeue", _claim, json=body, timeout=wait + 30 if wait else None)

    @staticmethod
    def heartbeat(attempt_id: str, worker_id: str | None, lease_seconds: float | None) -> ApiRequest[Attempt]:
        body = {"worker_id": worker_id, "lease_seconds": lease_seconds}
        return _write(f"/api/attempts/{attempt_id}/heartbeat", _attempt, json=body)

    @staticmethod
    def add_events(attempt_id: str, events: Sequence[EventCreate], worker_id: str | None) -> ApiRequest[int]:
        body = {"worker_id": worker_id, "events": [e.model_dump(mode="json") for e in events]}
        return _write(f"/api/attempts/{attempt_id}/events", lambda j: int(j["added"]), json=body)

    @staticmethod
    def finish(
        attempt_id: str, status: AttemptStatus, reward: float | None, error: str | None, worker_id: str | None
    ) -> ApiRequest[Rollout]:
        body = {"status": status.value, "reward": reward, "error": error, "worker_id": worker_id}
        return _write(f"/api/attempts/{attempt_id}/finish", _rollout, json=body)

    @staticmethod
    def cancel(rollout_id: str) -> ApiRequest[Rollout]:
        return _write(f"/api/rollouts/{rollout_id}/cancel", _rollout)

    @staticmethod
    def wait(rollout_ids: Sequence[str], timeout: float) -> ApiRequest[WaitResult]:
        body = {"rollout_ids": list(rollout_ids), "timeout": timeout}
        return ApiRequest("POST", "/api/rollouts/wait", _wait, json=body, timeout=timeout + 30)

    @staticmethod
    def list_rollouts(**filters: Any) -> ApiRequest[Page[Rollout]]:
        params = {k: (v.value if hasattr(v, "value") else v) for k, v in filters.items() if v is not None}
        if "status" in params and not isinstance(params["status"], str):
            params["status"] = [s.value if hasattr(s, "value") else s for s in params["status"]]
        return ApiRequest("GET", "/api/rollouts", _page_rollouts, params=params)

    @staticmethod
    def list_events(rollout_id: str, **filters: Any) -> ApiRequest[Page[Event]]:
        params = {k: v for k, v in filters.items() if v is not None}
        return ApiRequest("GET", f"/api/rollouts/{rollout_id}/events", _page_events, params=params)

    @staticmethod
    def query_events(
        rollout_ids: Sequence[str], types: Sequence[str] | None, cursor: str | None
    ) -> ApiRequest[Page[Event]]:
        body = {
            "rollout_ids": list(rollout_ids),
            "type": list(types) if types else None,
            "limit": EVENTS_BATCH,
            "cursor": cursor,
        }
        return ApiRequest("POST", "/api/events/query", _page_events, json=body)

    @staticmethod
    def add_reward(rollout_id: str, create: RewardCreate) -> ApiRequest[RewardSlot]:
        body = create.model_dump(mode="json", exclude_none=True)
        return _write(f"/api/rollouts/{rollout_id}/rewards", _reward_slot, json=body)

    @staticmethod
    def reward_history(rollout_id: str, name: str | None) -> ApiRequest[list[RewardScore]]:
        params = {"name": name} if name is not None else {}
        return ApiRequest("GET", f"/api/rollouts/{rollout_id}/rewards", _reward_scores, params=params)

    @staticmethod
    def pending_rewards(
        name: str | None, source: RewardSource | str | None, limit: int, cursor: str | None
    ) -> ApiRequest[Page[Rollout]]:
        source = RewardSource(source).value if source else None
        params = {"name": name, "source": source, "limit": limit, "cursor": cursor}
        given = {k: v for k, v in params.items() if v is not None}
        return ApiRequest("GET", "/api/rewards/pending", _page_rollouts, params=given)

    @staticmethod
    def publish(
        resources: dict[str, Resource], metadata: dict[str, Any] | None, trial: bool
    ) -> ApiRequest[Resources]:
        body = {
            "resources": {k: v.model_dump(mode="json") for k, v in resources.items()},
            "metadata": metadata or {},
            "trial": trial,
        }
        return _write("/api/resources", _resources, json=body)


def gateway_url(base: str, rollout_id: str, attempt_id: str, role: str | None = None) -> str:
    """The OpenAI base URL of an attempt's gateway on the server at ``base``; with ``role``,
    the URL of that role's LLM resource (a call there with the role's model is the role's, even
    where other roles share the model)."""
    role_part = f"/role/{quote(role, safe='')}" if role is not None else ""
    return f"{base}/gateway/{rollout_id}/{attempt_id}{role_part}/v1"
