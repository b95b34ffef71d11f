"""Named rewards: score a finished rollout, read a reward's history, list the rollouts awaiting
a score.

Who may score and as whom is the caller's role: a reviewer token gives reviewer rewards, its
author the name the token was configured with; an evaluator token gives evaluator rewards,
its author what the body names (a judge's name) or ``evaluator``; an admin (or a server
without tokens) may give either, the body's ``source`` or, without one, the slot's (a new slot:
evaluator). The store checks the rest (see :meth:`~agentbolt.store.SqlStore.add_reward`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from agentbolt.schemas import REWARD_NAME, Page, RewardCreate, RewardScore, RewardSlot, RewardSource, Rollout
from agentbolt.server.config import Role
from agentbolt.server.middleware import Caller
from agentbolt.server.routes.common import INT_CURSOR, IdempotencyKey, caller_of, json_response
from agentbolt.server.store_caller import StoreCaller

__all__ = ["router", "writer"]

RewardName = Annotated[str | None, Query(pattern=REWARD_NAME, description="one reward's name")]


def writer(
    caller: Caller | None, body: RewardCreate, slot_source: RewardSource | None
) -> tuple[RewardSource, str]:
    """The source and author a score is stored with, decided by the caller's role (see the
    module docstring). ``slot_source``: the source of the slot as stored, if any."""
    if caller is not None and caller.role == Role.REVIEWER:
        return RewardSource.REVIEWER, caller.name or "reviewer"
    if caller is not None and caller.role == Role.EVALUATOR:
        return RewardSource.EVALUATOR, body.author or "evaluator"
    source = body.source or slot_source or RewardSource.EVALUATOR
    return RewardSource(source), body.author or "admin"


def router(call: StoreCaller) -> APIRouter:
    api = APIRouter(prefix="/api", tags=["rewards"])
    store = call.store

    @api.post("/rollouts/{rollout_id}/rewards", response_model=RewardSlot, status_code=201)
    async def add_reward(
        rollout_id: str, body: RewardCreate, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """Score a named reward of a finished rollout; the answer is the reward as it now
        stands. ``replaces`` is the revision the scorer saw (0 or none for a first score):
        a score given meanwhile makes it a 409 naming who gave it. A queued, running or
        cancelled rollout is a 409, a reward another source gives a 403, a score off the
        reward's scale a 422. A retry with the same ``Idempotency-Key`` stores nothing new and
        gets the first answer."""
        caller = caller_of(request)
        slot_source = None
        if (caller is None or caller.role == Role.ADMIN) and body.source is None:
            slot = (await call(store.get_rollout, rollout_id)).rewards.get(body.name)
            slot_source = slot.source if slot is not None else None
        source, author = writer(caller, body, slot_source)
        slot = await call(store.add_reward, rollout_id, body, source=source, author=author, key=key)
        return json_response(slot, 201)

    @api.get("/rollouts/{rollout_id}/rewards", response_model=list[RewardScore])
    async def reward_history(rollout_id: str, name: RewardName = None) -> Response:
        """Every score given to the rollout's named rewards (or to ``name``), oldest first."""
        return json_response(await call(store.reward_history, rollout_id, name))

    @api.get("/rewards/pending", response_model=Page[Rollout])
    async def pending_rewards(
        name: RewardName = None,
        source: RewardSource | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(pattern=INT_CURSOR)] = None,
    ) -> Response:
        """Succeeded rollouts with a reward still pending (``name``, given by ``source``), in
        queue order, with their rewards: the queue of a reviewer or an evaluator worker."""
        return json_response(await call(store.pending_rewards, name, source, limit, cursor))

    return api
