"""How the server and its runners are doing: health, workers, queue statistics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from agentbolt.schemas import Worker
from agentbolt.server.routes.common import json_response
from agentbolt.server.store_caller import StoreCaller

__all__ = ["router"]


def router(call: StoreCaller, version: str) -> APIRouter:
    api = APIRouter(tags=["status"])
    store = call.store

    @api.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "backend": store.backend, "version": version}

    @api.get("/api/workers", response_model=list[Worker])
    async def workers() -> Response:
        return json_response(await call(store.list_workers))

    @api.get("/api/stats")
    async def stats() -> Response:
        return json_response(await call(store.stats))

    return api
