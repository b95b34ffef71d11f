"""Every error the server answers, in the one body :func:`agentbolt.web.error_body` builds.

The store's errors keep their status and class name; a request that does not match the schema
is a 422 naming the first field at fault (all of them under ``details``); a ``ValueError`` is a
400; routing errors (unknown path, method not allowed) keep their status; anything else is a
500 whose detail stays in the server log.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentbolt.errors import AgentboltError
from agentbolt.web import error_response

__all__ = ["error_answer", "install_error_handlers"]

log = logging.getLogger("agentbolt.server")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(AgentboltError, _agentbolt_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ValueError, _value_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


async def error_answer(
    request: Request, exc: AgentboltError | RequestValidationError | ValueError
) -> JSONResponse:
    """The answer the handlers above give ``exc`` (for routes served outside FastAPI's router)."""
    if isinstance(exc, AgentboltError):
        return await _agentbolt_error(request, exc)
    if isinstance(exc, RequestValidationError):
        return await _validation_error(request, exc)
    return await _value_error(request, exc)


async def _agentbolt_error(request: Request, exc: AgentboltError) -> JSONResponse:
    return error_response(exc.status_code, str(exc), type(exc).__name__)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    details = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    first = details[0] if details else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"])
    return error_response(422, f"{where}: {first['msg']}", "validation_error", details=details)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Routing errors (unknown path, method not allowed). A 405 lists every method the path
    has: Starlette names only the first route it matched."""
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() != "allow"}
    if exc.status_code == 405:
        headers["allow"] = ", ".join(sorted(_allowed_methods(request)))
    return error_response(exc.status_code, str(exc.detail), "http_error", headers=headers)


def _allowed_methods(request: Request) -> set[str]:
    """The methods of the routes at this path: the app's own and those its routers hold
    (``app.state.routes``: FastAPI may keep included routes out of ``app.router.routes``). Where
    a fixed path and a template both match, the fixed one is the path's: ``/api/rollouts/wait``
    takes POST, not the GET of ``/api/rollouts/{rollout_id}``."""
    routes = [*request.app.router.routes, *getattr(request.app.state, "routes", ())]
    by_params: dict[int, set[str]] = {}
    for route in routes:
        regex, methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and methods and regex.match(request.url.path):
            by_params.setdefault(len(route.param_convertors), set()).update(methods)
    return by_params[min(by_params)] if by_params else set()


async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
    return error_response(400, str(exc), "bad_request")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal server error (see the server log)", "internal_error")
