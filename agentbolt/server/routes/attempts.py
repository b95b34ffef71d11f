"""An attempt, as the runner holding it works on it: read it, heartbeat, append events, finish.

A runner token writes only to attempts it holds: it must name its ``worker_id``, which the
store then checks against the attempt's holder (admins may write without one). A worker token
acts for its own worker: it may leave ``worker_id`` out, and naming another is a 403.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from agentbolt.schemas import Attempt, EventSource, EventsRequest, FinishRequest, HeartbeatRequest, Rollout
from agentbolt.server.config import Role
from agentbolt.server.routes.common import IdempotencyKey, acting_worker, json_response, source_of
from agentbolt.server.store_caller import StoreCaller, WakeUp

__all__ = ["router"]


def router(call: StoreCaller, wake: WakeUp) -> APIRouter:
    api = APIRouter(prefix="/api/attempts/{attempt_id}", tags=["runner"])
    store = call.store

    @api.get("", response_model=Attempt)
    async def get_attempt(attempt_id: str) -> Response:
        return json_response(await call(store.get_attempt, attempt_id))

    @api.post("/heartbeat", response_model=Attempt)
    async def heartbeat(attempt_id: str, body: HeartbeatRequest, request: Request) -> Response:
        worker = _holder_named(request, body.worker_id)
        return json_response(await call(store.heartbeat, attempt_id, worker, body.lease_seconds))

    @api.post("/events")
    async def add_events(
        attempt_id: str, body: EventsRequest, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """Append events; ones whose (attempt, sequence) is already stored are skipped. A
        retry with the same ``Idempotency-Key`` gets the first answer; the key sent with
        another batch is a 422 (``IdempotencyKeyReused``)."""
        return json_response({"added": await append_events(call, attempt_id, body, key, request)})

    @api.post("/finish", response_model=Rollout)
    async def finish(
        attempt_id: str, body: FinishRequest, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """End the attempt: ``succeeded`` ends the rollout, ``failed`` fails it, ``released``
        requeues it. A retry of the finish that ended it (same ``Idempotency-Key``) gets the
        rollout again; any other write to an ended attempt is a 409 naming its state."""
        return json_response(await finish_attempt(call, wake, attempt_id, body, key, request))

    return api


async def append_events(
    call: StoreCaller, attempt_id: str, body: EventsRequest, key: str | None, request: Request
) -> int:
    """The events call's work (the route's and the runner fast path's): how many were new."""
    worker = _holder_named(request, body.worker_id)
    source = source_of(request, EventSource.RUNNER)
    return await call(call.store.add_events, attempt_id, body.events, worker, source, key)


async def finish_attempt(
    call: StoreCaller, wake: WakeUp, attempt_id: str, body: FinishRequest, key: str | None, request: Request
) -> Rollout:
    """The finish call's work (the route's and the runner fast path's): the rollout after it.
    The body is the store's :class:`AttemptFinish` already (its ``worker_id`` is not read)."""
    worker = _holder_named(request, body.worker_id)
    rollout = await call(call.store.finish_attempt, attempt_id, body, worker, key)
    wake.notify()  # a requeue is new work; a final rollout ends someone's wait
    return rollout


def _holder_named(request: Request, named: str | None) -> str | None:
    """The worker the write is for: a runner token must name it, a worker token's own
    (see the module docstring)."""
    worker_id = acting_worker(request, named)
    if worker_id is None and request.scope.get("agentbolt.role") == Role.RUNNER:
        missing = {
            "loc": ("body", "worker_id"),
            "msg": "a runner token must name the worker holding the attempt",
            "type": "missing",
        }
        raise RequestValidationError([missing])
    return worker_id
