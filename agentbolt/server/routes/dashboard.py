"""The dashboard: a read-only, single-page client of the server's own HTTP API.

Everything it shows comes from the same ``/api`` routes any client uses, with whatever token
the browser holds (a reader token is enough). The page is plain HTML, CSS and ES modules under
``agentbolt/server/static/`` — no build step, nothing fetched from the internet — so it ships
inside the wheel.

Two small read-only routes exist only for the page:

- ``GET /api/dashboard/info``: server version, store backend, lease length, the caller's role
  and name (a reviewer's, the author of the scores it gives);
- ``GET /api/dashboard/throughput``: rollouts finished per time bucket over a recent window.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles
from pydantic_core import to_json

from agentbolt.schemas import RolloutStatus
from agentbolt.server.config import ServerConfig
from agentbolt.server.store_caller import StoreCaller

__all__ = ["STATIC_DIR", "pages", "router", "static_files", "throughput"]

STATIC_DIR = Path(__file__).parents[1] / "static"
FINAL = (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED)

# The page loads only its own files and talks only to this server. Event data comes from
# agents and is untrusted: the scripts never put it into the page as HTML, and this policy
# stops any inline script or style that slipped through.
_SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def throughput(rows: list[tuple[float, str]], end: float, window: float, bucket: float) -> dict[str, Any]:
    """Bucket finished rollouts into ``window / bucket`` slots ending at ``end`` (oldest first)."""
    n = max(1, math.ceil(window / bucket))
    last_start = math.floor(end / bucket) * bucket  # the current, partly elapsed bucket
    first_start = last_start - (n - 1) * bucket
    counts_B = [{s.value: 0 for s in FINAL} for _ in range(n)]
    for ended, status in rows:
        index = int((ended - first_start) // bucket)
        if 0 <= index < n and status in counts_B[index]:
            counts_B[index][status] += 1
    buckets = [{"start": first_start + i * bucket, **counts} for i, counts in enumerate(counts_B)]
    return {"bucket_seconds": bucket, "window_seconds": n * bucket, "now": end, "buckets": buckets}


def router(call: StoreCaller, config: ServerConfig, version: str) -> APIRouter:
    """The page's two routes under ``/api/dashboard``."""
    api = APIRouter(prefix="/api/dashboard", tags=["dashboard"])
    store = call.store

    @api.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        """What the page needs to know about this server and the caller's token."""
        role = request.scope.get("agentbolt.role")
        caller = request.scope.get("agentbolt.caller")
        return {
            "version": version,
            "backend": store.backend,
            "lease_seconds": store.lease_seconds,
            "auth": bool(config.tokens),
            "role": role.value if role is not None else None,
            "name": caller.name if caller is not None else None,
            "server_time": time.time(),
        }

    @api.get("/throughput")
    async def get_throughput(
        window: Annotated[float, Query(gt=0, le=7 * 24 * 3600)] = 3600.0,
        bucket: Annotated[float, Query(ge=1, le=24 * 3600)] = 60.0,
    ) -> Response:
        """Rollouts finished (succeeded, failed, cancelled) per ``bucket`` seconds over the last
        ``window`` seconds, oldest bucket first; the last bucket is the current, partial one.
        At most 2000 buckets: a smaller ``bucket`` is widened (the answer says which was used)."""
        bucket = max(bucket, window / 2000)
        end = time.time()
        rows = await call(store.finished_since, end - window - bucket)
        return Response(to_json(throughput(rows, end, window, bucket)), media_type="application/json")

    return api


def pages() -> APIRouter:
    """The page itself at ``/`` and ``/dashboard``, and its icon (not part of the API document)."""
    api = APIRouter(include_in_schema=False)
    for path in ("/", "/dashboard"):
        api.add_api_route(path, _page, methods=["GET"])
    api.add_api_route("/favicon.ico", _favicon, methods=["GET"])
    return api


def static_files() -> StaticFiles:
    """The page's scripts and styles, to mount at ``/static``."""
    return _StaticFiles(directory=STATIC_DIR)


class _StaticFiles(StaticFiles):
    """Static files that the browser revalidates (ETag) instead of caching blindly, so a
    server upgrade is never paired with a stale script."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["cache-control"] = "no-cache"
        response.headers["x-content-type-options"] = "nosniff"
        return response


async def _page() -> Response:
    html = (STATIC_DIR / "index.html").read_bytes()
    return Response(html, media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS)


async def _favicon() -> Response:
    svg = (STATIC_DIR / "favicon.svg").read_bytes()
    return Response(svg, media_type="image/svg+xml", headers={"cache-control": "max-age=86400"})
