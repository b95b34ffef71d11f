"""The HTTP server: ``create_app(config)`` builds the FastAPI app over one store.

Routes are thin: parse, call the store, serialise. Hot paths (dequeue, events, finish) return
pre-serialised JSON to skip FastAPI's response re-validation; their ``response_model`` still
documents them in the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentbolt.errors import AgentboltError
from agentbolt.schemas import (
    EVENT_CURSOR,
    LLM,
    MAX_INT32,
    Attempt,
    AttemptFinish,
    Claim,
    DequeueRequest,
    EnqueueRequest,
    Event,
    EventsQuery,
    EventsRequest,
    FinishRequest,
    HeartbeatRequest,
    Mode,
    Page,
    Resources,
    ResourcesCreate,
    Rollout,
    RolloutStatus,
    WaitRequest,
    WaitResult,
    Worker,
)
from agentbolt.server.config import Role, ServerConfig
from agentbolt.server.middleware import AuthMiddleware, BodyLimitMiddleware
from agentbolt.server.openapi import document, http_error
from agentbolt.store import SqlStore, open_store
from agentbolt.web import FASTAPI_TELEMETRY_OFF, error_response

__all__ = ["REDACTED", "create_app", "redact"]

log = logging.getLogger("agentbolt.server")
R = TypeVar("R")
# Cursors as the store writes them (a queue position; "<timestamp>:<event id>" for events):
# anything else is a 422 from validation, not a 400 from the store.
INT_CURSOR = r"^[0-9]{1,18}$"
REDACTED = "<redacted>"


def redact(res: Resources | None) -> Resources | None:
    """LLM API keys are for the gateway's upstream calls only: the API never serves them."""
    if res is None or not any(isinstance(r, LLM) and r.api_key for r in res.resources.values()):
        return res
    clean = {k: r.model_copy(update={"api_key": REDACTED}) if isinstance(r, LLM) and r.api_key else r
             for k, r in res.resources.items()}  # fmt: skip
    return res.model_copy(update={"resources": clean})


class StoreCaller:
    """Calls the synchronous store: inline for SQLite (sub-millisecond, one connection), in a
    worker thread for PostgreSQL (network round trips must not block the event loop)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.wake: WakeUp | None = None
        # as many threads as the store has connections: more would only queue on the pool
        # (and a plain executor costs half of anyio's worker threads per call)
        inline = store.backend == "sqlite"
        self.threads = None if inline else ThreadPoolExecutor(store.db.connections, "agentbolt-store")

    async def __call__(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        if self.threads is None:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, functools.partial(fn, *args, **kwargs)
        )

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=True)


class WakeUp:
    """Wakes long-polling requests when this process changed the queue (an enqueue, a finish,
    an expiry). Other replicas' changes are seen by the waiters' fallback polling."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


# Fallback polling while long-polling (changes made by other server replicas).
POLL_SECONDS = 0.5


def _json(model: BaseModel | list[Any] | dict[str, Any] | None, status: int = 200) -> Response:
    if model is None:
        body = "null"
    elif isinstance(model, BaseModel):
        body = model.model_dump_json()
    else:
        body = to_json(model).decode()
    return Response(content=body, status_code=status, media_type="application/json")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AgentboltError)
    async def _agentbolt_error(request: Request, exc: AgentboltError) -> JSONResponse:
        return error_response(exc.status_code, str(exc), type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        first = details[0] if details else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return error_response(422, f"{where}: {first['msg']}", "validation_error", details=details)

    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "bad_request")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error (see the server log)", "internal_error")


def _holder_named(request: Request, worker_id: str | None) -> None:
    """A runner token writes only to attempts it holds: it must name its ``worker_id``, which
    the store then checks against the attempt's holder (admins may write without one)."""
    if worker_id is None and request.scope.get("agentbolt.role") == Role.RUNNER:
        raise RequestValidationError(
            [{"loc": ("body", "worker_id"), "msg": "a runner token must name the worker holding the attempt",
              "type": "missing"}]
        )  # fmt: skip


