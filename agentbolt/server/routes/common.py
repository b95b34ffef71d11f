"""What the store's routes share: pre-serialised JSON answers and the cursor pattern.

Hot paths (dequeue, events, finish) return pre-serialised JSON to skip FastAPI's response
re-validation; their ``response_model`` still documents them in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import to_json

from agentbolt.errors import Forbidden
from agentbolt.schemas import EventSource
from agentbolt.server.config import Role
from agentbolt.server.middleware import Caller

__all__ = [
    "INT_CURSOR",
    "IdempotencyKey",
    "acting_worker",
    "caller_of",
    "json_bytes",
    "json_response",
    "source_of",
]

# Cursors as the store writes them (a queue position; "<timestamp>:<event id>" for events):
# anything else is a 422 from validation, not a 400 from the store.
INT_CURSOR = r"^[0-9]{1,18}$"

# The key a client makes for one logical write and sends again with each retry of it: the store
# keeps it on the row the write created and answers a repeat with the first result.
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=r"^[!-~]{1,200}$",
        description="one key per logical call, sent again by its retries (printable ASCII, at most 200)",
    ),
]


def json_bytes(model: BaseModel | list[Any] | dict[str, Any] | None) -> bytes:
    """``model`` (or ``null``) serialised as the JSON an answer carries."""
    if model is None:
        return b"null"
    if isinstance(model, BaseModel):
        return model.__pydantic_serializer__.to_json(model)
    return to_json(model)


def json_response(model: BaseModel | list[Any] | dict[str, Any] | None, status: int = 200) -> Response:
    """``model`` (or ``null``) serialised once, as the answer."""
    return Response(content=json_bytes(model), status_code=status, media_type="application/json")


def caller_of(request: Request) -> Caller | None:
    """Who sent the request (None when the server has no auth and no credential was sent)."""
    caller: Caller | None = request.scope.get("agentbolt.caller")
    return caller


def acting_worker(request: Request, named: str | None) -> str | None:
    """The worker a runner write acts for. A worker token acts for its own worker only: naming
    another is a 403, naming none means its own. Other tokens act for whom they name."""
    caller = caller_of(request)
    bound = caller.worker_id if caller is not None else None
    if bound is None:
        return named
    if named is not None and named != bound:
        raise Forbidden(f"this worker token belongs to worker {bound!r}; it cannot act for {named!r}")
    return bound


_SOURCES = {
    Role.ADMIN: EventSource.ADMIN,
    Role.RUNNER: EventSource.RUNNER,  # a configured runner token or a worker token
    Role.AGENT: EventSource.AGENT,
    Role.REVIEWER: EventSource.REVIEWER,
    Role.EVALUATOR: EventSource.EVALUATOR,
}


def source_of(request: Request, route: EventSource) -> EventSource:
    """Who writes the events a request posts: the credential's role, never the body. A request
    without a credential (a server with no tokens) writes as the route's own writer."""
    caller = caller_of(request)
    if caller is None:
        return route
    return _SOURCES.get(caller.role, route)
