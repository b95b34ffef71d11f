"""HTTP clients for the server: :class:`Client` (sync) and :class:`AsyncClient`.

Every call has a timeout. Connection errors and 5xx answers are retried with exponential
backoff and full jitter, and a call still failing is logged (a warning at its third failure,
then at every twentieth), so a client that rides out an outage says so. An outage (no
connection, 502, 503, 504) is retried up to ``RetryPolicy.attempts`` times (forever for the
runner); a 500 answer, the server failing on this very request, which sending it again usually
meets again, at most ``RetryPolicy.server_errors`` times, so that one request the server cannot
handle ends in an error its caller handles (the runner fails that attempt with the reason)
rather than a slot retrying it forever. 4xx answers are never retried and raise the error the server names in
its body (``{"error": {"type": "NotFound", ...}}`` → :class:`NotFound`), or else one chosen by
status (404 :class:`NotFound`, 409 :class:`LeaseLost`/:class:`InvalidTransition`, else
:class:`RequestError`).

Retrying a write is safe because every mutating call carries an ``Idempotency-Key`` made once
per call and sent again by each retry: the server answers a repeated key with the first result
(a retried enqueue returns the same rollouts, a retried dequeue the same claim). Enqueue also
names every rollout itself before sending.

Each endpoint's request is described once (:class:`_Request`) and sent by either transport, so
the two clients cannot drift apart. :meth:`Client.pages` follows a paged endpoint's cursors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import ssl
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import httpx
import orjson
from pydantic import TypeAdapter

from agentbolt.errors import (
    AgentboltError,
    AttemptEnded,
    ConfigError,
    Conflict,
    InvalidInput,
    InvalidTransition,
    LeaseLost,
    NotFound,
    ServerUnavailable,
    WorkerRevoked,
    WorkerTokenExpired,
)
from agentbolt.http1 import IDEMPOTENCY_KEY, Http1Transport, lean_mounts
from agentbolt.schemas import (
    Attempt,
    AttemptStatus,
    Claim,
    Event,
    EventCreate,
    Mode,
    Page,
    Resource,
    Resources,
    RewardCreate,
    RewardScore,
    RewardSlot,
    RewardSource,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    WaitResult,
    Worker,
    new_id,
)

__all__ = ["AsyncClient", "Client", "Registration", "RequestError", "RetryPolicy"]

T = TypeVar("T")
log = logging.getLogger("agentbolt.client")
# Rollout ids per events query, and events per page: the most the server takes (EventsQuery).
_EVENTS_BATCH = 1000


class RequestError(AgentboltError, ValueError):
    """The server rejected a request (4xx other than 404/409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status_code = status


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    """Tries per call; ``0`` retries forever (the runner uses that while the server is down)."""
    base_delay: float = 0.2
    max_delay: float = 10.0
    server_errors: int = 5
    """Tries per call answered HTTP 500, even when ``attempts`` is 0: the server failed on this
    request, and a fault of its own is not an outage to wait out."""

    def delay(self, attempt: int) -> float:
        # the exponent capped: 2.0**1024 overflows, which a runner retrying forever would reach
        return random.uniform(0, min(self.max_delay, self.base_delay * 2.0 ** min(attempt, 64)))

    def gives_up(self, attempt: int, server_errors: int = 0) -> bool:
        """After the call's ``attempt + 1``-th failure, ``server_errors`` of them HTTP 500."""
        if server_errors >= max(self.server_errors, 1):
            return True
        return self.attempts > 0 and attempt + 1 >= self.attempts


class _Retries:
    """One call's failures so far: decides whether to try again, and says when it keeps failing."""

    __slots__ = ("call", "client", "failures", "server_errors")

    def __init__(self, client: _Base, call: _Request[Any]) -> None:
        self.client, self.call = client, call
        self.failures = self.server_errors = 0

    def delay_after(self, exc: Exception) -> float:
        """The wait before the next try; raises ``exc`` (not retryable) or
        :class:`ServerUnavailable` (given up)."""
        if not _retryable(exc):
            raise exc
        if isinstance(exc, _ServerError) and exc.status == 500:
            self.server_errors += 1
        policy, call = self.client.retry, self.call
        self.failures += 1
        if policy.gives_up(self.failures - 1, self.server_errors):
            raise ServerUnavailable(
                f"{call.method} {self.client.url}{call.path} failed after {self.failures} tries: {exc}"
            ) from exc
        if self.failures == 3 or self.failures % 20 == 0:
            log.warning(
                "%s %s%s has failed %d times (%s); trying again",
                call.method,
                self.client.url,
                call.path,
                self.failures,
                exc,
            )
        return policy.delay(self.failures - 1)


@dataclass
class _Request(Generic[T]):
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
) -> _Request[T]:
    """A mutating POST: a new idempotency key for this one logical call."""
    return _Request("POST", path, parse, json=json, timeout=timeout, key=uuid.uuid4().hex)


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
        WorkerRevoked,
        WorkerTokenExpired,
    )
}


