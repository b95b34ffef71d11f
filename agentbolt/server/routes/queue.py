"""The queue: enqueue rollouts, read them, wait for them, cancel them, and claim one (dequeue).

Waiting and dequeueing are long polls: they wake when this process changes the queue
(:class:`~agentbolt.server.store_caller.WakeUp`) and otherwise poll the store every
``POLL_SECONDS`` (changes made by other server replicas).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from agentbolt.schemas import (
    MAX_INT32,
    Attempt,
    Claim,
    DequeueRequest,
    EnqueueRequest,
    Mode,
    Page,
    Rollout,
    RolloutStatus,
    WaitRequest,
    WaitResult,
)
from agentbolt.server.gateway_access import rewrite_claim
from agentbolt.server.routes.common import INT_CURSOR, IdempotencyKey, acting_worker, json_response
from agentbolt.server.store_caller import StoreCaller, WakeUp, redact

__all__ = ["POLL_SECONDS", "router"]

POLL_SECONDS = 0.5


def router(call: StoreCaller, wake: WakeUp) -> APIRouter:
    api = APIRouter(prefix="/api")
    store = call.store

    @api.post("/rollouts", response_model=list[Rollout], status_code=201, tags=["queue"])
    async def enqueue(body: EnqueueRequest, key: IdempotencyKey = None) -> Response:
        """Enqueue rollouts (one per item); items with an existing ``id`` are returned unchanged.
        With an ``Idempotency-Key``, items without an ``id`` get ids derived from it, so a retry
        returns the same rollouts. A task id stored with other data or metadata is a 409."""
        created = await call(store.enqueue, body.rollouts, key)
        wake.notify()
        return json_response(created, 201)

    @api.get("/rollouts", response_model=Page[Rollout], tags=["queue"])
    async def list_rollouts(
        status: Annotated[list[RolloutStatus] | None, Query()] = None,
        mode: Mode | None = None,
        resources_version: Annotated[int | None, Query(ge=1, le=MAX_INT32)] = None,
        group_id: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(pattern=INT_CURSOR)] = None,
        newest_first: bool = False,
    ) -> Response:
        page = await call(
            store.list_rollouts,
            status=status,
            mode=mode,
            resources_version=resources_version,
            group_id=group_id,
            limit=limit,
            cursor=cursor,
            newest_first=newest_first,
        )
        return json_response(page)

    @api.post("/rollouts/wait", response_model=WaitResult, tags=["queue"])
    async def wait(body: WaitRequest) -> Response:
        """Long-poll until every listed rollout is final or ``timeout`` seconds pass. An unknown
        id can never finish: the answer then comes at once (``done`` false, that id left out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.timeout
        wanted = set(body.rollout_ids)
        while True:
            rollouts = await call(store.get_rollouts, body.rollout_ids)
            known = len({r.id for r in rollouts}) == len(wanted)  # ids may repeat in the request
            done = known and all(r.status.is_final for r in rollouts)
            if done or not known or loop.time() >= deadline:
                return json_response(WaitResult(rollouts=rollouts, done=done))
            await wake.wait(min(POLL_SECONDS, max(0.0, deadline - loop.time())))

    @api.get("/rollouts/{rollout_id}", response_model=Rollout, tags=["queue"])
    async def get_rollout(rollout_id: str) -> Response:
        return json_response(await call(store.get_rollout, rollout_id))

    @api.post("/rollouts/{rollout_id}/cancel", response_model=Rollout, tags=["queue"])
    async def cancel(rollout_id: str) -> Response:
        """Cancel a queued or running rollout; its running attempt ends as ``cancelled`` (its
        runner learns it at its next heartbeat or upload). Cancelling it again returns it."""
        rollout = await call(store.cancel, rollout_id)
        wake.notify()  # a final rollout ends someone's wait
        return json_response(rollout)

    @api.get("/rollouts/{rollout_id}/attempts", response_model=list[Attempt], tags=["queue"])
    async def list_attempts(rollout_id: str) -> Response:
        return json_response(await call(store.list_attempts, rollout_id))

    @api.post("/dequeue", response_model=Claim | None, tags=["runner"])
    async def dequeue(body: DequeueRequest, request: Request, key: IdempotencyKey = None) -> Response:
        """Claim the oldest queued rollout as a new attempt; ``null`` when the queue stays empty
        for ``wait`` seconds (a long poll: a runner gets new work as soon as it is enqueued).
        The claim carries the lease granted (``lease_seconds``). A retry with the same
        ``Idempotency-Key`` (same worker) gets the same claim, never a second one. The claim's
        ``agent_key`` is the attempt's own credential, also every LLM resource's ``api_key``. A
        worker token claims only for its own worker (403 naming another)."""
        return json_response(await claim_work(call, wake, body, key, request))

    return api


async def claim_work(
    call: StoreCaller, wake: WakeUp, body: DequeueRequest, key: str | None, request: Request
) -> Claim | None:
    """The dequeue call's work (the route's and the runner fast path's): a long poll for a
    claim, None when none came."""
    acting_worker(request, body.worker_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.wait
    while (claim := await call(call.store.dequeue, body.worker_id, body.lease_seconds, key)) is None:
        if loop.time() >= deadline:
            return None
        await wake.wait(min(POLL_SECONDS, max(0.0, deadline - loop.time())))
        if await request.is_disconnected():  # a dead runner's poll must not take the work
            return None
    return _for_the_runner(claim, request)


def _for_the_runner(claim: Claim, request: Request) -> Claim:
    """The claim as a runner gets it: API keys redacted, LLM resources pointed at the gateway."""
    redacted = redact(claim.resources)
    if redacted is not claim.resources:
        claim = claim.model_copy(update={"resources": redacted})
    return rewrite_claim(claim, request)
