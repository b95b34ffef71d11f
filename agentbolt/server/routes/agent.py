"""The events URL an agent program reports to: ``POST /agent/{rollout_id}/{attempt_id}/events``.

Authorised by the attempt's agent key as bearer (the ``OPENAI_API_KEY`` a program agent gets),
or a runner or admin token. One event or a JSON list; each is ``{"type": ..., "data": {...}}``
or the reward shorthand ``{"reward": <number>, "name": ..., "call": <call id>}``::

    curl -H "Authorization: Bearer $OPENAI_API_KEY" -H 'content-type: application/json' \\
         -d '{"reward": 1}' "$AGENTBOLT_EVENTS_URL"

With ``call`` (the id the gateway returned for a model call: its ``X-Agentbolt-Call-Id``
header, or ``agentbolt.call_id`` in its body) the reward is that call's. A turn's state is
``{"type": "state", "data": {"key": "<state>", "llm_call_id": <call id>}}``, exactly (a
422 names what is missing). See ``docs/events.md``.

The store orders them (they carry no sequence: the runner numbers its own events); a repeat
with the same ``Idempotency-Key`` stores nothing new. Once the attempt ended: 409
``AttemptEnded`` naming its state.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentbolt.errors import NotFound
from agentbolt.schemas import AgentEvents
from agentbolt.server.routes.common import IdempotencyKey, caller_of, json_response
from agentbolt.server.store_caller import StoreCaller

__all__ = ["router"]


def router(call: StoreCaller) -> APIRouter:
    api = APIRouter(tags=["agent"])
    store = call.store

    @api.post("/agent/{rollout_id}/{attempt_id}/events")
    async def post_events(
        rollout_id: str, attempt_id: str, body: AgentEvents, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """Record what the agent reports (rewards, messages, its own events); answers
        ``{"added": n}``, 0 for a repeat."""
        attempt = await call(store.get_attempt, attempt_id)
        if attempt.rollout_id != rollout_id:  # an agent key's own path always matches
            raise NotFound("attempt", f"{rollout_id}/{attempt_id}")
        caller = caller_of(request)
        worker = caller.worker_id if caller is not None else None
        events = [event.to_create() for event in body.root]
        added = await call(store.add_agent_events, attempt_id, events, key, worker)
        return json_response({"added": added})

    return api