def _store_router(call: StoreCaller, config: ServerConfig) -> APIRouter:
    api = APIRouter(prefix="/api")
    store = call.store
    wake = WakeUp()
    call.wake = wake

    @api.post("/rollouts", response_model=list[Rollout], status_code=201, tags=["queue"])
    async def enqueue(body: EnqueueRequest) -> Response:
        """Enqueue rollouts (one per item); items with an existing ``id`` are returned unchanged."""
        created = await call(store.enqueue, body.rollouts)
        wake.notify()
        return _json(created, 201)

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
            store.list_rollouts, status=status, mode=mode, resources_version=resources_version,
            group_id=group_id, limit=limit, cursor=cursor, newest_first=newest_first,
        )  # fmt: skip
        return _json(page)

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
                return _json(WaitResult(rollouts=rollouts, done=done))
            await wake.wait(min(POLL_SECONDS, max(0.0, deadline - loop.time())))

    @api.get("/rollouts/{rollout_id}", response_model=Rollout, tags=["queue"])
    async def get_rollout(rollout_id: str) -> Response:
        return _json(await call(store.get_rollout, rollout_id))

    @api.post("/rollouts/{rollout_id}/cancel", response_model=Rollout, tags=["queue"])
    async def cancel(rollout_id: str) -> Response:
        return _json(await call(store.cancel, rollout_id))

    @api.get("/rollouts/{rollout_id}/attempts", response_model=list[Attempt], tags=["queue"])
    async def list_attempts(rollout_id: str) -> Response:
        return _json(await call(store.list_attempts, rollout_id))

    @api.get("/rollouts/{rollout_id}/events", response_model=Page[Event], tags=["events"])
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
        return _json(page)

    @api.post("/events/query", response_model=Page[Event], tags=["events"])
    async def query_events(body: EventsQuery) -> Response:
        """The events of many rollouts, ordered by (timestamp, id), a page at a time: what a
        trainer or an export reads for a whole batch in one request instead of one per rollout.
        Ids that match no rollout contribute nothing. A read: any token role may send it."""
        page = await call(store.list_events, rollout_ids=body.rollout_ids, types=body.type, limit=body.limit,
                          cursor=body.cursor)  # fmt: skip
        return _json(page)

    @api.post("/dequeue", response_model=Claim | None, tags=["runner"])
    async def dequeue(body: DequeueRequest, request: Request) -> Response:
        """Claim the oldest queued rollout as a new attempt; ``null`` when the queue stays empty
        for ``wait`` seconds (a long poll: a runner gets new work as soon as it is enqueued)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.wait
        while (claim := await call(store.dequeue, body.worker_id, body.lease_seconds)) is None:
            if loop.time() >= deadline:
                return Response(content=b"null", media_type="application/json")
            await wake.wait(min(POLL_SECONDS, max(0.0, deadline - loop.time())))
            if await request.is_disconnected():  # a dead runner's poll must not take the work
                return Response(content=b"null", media_type="application/json")
        redacted = redact(claim.resources)
        if redacted is not claim.resources:
            claim = claim.model_copy(update={"resources": redacted})
        hook = getattr(request.app.state, "claim_hook", None)
        if hook is not None:
            claim = hook(claim, request)
        return _json(claim)

    @api.get("/attempts/{attempt_id}", response_model=Attempt, tags=["runner"])
    async def get_attempt(attempt_id: str) -> Response:
        return _json(await call(store.get_attempt, attempt_id))

    @api.post("/attempts/{attempt_id}/heartbeat", response_model=Attempt, tags=["runner"])
    async def heartbeat(attempt_id: str, body: HeartbeatRequest, request: Request) -> Response:
        _holder_named(request, body.worker_id)
        return _json(await call(store.heartbeat, attempt_id, body.worker_id, body.lease_seconds))

    @api.post("/attempts/{attempt_id}/events", tags=["runner"])
    async def add_events(attempt_id: str, body: EventsRequest, request: Request) -> Response:
        """Append events; ones whose (attempt, sequence) is already stored are skipped."""
        _holder_named(request, body.worker_id)
        added = await call(store.add_events, attempt_id, body.events, body.worker_id)
        return _json({"added": added})

    @api.post("/attempts/{attempt_id}/finish", response_model=Rollout, tags=["runner"])
    async def finish(attempt_id: str, body: FinishRequest, request: Request) -> Response:
        _holder_named(request, body.worker_id)
        finish = body.model_dump(exclude={"worker_id"})
        rollout = await call(store.finish_attempt, attempt_id, AttemptFinish(**finish), body.worker_id)
        wake.notify()  # a requeue is new work; a final rollout ends someone's wait
        return _json(rollout)

    @api.post("/resources", response_model=Resources, status_code=201, tags=["resources"])
    async def publish(body: ResourcesCreate) -> Response:
        return _json(redact(await call(store.publish_resources, body)), 201)

    @api.get("/resources", response_model=Page[Resources], tags=["resources"])
    async def list_resources(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(pattern=INT_CURSOR)] = None,
    ) -> Response:
        page = await call(store.list_resources, limit, cursor)
        return _json(page.model_copy(update={"items": [redact(r) for r in page.items]}))

    @api.get("/resources/latest", response_model=Resources | None, tags=["resources"])
    async def latest() -> Response:
        res = await call(store.latest_resources)
        return _json(redact(res)) if res is not None else Response(b"null", media_type="application/json")

    @api.get("/resources/{version}", response_model=Resources, tags=["resources"])
    async def get_resources(version: Annotated[int, Path(ge=1, le=MAX_INT32)]) -> Response:
        return _json(redact(await call(store.get_resources, version)))

    @api.get("/workers", response_model=list[Worker], tags=["status"])
    async def workers() -> Response:
        return _json(await call(store.list_workers))

    @api.get("/stats", tags=["status"])
    async def stats() -> Response:
        return _json(await call(store.stats))

    return api


def create_app(config: ServerConfig | None = None, store: SqlStore | None = None) -> FastAPI:
    """Build the server app. ``store`` defaults to ``open_store(config.db)``."""
    config = config or ServerConfig()
    store = store or open_store(config.db, lease_seconds=config.lease_seconds)
    call = StoreCaller(store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep(call, config.sweep_interval))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            call.close()

    app = FastAPI(
        title="agentbolt",
        version=_version(),
        description="Task queue, resources and run records for training agents from their real runs.",
        lifespan=lifespan,
        telemetry=FASTAPI_TELEMETRY_OFF,  # type: ignore[arg-type]
    )
    app.state.store, app.state.config, app.state.call = store, config, call
    _install_error_handlers(app)

    @app.get("/health", tags=["status"])
    async def health() -> dict[str, Any]:
        return {"status": "ok", "backend": store.backend, "version": _version()}

    app.include_router(_store_router(call, config))
    _mount_extensions(app, config)
    document(app, auth=bool(config.tokens))
    app.add_middleware(AuthMiddleware, tokens=config.tokens)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_headers=["*"],
                           allow_methods=["*"])  # fmt: skip
    return app


def _mount_extensions(app: FastAPI, config: ServerConfig) -> None:
    """Optional parts (gateway, OTLP ingest, dashboard) register themselves here."""
    import importlib

    for module, attr in (
        ("agentbolt.server.gateway", "install"),
        ("agentbolt.server.otlp", "install"),
        ("agentbolt.server.dashboard", "install"),
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        getattr(mod, attr)(app, config)


async def _sweep(call: StoreCaller, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            expired = await call(call.store.expire)
            if expired and call.wake is not None:
                call.wake.notify()
            if expired:
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
