"""HTTP clients for the server: :class:`Client` (sync) and :class:`AsyncClient`.

Every call has a timeout and is retried as :mod:`agentbolt.client_retry` says; each endpoint's
request is described once (:mod:`agentbolt.client_api`: what is sent, how the answer and the
errors read) and sent by either client, so the two cannot drift apart.
:meth:`Client.pages` follows a paged endpoint's cursors.

Retrying a write is safe because every mutating call carries an ``Idempotency-Key`` made once
per call and sent again by each retry: the server answers a repeated key with the first result
(a retried enqueue returns the same rollouts, a retried dequeue the same claim). Enqueue also
names every rollout itself before sending.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import orjson

from agentbolt.client_api import (
    EVENTS_BATCH,
    Api,
    ApiRequest,
    Registration,
    RequestError,
    ServerError,
    answer_of,
    json_bytes,
    raise_for,
)
from agentbolt.client_retry import Retries, RetryPolicy
from agentbolt.errors import NotFound
from agentbolt.http1 import Http1Transport, lean_mounts
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
)

__all__ = ["AsyncClient", "Client", "Registration", "RequestError", "RetryPolicy"]

T = TypeVar("T")
_USER_AGENT = b"agentbolt-client"


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, as httpx makes by default (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` honoured): each client building its own costs tens of milliseconds."""
    return httpx.create_ssl_context()


