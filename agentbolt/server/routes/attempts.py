"""An attempt, as the runner holding it works on it: read it, heartbeat, append events, finish.

A runner token writes only to attempts it holds: it must name its ``worker_id``, which the
store then checks against the attempt's holder (admins may write without one).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from agentbolt.schemas import Attempt, AttemptFinish, EventsRequest, FinishRequest, HeartbeatRequest, Rollout
from agentbolt.server.config import Role
from agentbolt.server.routes.common import IdempotencyKey, json_response
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
        _holder_named(request, body.worker_id)
        return json_response(await call(store.heartbeat, attempt_id, body.worker_id, body.lease_seconds))

    @api.post("/events")
    async def add_events(attempt_id: str, body: EventsRequest, request: Request) -> Response:
        """Append events; ones whose (attempt, sequence) is already stored are skipped."""
        _holder_named(request, body.worker_id)
        added = await call(store.add_events, attempt_id, body.events, body.worker_id)
        return json_response({"added": added})

    @api.post("/finish", response_model=Rollout)
    async def finish(
        attempt_id: str, body: FinishRequest, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """End the attempt: ``succeeded`` ends the rollout, ``failed`` fails it, ``released``
        requeues it. A retry of the finish that ended it (same ``Idempotency-Key``) gets the
        rollout again; any other write to an ended attempt is a 409 naming its state."""
        _holder_named(request, body.worker_id)
        finish = AttemptFinish(**body.model_dump(exclude={"worker_id"}))
        rollout = await call(store.finish_attempt, attempt_id, finish, body.worker_id, key)
        wake.notify()  # a requeue is new work; a final rollout ends someone's wait
        return json_response(rollout)

    return api


def _holder_named(request: Request, worker_id: str | None) -> None:
    """A runner token must name the worker it writes for (see the module docstring)."""
    if worker_id is None and request.scope.get("agentbolt.role") == Role.RUNNER:
        missing = {
            "loc": ("body", "worker_id"),
            "msg": "a runner token must name the worker holding the attempt",
            "type": "missing",
        }
        raise RequestValidationError([missing])
