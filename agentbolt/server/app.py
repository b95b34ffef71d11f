"""The HTTP server: ``create_app(config)`` builds the FastAPI app over one store.

Routes are thin: parse, call the store, serialise. One module per resource under
:mod:`agentbolt.server.routes` builds each router; this module puts them together with the
error handlers, the one middleware chain every request goes through (CORS when asked, body
limit, auth, the fast paths of the gateway's and the runner's POSTs) and the lease sweep that
runs while the app does.
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
from agentbolt.store.quotas import EventQuota
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
    app.chain = _chain(app, gateway, call, wake, config, issued)
    return app


# the POSTs the fast paths serve, past auth: the gateway's, and the runner's dequeue, events
# and finish (each fast path passes on what it does not serve)
_GATEWAY, _RUNNER = "/gateway/", ("/api/dequeue", "/api/attempts/")
_IN_STACK = "agentbolt.in_stack"  # scope key: the request reached Starlette's own stack


class _App(FastAPI):
    """The app: every HTTP request goes through one middleware chain (:func:`_chain`), whose
    innermost step hands what no fast path serves to Starlette's stack (:meth:`stack`: its
    error handling and the router, no middleware of its own)."""

    chain: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.chain is None or scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        scope["app"] = self
        await self.chain(scope, receive, send)

    async def stack(self, scope: Any, receive: Any, send: Any) -> None:
        scope[_IN_STACK] = True
        await super().__call__(scope, receive, send)


def _chain(
    app: _App,
    gateway: Gateway,
    call: StoreCaller,
    wake: WakeUp,
    config: ServerConfig,
    issued: IssuedCredentials,
) -> Any:
    """The one chain, outermost first: CORS (only when ``cors_origins`` names origins), the
    500 answer to an unhandled error, the body limit, auth, then a gateway POST to the
    gateway's fast path, a runner POST to the runner's and anything else to the stack, so
    every route is limited and authenticated alike. The fast paths sit in front of FastAPI's
    routing because routing costs more than the rest of such a call."""
    runner: Any = runner_fast.RunnerFastPath(app.stack, call=call, wake=wake)
    gateway_path: Any = gateway_routes.GatewayFastPath(app.stack, gateway=gateway)

    async def route(scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] == "POST":
            path = scope["path"]
            if path.startswith(_GATEWAY):
                return await gateway_path(scope, receive, send)
            if path.startswith(_RUNNER):
                return await runner(scope, receive, send)
        await app.stack(scope, receive, send)

    auth = AuthMiddleware(route, **_auth_settings(gateway, config, issued))
    chain: Any = _Unhandled(BodyLimitMiddleware(auth, max_bytes=config.max_body_bytes))
    if config.cors_origins:
        chain = CORSMiddleware(
            chain, allow_origins=list(config.cors_origins), allow_headers=["*"], allow_methods=["*"]
        )
    return chain


class _Unhandled:
    """An error the stack did not answer (one from auth or a fast path) is logged and
    answered 500, as the stack's own error middleware answers the rest."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception:
            if scope.get(_IN_STACK):  # the stack's error middleware answered and logged it
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            answer = error_response(500, "internal server error (see the server log)", "internal_error")
            await answer(scope, receive, send)  # a started answer: uvicorn's


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
        agent.router(call, EventQuota(config.quota_events, config.quota_event_bytes)),
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