class _Base:
    """What both clients hold: the server, the token they act with, the timeout and retries."""

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

    def _send(self, call: ApiRequest[T]) -> T:
        retries = Retries(self.retry, self.url, call)
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
                return answer_of(call, response)
            except Exception as exc:
                time.sleep(retries.delay_after(exc))

    def health(self) -> dict[str, Any]:
        return self._send(Api.health())

    def register_worker(self, name: str | None = None) -> Registration | None:
        """Ask the server for a worker identity (``name`` is a hint) and use its token for
        every later call. None, and nothing changed, from a server that issues none (404).
        Registering again (after :class:`WorkerTokenExpired`) sends the token the client was
        made with, and replaces the identity."""
        try:
            registration = self._send(Api.register_worker(name, self.enrollment_token))
        except NotFound:
            registration = None
        self._registered(registration, self.http)
        return registration

    def enqueue(self, items: Sequence[RolloutCreate]) -> list[Rollout]:
        return self._send(Api.enqueue(items))

    def dequeue(self, worker_id: str, lease_seconds: float | None = None, wait: float = 0.0) -> Claim | None:
        return self._send(Api.dequeue(worker_id, lease_seconds, wait))

    def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        return self._send(Api.heartbeat(attempt_id, worker_id, lease_seconds))

    def add_events(self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None) -> int:
        return self._send(Api.add_events(attempt_id, events, worker_id))

    def finish(
        self,
        attempt_id: str,
        status: AttemptStatus,
        reward: float | None = None,
        error: str | None = None,
        worker_id: str | None = None,
    ) -> Rollout:
        return self._send(Api.finish(attempt_id, status, reward, error, worker_id))

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._send(Api.get_rollout(rollout_id))

    def cancel(self, rollout_id: str) -> Rollout:
        return self._send(Api.cancel(rollout_id))

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
        call = Api.list_rollouts(
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
        return self._send(Api.list_attempts(rollout_id))

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
            Api.list_events(rollout_id, attempt_id=attempt_id, type=type, limit=limit, cursor=cursor)
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
        for start in range(0, len(ids), EVENTS_BATCH):
            for event in self.pages(self._query_events, ids[start : start + EVENTS_BATCH], type):
                out[event.rollout_id].append(event)
        return out

    def _query_events(
        self, rollout_ids: Sequence[str], types: Sequence[str] | None, cursor: str | None
    ) -> Page[Event]:
        return self._send(Api.query_events(rollout_ids, types, cursor))

    def wait(self, rollout_ids: Sequence[str], timeout: float = 10.0) -> WaitResult:
        return self._send(Api.wait(rollout_ids, min(timeout, 60.0)))

    def publish_resources(
        self, resources: dict[str, Resource], metadata: dict[str, Any] | None = None, trial: bool = False
    ) -> Resources:
        """A new resources version. ``trial``: never the latest; only rollouts pinned to its
        version run with it (e.g. an APO candidate under evaluation)."""
        return self._send(Api.publish(resources, metadata, trial))

    def get_resources(self, version: int) -> Resources:
        return self._send(Api.get_resources(version))

    def latest_resources(self) -> Resources | None:
        return self._send(Api.latest_resources())

    def list_resources(self, limit: int = 100, cursor: str | None = None) -> Page[Resources]:
        return self._send(Api.list_resources(limit, cursor))

    def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot:
        """Score a named reward of a finished rollout; the reward as it now stands. Retries
        send the same idempotency key: a score is stored once. ``Conflict`` (409) when
        someone scored meanwhile (``create.replaces`` is not the revision stored), or the
        rollout is not finished; ``InvalidInput`` (422) for a score off the reward's scale;
        ``RequestError`` 403 when this token may not give it."""
        return self._send(Api.add_reward(rollout_id, create))

    def reward_history(self, rollout_id: str, name: str | None = None) -> list[RewardScore]:
        """Every score given to the rollout's named rewards (or to ``name``), oldest first."""
        return self._send(Api.reward_history(rollout_id, name))

    def pending_rewards(
        self,
        name: str | None = None,
        source: RewardSource | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        """Succeeded rollouts with a reward still pending (``name``, given by ``source``), in
        queue order: what a reviewer or an evaluator worker has left to score."""
        return self._send(Api.pending_rewards(name, source, limit, cursor))

    def list_workers(self) -> list[Worker]:
        return self._send(Api.list_workers())

    def revoke_worker(self, worker_id: str) -> Worker:
        """Revoke a worker (admin): its token stops working, no token may claim or renew work
        under its id, and its running attempts end now (their rollouts move on as after a
        lapsed lease). Revoking again changes nothing."""
        return self._send(Api.revoke_worker(worker_id))

    def stats(self) -> dict[str, Any]:
        return self._send(Api.stats())


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

    async def _send(self, call: ApiRequest[T]) -> T:
        retries = Retries(self.retry, self.url, call)
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
                return answer_of(call, response)
            except Exception as exc:
                await asyncio.sleep(retries.delay_after(exc))

    async def _send_lean(self, call: ApiRequest[T], lean: tuple[Http1Transport, tuple[str, int], bytes]) -> T:
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
            content = json_bytes(call.json)
        seconds = call.timeout or self.timeout
        timeouts = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}
        answer = await transport.request(
            call.method, origin, base + call.path.encode(), headers, content, timeouts, call.key is not None
        )
        if answer.status_code >= 400:  # rare: httpx's response for the error paths
            response = httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)
            if answer.status_code >= 500:
                raise ServerError(answer.status_code, response.text)
            raise_for(response)
        return call.parse(orjson.loads(answer.content))

    async def health(self) -> dict[str, Any]:
        return await self._send(Api.health())

    async def register_worker(self, name: str | None = None) -> Registration | None:
        """See :meth:`Client.register_worker`."""
        try:
            registration = await self._send(Api.register_worker(name, self.enrollment_token))
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
            Api.list_events(rollout_id, attempt_id=attempt_id, type=type, limit=limit, cursor=cursor)
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
        return await self._send(Api.enqueue(items))

    async def dequeue(
        self, worker_id: str, lease_seconds: float | None = None, wait: float = 0.0
    ) -> Claim | None:
        return await self._send(Api.dequeue(worker_id, lease_seconds, wait))

    async def heartbeat(
        self, attempt_id: str, worker_id: str | None = None, lease_seconds: float | None = None
    ) -> Attempt:
        return await self._send(Api.heartbeat(attempt_id, worker_id, lease_seconds))

    async def add_events(
        self, attempt_id: str, events: Sequence[EventCreate], worker_id: str | None = None
    ) -> int:
        return await self._send(Api.add_events(attempt_id, events, worker_id))

    async def finish(
        self,
        attempt_id: str,
        status: AttemptStatus,
        reward: float | None = None,
        error: str | None = None,
        worker_id: str | None = None,
    ) -> Rollout:
        return await self._send(Api.finish(attempt_id, status, reward, error, worker_id))

    async def wait(self, rollout_ids: Sequence[str], timeout: float = 10.0) -> WaitResult:
        return await self._send(Api.wait(rollout_ids, min(timeout, 60.0)))

    async def cancel(self, rollout_id: str) -> Rollout:
        return await self._send(Api.cancel(rollout_id))

    async def publish_resources(
        self, resources: dict[str, Resource], metadata: dict[str, Any] | None = None, trial: bool = False
    ) -> Resources:
        """See :meth:`Client.publish_resources`."""
        return await self._send(Api.publish(resources, metadata, trial))

    async def get_resources(self, version: int) -> Resources:
        return await self._send(Api.get_resources(version))

    async def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot:
        """See :meth:`Client.add_reward`."""
        return await self._send(Api.add_reward(rollout_id, create))

    async def reward_history(self, rollout_id: str, name: str | None = None) -> list[RewardScore]:
        """See :meth:`Client.reward_history`."""
        return await self._send(Api.reward_history(rollout_id, name))

    async def pending_rewards(
        self,
        name: str | None = None,
        source: RewardSource | str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        """See :meth:`Client.pending_rewards`."""
        return await self._send(Api.pending_rewards(name, source, limit, cursor))
