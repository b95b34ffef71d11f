"""Versioned resources: publish a new version, list them, read the latest or one version.

Every answer is redacted: LLM API keys stay on the server (the gateway uses them upstream).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from agentbolt.schemas import MAX_INT32, Page, Resources, ResourcesCreate
from agentbolt.server.routes.common import INT_CURSOR, IdempotencyKey, json_response
from agentbolt.server.store_caller import StoreCaller, redact

__all__ = ["router"]


def router(call: StoreCaller) -> APIRouter:
    api = APIRouter(prefix="/api/resources", tags=["resources"])
    store = call.store

    @api.post("", response_model=Resources, status_code=201)
    async def publish(body: ResourcesCreate, key: IdempotencyKey = None) -> Response:
        """Store a new version (``trial``: never the latest; only rollouts pinned to it run it).
        A retry with the same ``Idempotency-Key`` returns the version the first one stored."""
        return json_response(redact(await call(store.publish_resources, body, key)), 201)

    @api.get("", response_model=Page[Resources])
    async def list_resources(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(pattern=INT_CURSOR)] = None,
    ) -> Response:
        page = await call(store.list_resources, limit, cursor)
        return json_response(page.model_copy(update={"items": [redact(r) for r in page.items]}))

    # before "/{version}", which would otherwise take "latest" for a version and refuse it
    @api.get("/latest", response_model=Resources | None)
    async def latest() -> Response:
        """The newest version that is not a trial: what unpinned rollouts run with."""
        return json_response(redact(await call(store.latest_resources)))

    @api.get("/{version}", response_model=Resources)
    async def get_resources(version: Annotated[int, Path(ge=1, le=MAX_INT32)]) -> Response:
        return json_response(redact(await call(store.get_resources, version)))

    return api