def _raise_for(response: httpx.Response) -> None:
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


def _retryable(exc: Exception) -> bool:
    return isinstance(exc, httpx.TransportError) or (isinstance(exc, _ServerError) and exc.status >= 500)


class _ServerError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:200]}")
        self.status = status


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


_USER_AGENT = b"agentbolt-client"


def _json_bytes(value: Any) -> bytes:
    """``value`` as JSON (what httpx's ``json=`` sends; orjson where it can: integers beyond
    64 bits and other types it refuses go through the standard library)."""
    if value is None:
        return b"null"
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(value).encode()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, as httpx makes by default (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` honoured): each client building its own costs tens of milliseconds."""
    return httpx.create_ssl_context()


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


class _Api:
    """Endpoint descriptions shared by both clients."""

    @staticmethod
    def enqueue(items: Sequence[RolloutCreate]) -> _Request[list[Rollout]]:
        """Items without an id get one here: with its ids fixed, a retry finds the rollouts its
        first try stored, even on a server that no longer holds the key."""
        rollouts = [i.model_dump(mode="json", exclude_none=True) for i in items]
        for rollout in rollouts:
            rollout.setdefault("id", new_id("ro"))
        return _write("/api/rollouts", _rollouts, json={"rollouts": rollouts})

    @staticmethod
    def register_worker(name: str | None, token: str | None) -> _Request[Registration]:
        call = _write("/api/workers/register", _registration, json={"name": name})
        call.token = token
        return call

    @staticmethod
    def revoke_worker(worker_id: str) -> _Request[Worker]:
        return _write(f"/api/workers/{worker_id}/revoke", _worker)

    @staticmethod
    def dequeue(worker_id: str, lease_seconds: float | None, wait: float = 0.0) -> _Request[Claim | None]:
        body = {"worker_id": worker_id, "lease_seconds": lease_seconds, "wait": wait}
        return _write("/api/dequeue", _claim, json=body, timeout=wait + 30 if wait else None)

    @staticmethod
    def heartbeat(attempt_id: str, worker_id: str | None, lease_seconds: float | None) -> _Request[Attempt]:
        body = {"worker_id": worker_id, "lease_seconds": lease_seconds}
        return _write(f"/api/attempts/{attempt_id}/heartbeat", _attempt, json=body)

    @staticmethod
    def add_events(attempt_id: str, events: Sequence[EventCreate], worker_id: str | None) -> _Request[int]:
        body = {"worker_id": worker_id, "events": [e.model_dump(mode="json") for e in events]}
        return _write(f"/api/attempts/{attempt_id}/events", lambda j: int(j["added"]), json=body)

    @staticmethod
    def finish(
        attempt_id: str, status: AttemptStatus, reward: float | None, error: str | None, worker_id: str | None
    ) -> _Request[Rollout]:
        body = {"status": status.value, "reward": reward, "error": error, "worker_id": worker_id}
        return _write(f"/api/attempts/{attempt_id}/finish", _rollout, json=body)

    @staticmethod
    def cancel(rollout_id: str) -> _Request[Rollout]:
        return _write(f"/api/rollouts/{rollout_id}/cancel", _rollout)

    @staticmethod
    def wait(rollout_ids: Sequence[str], timeout: float) -> _Request[WaitResult]:
        body = {"rollout_ids": list(rollout_ids), "timeout": timeout}
        return _Request("POST", "/api/rollouts/wait", _wait, json=body, timeout=timeout + 30)

    @staticmethod
    def list_rollouts(**filters: Any) -> _Request[Page[Rollout]]:
        params = {k: (v.value if hasattr(v, "value") else v) for k, v in filters.items() if v is not None}
        if "status" in params and not isinstance(params["status"], str):
            params["status"] = [s.value if hasattr(s, "value") else s for s in params["status"]]
        return _Request("GET", "/api/rollouts", _page_rollouts, params=params)

    @staticmethod
    def list_events(rollout_id: str, **filters: Any) -> _Request[Page[Event]]:
        params = {k: v for k, v in filters.items() if v is not None}
        return _Request("GET", f"/api/rollouts/{rollout_id}/events", _page_events, params=params)

    @staticmethod
    def query_events(
        rollout_ids: Sequence[str], types: Sequence[str] | None, cursor: str | None
    ) -> _Request[Page[Event]]:
        body = {
            "rollout_ids": list(rollout_ids),
            "type": list(types) if types else None,
            "limit": _EVENTS_BATCH,
            "cursor": cursor,
        }
        return _Request("POST", "/api/events/query", _page_events, json=body)

    @staticmethod
    def add_reward(rollout_id: str, create: RewardCreate) -> _Request[RewardSlot]:
        body = create.model_dump(mode="json", exclude_none=True)
        return _write(f"/api/rollouts/{rollout_id}/rewards", _reward_slot, json=body)

    @staticmethod
    def reward_history(rollout_id: str, name: str | None) -> _Request[list[RewardScore]]:
        params = {"name": name} if name is not None else {}
        return _Request("GET", f"/api/rollouts/{rollout_id}/rewards", _reward_scores, params=params)

    @staticmethod
    def pending_rewards(
        name: str | None, source: RewardSource | str | None, limit: int, cursor: str | None
    ) -> _Request[Page[Rollout]]:
        source = RewardSource(source).value if source else None
        params = {"name": name, "source": source, "limit": limit, "cursor": cursor}
        given = {k: v for k, v in params.items() if v is not None}
        return _Request("GET", "/api/rewards/pending", _page_rollouts, params=given)

    @staticmethod
    def publish(
        resources: dict[str, Resource], metadata: dict[str, Any] | None, trial: bool
    ) -> _Request[Resources]:
        body = {
            "resources": {k: v.model_dump(mode="json") for k, v in resources.items()},
            "metadata": metadata or {},
            "trial": trial,
        }
        return _write("/api/resources", _resources, json=body)


class _Base:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.enrollment_token = token
        """The token this client was made with: the one it registers with, also after a
        registration made it act with the issued worker token (:attr:`token`)."""
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    def _registered(self, registration: Registration | None, http: httpx.Client | httpx.AsyncClient) -> None:
        """From now on, act with the issued worker token (an older server issues none)."""
        if registration is None:
            return
        self.token = registration.worker_token
        self.headers = {"authorization": f"Bearer {registration.worker_token}"}
        http.headers.update(self.headers)

    def _handle(self, call: _Request[T], response: httpx.Response) -> T:
        if response.status_code >= 500:
            raise _ServerError(response.status_code, response.text)
        if response.status_code >= 400:
            _raise_for(response)
        return call.parse(response.json())


class Client(_Base):
    """Synchronous client (algorithms, Trainer, CLI)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(url, token, timeout, retry)
        self.http = httpx.Client(
            base_url=self.url, headers=self.headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: _Request[T]) -> T:
        retries = _Retries(self, call)
        while True:
            try:
                response = self.http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params or None,
                    headers=call.headers,
                    timeout=call.timeout or self.timeout,
                )
                return self._handle(call, response)
            except Exception as exc:
                time.sleep(retries.delay_after(exc))

    def health(self) -> dict[str, Any]:
        return self._send(_Request("GET", "/health", _identity))

    def register_worker(self, name: str | None = None) -> Registration | None:
        """Ask the server for a worker identity (``name`` is a hint) and use its token for
        every later call. None, and nothing changed, from a server that issues none (404).
        Registering again (after :class:`WorkerTokenExpired`) sends the token the client was
        made with, and replaces the identity."""
        try:
            registration = self._send(_Api.register_worker(name, self.enrollment_token))
        except NotFound:
            registration = None
        self._registered(registration, self.http)
        return registration

    def enqueue(self, items: Sequence[RolloutCreate]) -> list[Rollout]:
        return self._send(_Api.enqueue(items))

    def dequeue(self, worker_id: str, lease_seconds: float | None = None, wait: float = 0.0) -> Claim | None:
        return self._send(_Api.dequeue(worker_id, lease_seconds, wait))

    def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        return self._send(_Api.heartbeat(attempt_id, worker_id, lease_seconds))

    def add_events(self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None) -> int:
        return self._send(_Api.add_events(attempt_id, events, worker_id))

    def finish(
        self,
        attempt_id: str,
        status: AttemptStatus,
        reward: float | None = None,
        error: str | None = None,
        worker_id: str | None = None,
    ) -> Rollout:
        return self._send(_Api.finish(attempt_id, status, reward, error, worker_id))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._send(_Request("GET", f"/api/rollouts/{rollout_id}", _rollout))

    def cancel(self, rollout_id: str) -> Rollout:
        return self._send(_Api.cancel(rollout_id))

    def list_rollouts(
        self,
        *,
        status: Sequence[RolloutStatus] | None = None,
        mode: Mode | None = None,
        resources_version: int | None = None,
        group_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        newest_first: bool = False,
    ) -> Page[Rollout]:
        call = _Api.list_rollouts(
            status=status,
            mode=mode,
            resources_version=resources_version,
            group_id=group_id,
            limit=limit,
            cursor=cursor,
            newest_first=newest_first or None,
        )
        return self._send(call)

    def list_attempts(self, rollout_id: str) -> list[Attempt]:
        return self._send(_Request("GET", f"/api/rollouts/{rollout_id}/attempts", _attempts))

    def list_events(
        self,
        rollout_id: str,
        *,
        attempt_id: str | None = None,
        type: Sequence[str] | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Event]:
        return self._send(
            _Api.list_events(rollout_id, attempt_id=attempt_id, type=type, limit=limit, cursor=cursor)
        )

    def pages(self, list_page: Callable[..., Page[T]], /, *args: Any, **params: Any) -> Iterator[T]:
        """Every item of a paged endpoint, page after page, following ``next_cursor``:
        ``list_page(*args, cursor=..., **params)`` fetches one page, e.g.
        ``client.pages(client.list_rollouts, mode=Mode.VAL, limit=1000)``."""
        cursor = None
        while True:
            page = list_page(*args, cursor=cursor, **params)
            yield from page.items
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def all_events(self, rollout_id: str, **filters: Any) -> list[Event]:
        """Every event of a rollout, following pagination."""
        return list(self.pages(self.list_events, rollout_id, **filters))

    def events_of(
        self, rollout_ids: Sequence[str], type: Sequence[str] | None = None
    ) -> dict[str, list[Event]]:
        """The events of many rollouts (optionally only some types), each rollout's in order:
        one request per 1,000 events instead of one per rollout. Unknown ids map to ``[]``."""
        out: dict[str, list[Event]] = {rid: [] for rid in rollout_ids}
        ids = list(out)
        for start in range(0, len(ids), _EVENTS_BATCH):
            for event in self.pages(self._query_events, ids[start : start + _EVENTS_BATCH], type):
                out[event.rollout_id].append(event)
        return out

    def _query_events(
        self, rollout_ids: Sequence[str], types: Sequence[str] | None, cursor: str | None
    ) -> Page[Event]:
        return self._send(_Api.query_events(rollout_ids, types, cursor))

    def wait(self, rollout_ids: Sequence[str], timeout: float = 10.0) -> WaitResult:
        return self._send(_Api.wait(rollout_ids, min(timeout, 60.0)))

    def publish_resources(
        self, resources: dict[str, Resource], metadata: dict[str, Any] | None = None, trial: bool = False
    ) -> Resources:
        """A new resources version. ``trial``: never the latest; only rollouts pinned to its
        version run with it (e.g. an APO candidate under evaluation)."""
        return self._send(_Api.publish(resources, metadata, trial))

    def get_resources(self, version: int) -> Resources:
        return self._send(_Request("GET", f"/api/resources/{version}", _resources))

    def latest_resources(self) -> Resources | None:
        return self._send(_Request("GET", "/api/resources/latest", _resources_opt))

    def list_resources(self, limit: int = 100, cursor: str | None = None) -> Page[Resources]:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return self._send(_Request("GET", "/api/resources", _page_resources, params=params))

    def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot:
        """Score a named reward of a finished rollout; the reward as it now stands. Retries
        send the same idempotency key: a score is stored once. ``Conflict`` (409) when
        someone scored meanwhile (``create.replaces`` is not the revision stored), or the
        rollout is not finished; ``InvalidInput`` (422) for a score off the reward's scale;
        ``RequestError`` 403 when this token may not give it."""
        return self._send(_Api.add_reward(rollout_id, create))

    def reward_history(self, rollout_id: str, name: str | None = None) -> list[RewardScore]:
        """Every score given to the rollout's named rewards (or to ``name``), oldest first."""
        return self._send(_Api.reward_history(rollout_id, name))

    def pending_rewards(
        self,
        name: str | None = None,
        source: RewardSource | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        """Succeeded rollouts with a reward still pending (``name``, given by ``source``), in
        queue order: what a reviewer or an evaluator worker has left to score."""
        return self._send(_Api.pending_rewards(name, source, limit, cursor))

    def list_workers(self) -> list[Worker]:
        return self._send(_Request("GET", "/api/workers", _workers))

    def revoke_worker(self, worker_id: str) -> Worker:
        """Revoke a worker (admin): its token stops working, no token may claim or renew work
        under its id, and its running attempts end now (their rollouts move on as after a
        lapsed lease). Revoking again changes nothing."""
        return self._send(_Api.revoke_worker(worker_id))

    def stats(self) -> dict[str, Any]:
        return self._send(_Request("GET", "/api/stats", _identity))


class AsyncClient(_Base):
    """Asynchronous client (the runner)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        super().__init__(url, token, timeout, retry)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # Plain http (loopback, cluster network) goes through the lean keep-alive transport
        # (``max_connections`` caps its open connections too); https keeps httpx's own (TLS,
        # proxies).
        lean = Http1Transport(max_connections=max_connections)
        mounts = lean_mounts(lean) if transport is None else None
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=self.headers,
            timeout=timeout,
            transport=transport,
            limits=limits,
            mounts=mounts,
            verify=_ssl_context(),
        )
        # Calls without query parameters to a plain-http server skip httpx's client and its
        # request and response objects (URL merging, cookies, header models cost several
        # times the exchange itself): straight through the lean transport's ``request``.
        parts = urlsplit(self.url)
        self._lean = (
            (lean, (parts.hostname or "", parts.port or 80), parts.path.rstrip("/").encode())
            if mounts is not None and parts.scheme == "http"
            else None
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _send(self, call: _Request[T]) -> T:
        retries = _Retries(self, call)
        while True:
            try:
                if self._lean is not None and not call.params:
                    return await self._send_lean(call, self._lean)
                response = await self.http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params or None,
                    headers=call.headers,
                    timeout=call.timeout or self.timeout,
                )
                return self._handle(call, response)
            except Exception as exc:
                await asyncio.sleep(retries.delay_after(exc))

    async def _send_lean(self, call: _Request[T], lean: tuple[Http1Transport, tuple[str, int], bytes]) -> T:
        """One try of ``call`` through the lean transport; answers and errors as :meth:`_send`'s
        httpx path gives them."""
        transport, origin, base = lean
        headers = [(b"accept", b"application/json"), (b"user-agent", _USER_AGENT)]
        token = call.token or self.token
        if token:
            headers.append((b"authorization", b"Bearer " + token.encode()))
        if call.key:
            headers.append((b"idempotency-key", call.key.encode()))
        content = b""
        if call.json is not None:  # as httpx's ``json=``: no body at all without one
            headers.append((b"content-type", b"application/json"))
            content = _json_bytes(call.json)
        seconds = call.timeout or self.timeout
        timeouts = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}
        answer = await transport.request(
            call.method, origin, base + call.path.encode(), headers, content, timeouts, call.key is not None
        )
        if answer.status_code >= 400:  # rare: httpx's response for the error paths
            response = httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)
            if answer.status_code >= 500:
                raise _ServerError(answer.status_code, response.text)
            _raise_for(response)
        return call.parse(orjson.loads(answer.content))

    async def health(self) -> dict[str, Any]:
        return await self._send(_Request("GET", "/health", _identity))

    async def register_worker(self, name: str | None = None) -> Registration | None:
        """See :meth:`Client.register_worker`."""
        try:
            registration = await self._send(_Api.register_worker(name, self.enrollment_token))
        except NotFound:
            registration = None
        self._registered(registration, self.http)
        return registration

    async def list_events(
        self,
        rollout_id: str,
        *,
        attempt_id: str | None = None,
        type: Sequence[str] | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Event]:
        return await self._send(
            _Api.list_events(rollout_id, attempt_id=attempt_id, type=type, limit=limit, cursor=cursor)
        )

    async def all_events(self, rollout_id: str, **filters: Any) -> list[Event]:
        """Every event of a rollout (optionally filtered), following pagination."""
        out: list[Event] = []
        cursor = None
        while True:
            page = await self.list_events(rollout_id, cursor=cursor, **filters)
            out.extend(page.items)
            if not page.next_cursor:
                return out
            cursor = page.next_cursor

    async def enqueue(self, items: Sequence[RolloutCreate]) -> list[Rollout]:
        return await self._send(_Api.enqueue(items))

    async def dequeue(
        self, worker_id: str, lease_seconds: float | None = None, wait: float = 0.0
    ) -> Claim | None:
        return await self._send(_Api.dequeue(worker_id, lease_seconds, wait))

    async def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        return await self._send(_Api.heartbeat(attempt_id, worker_id, lease_seconds))

    async def add_events(
        self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None
    ) -> int:
        return await self._send(_Api.add_events(attempt_id, events, worker_id))

    async def finish(
        self,
        attempt_id: str,
        status: AttemptStatus,
        reward: float | None = None,
        error: str | None = None,
        worker_id: str | None = None,
    ) -> Rollout:
        return await self._send(_Api.finish(attempt_id, status, reward, error, worker_id))

    async def wait(self, rollout_ids: Sequence[str], timeout: float = 10.0) -> WaitResult:
        return await self._send(_Api.wait(rollout_ids, min(timeout, 60.0)))

    async def cancel(self, rollout_id: str) -> Rollout:
        return await self._send(_Api.cancel(rollout_id))

    async def publish_resources(
        self, resources: dict[str, Resource], metadata: dict[str, Any] | None = None, trial: bool = False
    ) -> Resources:
        """See :meth:`Client.publish_resources`."""
        return await self._send(_Api.publish(resources, metadata, trial))

    async def get_resources(self, version: int) -> Resources:
        return await self._send(_Request("GET", f"/api/resources/{version}", _resources))

    async def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot:
        """See :meth:`Client.add_reward`."""
        return await self._send(_Api.add_reward(rollout_id, create))

    async def reward_history(self, rollout_id: str, name: str | None = None) -> list[RewardScore]:
        """See :meth:`Client.reward_history`."""
        return await self._send(_Api.reward_history(rollout_id, name))

    async def pending_rewards(
        self,
        name: str | None = None,
        source: RewardSource | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        """See :meth:`Client.pending_rewards`."""
        return await self._send(_Api.pending_rewards(name, source, limit, cursor))
