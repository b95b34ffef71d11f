"""The HTTP server: ``create_app(config)`` builds the FastAPI app over one store.

Routes are thin: parse, call the store, serialise. One module per resource under
:mod:`agentbolt.server.routes` builds each router; this module puts them together with the
error handlers, the middleware (auth, body limit, the gateway's fast path, CORS when asked) and
the lease sweep that runs while the app does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from agentbolt.server.config import ServerConfig
from agentbolt.server.errors import install_error_handlers
from agentbolt.server.gateway import Gateway
from agentbolt.server.middleware import AuthMiddleware, BodyLimitMiddleware, IssuedCredentials
from agentbolt.server.openapi import document
from agentbolt.server.otlp import OtlpIngest
from agentbolt.server.routes import (
    agent,
    attempts,
    dashboard,
    events,
    judge,
    queue,
    resources,
    rewards,
    runner_fast,
    status,
    workers,
)
from agentbolt.server.routes import gateway as gateway_routes
from agentbolt.server.routes import otlp as otlp_routes
from agentbolt.server.store_caller import StoreCaller, WakeUp
from agentbolt.store import SqlStore, open_store
from agentbolt.web import FASTAPI_TELEMETRY_OFF, error_response

__all__ = ["create_app"]

log = logging.getLogger("agentbolt.server")


def create_app(config: ServerConfig | None = None, store: SqlStore | None = None) -> FastAPI:
    """Build the server app. ``store`` defaults to ``open_store(config.db)``, which the app then
    owns: it is closed (its database connections with it) when the app shuts down."""
    config = config or ServerConfig()
    owned = store is None
    store = store or open_store(config.db, lease_seconds=config.lease_seconds)
    call, wake, issued = StoreCaller(store), WakeUp(), IssuedCredentials()
    gateway = Gateway(call, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep(call, wake, config.sweep_interval))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            call.close()
            await gateway.aclose()
            if owned:
                store.close()

    app = _App(
        title="agentbolt",
        version=_version(),
        description="Task queue, resources and run records for training agents from their real runs.",
        lifespan=lifespan,
        telemetry=FASTAPI_TELEMETRY_OFF,  # type: ignore[arg-type]
    )
    app.state.store, app.state.config, app.state.call, app.state.gateway = store, config, call, gateway
    install_error_handlers(app)
    _include_routes(app, call, wake, gateway, config, issued)
    document(app, auth=bool(config.tokens))
    _add_middleware(app, gateway, call, wake, config, issued)
    if not config.cors_origins:  # with CORS, every request takes the whole stack
        app.front = _front(app, gateway, call, wake, config, issued)
    return app


# the POSTs the fast paths serve (the gateway's; the runner's dequeue, events and finish)
_FAST = ("/gateway/", "/api/dequeue", "/api/attempts/")


class _App(FastAPI):
    """The app, with the hot POSTs (``_FAST``) taken in front of Starlette's middleware stack:
    the same body limit, auth and fast paths as in the stack, without the layers between
    (error, telemetry and body-limit middleware, each a coroutine per request). What a fast
    path passes on (a body FastAPI should answer) takes the whole stack."""

    front: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.front is None or scope["type"] != "http" or scope["method"] != "POST":
            return await super().__call__(scope, receive, send)
        if not scope["path"].startswith(_FAST):
            return await super().__call__(scope, receive, send)
        scope["app"] = self
        try:
            await self.front(scope, receive, send)
        except Exception:  # as the stack's error middleware does (a started answer: uvicorn's)
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            answer = error_response(500, "internal server error (see the server log)", "internal_error")
            await answer(scope, receive, send)

    async def stack(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)


def _front(
    app: _App,
    gateway: Gateway,
    call: StoreCaller,
    wake: WakeUp,
    config: ServerConfig,
    issued: IssuedCredentials,
) -> Any:
    """The middleware of ``_add_middleware``, in the same order, over the whole stack; past
    auth, a gateway call goes straight to the gateway's fast path and any other to the
    runner's (neither serves the other's paths, so neither need pass them on)."""
    runner: Any = runner_fast.RunnerFastPath(app.stack, call=call, wake=wake)
    gateway_path: Any = gateway_routes.GatewayFastPath(app.stack, gateway=gateway)

    async def either(scope: Any, receive: Any, send: Any) -> None:
        fast = gateway_path if scope["path"].startswith("/gateway/") else runner
        await fast(scope, receive, send)

    auth = AuthMiddleware(either, **_auth_settings(gateway, config, issued))
    return BodyLimitMiddleware(auth, max_bytes=config.max_body_bytes)


def _auth_settings(gateway: Gateway, config: ServerConfig, issued: IssuedCredentials) -> dict[str, Any]:
    """AuthMiddleware's settings: the same for the stack's instance and the fast paths'."""
    return {
        "tokens": config.tokens,
        "call": gateway.call,
        "names": config.token_names,
        "issued": issued,
        "worker_token_ttl": config.worker_token_ttl,
        "registered_runners_only": config.registered_runners_only,
    }


def _include_routes(
    app: FastAPI,
    call: StoreCaller,
    wake: WakeUp,
    gateway: Gateway,
    config: ServerConfig,
    issued: IssuedCredentials,
) -> None:
    routers = [
        status.router(call, app.version),
        queue.router(call, wake),
        events.router(call),
        attempts.router(call, wake),
        agent.router(call),
        workers.router(call, wake, issued, config.worker_token_ttl),
        resources.router(call),
        rewards.router(call),
        gateway_routes.router(gateway),
        judge.router(gateway),
        otlp_routes.router(OtlpIngest(call, config), config.max_body_bytes),
    ]
    if config.dashboard:
        routers += [dashboard.router(call, config, app.version), dashboard.pages()]
    for router in routers:
        app.include_router(router)
    app.state.routes = [route for router in routers for route in router.routes]  # for 405 answers
    if config.dashboard:
        app.mount("/static", dashboard.static_files(), name="static")


def _add_middleware(
    app: FastAPI,
    gateway: Gateway,
    call: StoreCaller,
    wake: WakeUp,
    config: ServerConfig,
    issued: IssuedCredentials,
) -> None:
    """Innermost first: a request passes CORS, the body limit, auth, then the fast paths of
    the runner's calls and the gateway's, so those are limited and authenticated like every
    route."""
    app.add_middleware(runner_fast.RunnerFastPath, call=call, wake=wake)
    app.add_middleware(gateway_routes.GatewayFastPath, gateway=gateway)
    app.add_middleware(AuthMiddleware, **_auth_settings(gateway, config, issued))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_headers=["*"], allow_methods=["*"]
        )


async def _sweep(call: StoreCaller, wake: WakeUp, interval: float) -> None:
    """End lapsed leases and timed-out attempts every ``interval`` seconds."""
    while True:
        await asyncio.sleep(interval)
        try:
            expired = await call(call.store.expire)
            if expired:
                wake.notify()
                log.info("expired %d attempt(s)", expired)
        except Exception:
            log.exception("lease sweep failed")


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentbolt")
    except PackageNotFoundError:
        return "0.0.0"
