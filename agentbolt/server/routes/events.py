"""Reading what rollouts recorded: the events of one rollout, or of many in one request."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from agentbolt.schemas import EVENT_CURSOR, Event, EventsQuery, Page
from agentbolt.server.routes.common import json_response
from agentbolt.server.store_caller import StoreCaller

__all__ = ["router"]


def router(call: StoreCaller) -> APIRouter:
    api = APIRouter(prefix="/api", tags=["events"])
    store = call.store

    @api.get("/rollouts/{rollout_id}/events", response_model=Page[Event])
    async def list_events(
        rollout_id: str,
        attempt_id: str | None = None,
        type: Annotated[list[str] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(pattern=EVENT_CURSOR)] = None,
    ) -> Response:
        page = await call(
            store.list_events, rollout_id, attempt_id=attempt_id, types=type, limit=limit, cursor=cursor
        )
        return json_response(page)

    @api.post("/events/query", response_model=Page[Event])
    async def query_events(body: EventsQuery) -> Response:
        """The events of many rollouts, ordered by (timestamp, id), a page at a time: what a
        trainer or an export reads for a whole batch in one request instead of one per rollout.
        Ids that match no rollout contribute nothing. A read: any token role may send it."""
        page = await call(
            store.list_events,
            rollout_ids=body.rollout_ids,
            types=body.type,
            limit=body.limit,
            cursor=body.cursor,
        )
        return json_response(page)

    return api
