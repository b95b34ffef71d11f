"""Worker identity: ``POST /api/workers/register`` issues a worker id and a token bound to it.

A runner (``Runner`` does it at start; ``Trainer``'s runners, Ray actors and Kubernetes Jobs
alike, each with the runner token it was given) registers once and then acts with the worker
token: dequeue, heartbeat, events and finish naming another worker are refused (403), so one
runner cannot act for another. A plain runner token may still name any worker id (older
runners); the binding needs the registration.

``POST /api/workers/{worker_id}/revoke`` (admin) revokes a worker: its token is refused from then
on, no token may claim or renew work under its id, and its running attempts end at once (their
rollouts are requeued while attempts remain). A worker token also expires when its worker was
not seen (a dequeue, a heartbeat) for ``ServerConfig.worker_token_ttl`` seconds; its runner then
registers again.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentbolt.errors import Forbidden
from agentbolt.schemas import Worker, WorkerRegister, WorkerRegistration
from agentbolt.server.middleware import IssuedCredentials
from agentbolt.server.routes.common import caller_of, json_response
from agentbolt.server.store_caller import StoreCaller, WakeUp

__all__ = ["router"]


def router(
    call: StoreCaller, wake: WakeUp, issued: IssuedCredentials, token_ttl: float | None = None
) -> APIRouter:
    api = APIRouter(prefix="/api/workers", tags=["runner"])
    store = call.store

    @api.post("/register", response_model=WorkerRegistration, status_code=201)
    async def register(body: WorkerRegister, request: Request) -> Response:
        """Issue a new worker id (the ``name`` hint with a random suffix) and its token, shown
        only in this answer, with how long the token stays valid once its worker goes unseen
        (``token_ttl_seconds``: a runner heartbeats well within it). Needs a runner or admin
        token (not a worker token: that already is an identity)."""
        caller = caller_of(request)
        if caller is not None and caller.worker_id is not None:
            raise Forbidden("a worker token cannot register another worker: use the runner token")
        worker_id, token = await call(store.register_worker, body.name)
        registration = WorkerRegistration(
            worker_id=worker_id, worker_token=token, token_ttl_seconds=token_ttl
        )
        return json_response(registration, 201)

    @api.post("/{worker_id}/revoke", response_model=Worker, tags=["admin"])
    async def revoke(worker_id: str) -> Response:
        """Revoke a worker (admin): its token stops working, no token may claim or renew work
        under its id, and its running attempts end now, as if their leases had lapsed. Revoking
        again changes nothing; the answer is the worker, with ``revoked_at``. 404: no such worker."""
        worker = await call(store.revoke_worker, worker_id)
        issued.forget_worker(worker_id)
        wake.notify()  # its attempts' rollouts may be queued again (or final): long polls look now
        return json_response(worker)

    return api
