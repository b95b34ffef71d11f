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

An agent key may post only what an agent legitimately reports (:func:`agent_refusal`): a
reward without ``final``, ``message``, ``state``, ``tool_call`` and its own types under
``custom.``; anything else (``llm_call``, ``exception``, ``span``, a ``final`` reward, ...) is
a 403 naming the type, so an agent cannot write the records training reads or its own final
grade. A per-call reward or a state must name a model call of this attempt (422 naming the
id). Each stored event's ``source`` comes from the credential (``agent`` for an agent key).

The store orders them (they carry no sequence: the runner numbers its own events); a repeat
with the same ``Idempotency-Key`` stores nothing new and gets the first answer, the key sent
with another body is a 422 ``IdempotencyKeyReused``. Once the attempt ended: 409
``AttemptEnded`` naming its state. What an agent key posts counts against the attempt's quota
(:mod:`agentbolt.store.quotas`): over it, 429 (events) or 413 (bytes) naming the limit, nothing
of that request stored, and the attempt goes on.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from agentbolt.errors import Forbidden, NotFound
from agentbolt.schemas import AgentEvents, EventCreate, EventSource, EventType
from agentbolt.server.routes.common import IdempotencyKey, caller_of, json_response, source_of
from agentbolt.server.store_caller import StoreCaller
from agentbolt.store.quotas import EventQuota

__all__ = ["AGENT_TYPES", "CUSTOM_PREFIX", "agent_refusal", "router"]

AGENT_TYPES = frozenset({EventType.REWARD, EventType.MESSAGE, EventType.STATE, EventType.TOOL_CALL})
"""Built-in types an agent reports itself; ``llm_call``, ``exception`` and ``span`` are the
system's (the gateway's, the runner's)."""
CUSTOM_PREFIX = "custom."  # an agent's own types: "custom.<name>"


def router(call: StoreCaller, quota: EventQuota | None = None) -> APIRouter:
    api = APIRouter(tags=["agent"])
    store = call.store

    @api.post("/agent/{rollout_id}/{attempt_id}/events")
    async def post_events(
        rollout_id: str, attempt_id: str, body: AgentEvents, request: Request, key: IdempotencyKey = None
    ) -> Response:
        """Record what the agent reports (rewards, messages, its own events); answers
        ``{"added": n}``; a repeat (same key and body) the first answer."""
        attempt = await call(store.get_attempt, attempt_id)
        if attempt.rollout_id != rollout_id:  # an agent key's own path always matches
            raise NotFound("attempt", f"{rollout_id}/{attempt_id}")
        caller = caller_of(request)
        worker = caller.worker_id if caller is not None else None
        events = [event.to_create() for event in body.root]
        source = source_of(request, EventSource.AGENT)
        if source == EventSource.AGENT:
            _check_agent_types(events)
        added = await call(store.add_agent_events, attempt_id, events, key, worker, source, quota)
        return json_response({"added": added})

    return api


def agent_refusal(event: EventCreate) -> str | None:
    """Why an agent may not post ``event`` (None when it may): only the system writes model
    calls, exceptions, spans and final rewards, and an agent's own types live under ``custom.``."""
    if event.type == EventType.REWARD and "final" in event.data:
        return "a reward with 'final' is the runner's (the attempt's own result); post it without 'final'"
    if event.type in AGENT_TYPES or (
        event.type.startswith(CUSTOM_PREFIX) and len(event.type) > len(CUSTOM_PREFIX)
    ):
        return None
    return (
        f"an agent key may not post events of type {event.type!r}: it may post "
        f"{', '.join(sorted(AGENT_TYPES))} and its own types named '{CUSTOM_PREFIX}<name>'"
    )


def _check_agent_types(events: list[EventCreate]) -> None:
    """403 naming the first event an agent may not post; nothing of the request is stored."""
    for i, event in enumerate(events):
        why = agent_refusal(event)
        if why is not None:
            raise Forbidden(f"event {i} (type {event.type!r}): {why}")
