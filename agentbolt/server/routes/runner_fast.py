"""A pure ASGI fast path for the three calls every rollout makes: ``POST /api/dequeue``,
``POST /api/attempts/{attempt_id}/events`` and ``POST /api/attempts/{attempt_id}/finish``.

FastAPI's route matching and dependency solving cost about twice what the store does for these
calls (profiled under ``benchmarks/store_throughput.py``), so :class:`RunnerFastPath` serves
them before FastAPI's router sees them: it validates the body with the route's own model
(from the raw bytes), does what the route does, and answers as it would. It sits inside the
auth and body-limit middleware, like every route.

Whatever it does not take on goes to FastAPI as it came (its body replayed): a body that is
not valid JSON or fails the model's validation, a bad ``Idempotency-Key``, a content type
other than JSON. Those answers (422 and friends) stay FastAPI's own. Errors raised once the
call is under way (the store's, a worker token naming another worker) get the same answers
as the app's error handlers give them.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from agentbolt.errors import AgentboltError
from agentbolt.schemas import DequeueRequest, EventsRequest, FinishRequest
from agentbolt.server.errors import error_answer
from agentbolt.server.middleware import read_body
from agentbolt.server.routes.attempts import append_events, finish_attempt
from agentbolt.server.routes.common import json_bytes
from agentbolt.server.routes.queue import claim_work
from agentbolt.server.store_caller import StoreCaller, WakeUp

__all__ = ["RunnerFastPath"]

_KEY = re.compile(rb"[!-~]{1,200}")  # IdempotencyKey's pattern (routes.common)
_JSON = (b"content-type", b"application/json")
_ATTEMPT_CALLS: dict[str, type[BaseModel]] = {"events": EventsRequest, "finish": FinishRequest}


class RunnerFastPath:
    def __init__(self, app: Any, call: StoreCaller, wake: WakeUp) -> None:
        self.app, self.call, self.wake = app, call, wake

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        what = _runner_post(scope)
        if what is None:
            await self.app(scope, receive, send)
            return
        kind, attempt_id = what
        raw = await read_body(receive)
        if raw is None:
            return  # the runner went away before its call was read: nothing to answer
        parsed = _parse(scope, kind, raw)
        if parsed is None:  # FastAPI's answer, as if this path were not here
            await self.app(scope, _replay(raw, receive), send)
            return
        body, key = parsed
        request = Request(scope, receive)
        try:
            if kind == "dequeue":
                payload = json_bytes(await claim_work(self.call, self.wake, body, key, request))
            elif kind == "events":
                payload = b'{"added":%d}' % await append_events(self.call, attempt_id, body, key, request)
            else:
                payload = json_bytes(
                    await finish_attempt(self.call, self.wake, attempt_id, body, key, request)
                )
        except (AgentboltError, RequestValidationError, ValueError) as exc:
            response = await error_answer(request, exc)
            await response(scope, receive, send)
            return
        # the answer json_response would make (its headers, in its order), without building it
        headers = [(b"content-length", b"%d" % len(payload)), _JSON]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _runner_post(scope: dict[str, Any]) -> tuple[str, str] | None:
    """("dequeue", "") or (call, attempt id) for the calls served here; None for any other."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path = scope.get("path", "")
    if path == "/api/dequeue":
        return "dequeue", ""
    if not path.startswith("/api/attempts/"):
        return None
    parts = path.split("/")  # "", "api", "attempts", id, call
    if len(parts) != 5 or not parts[3] or parts[4] not in _ATTEMPT_CALLS:
        return None
    return parts[4], parts[3]


def _parse(scope: dict[str, Any], kind: str, raw: bytes) -> tuple[Any, str | None] | None:
    """The validated body and the idempotency key; None where FastAPI should answer."""
    key: bytes | None = None
    json = False
    for name, value in scope["headers"]:
        if name == b"content-type":
            json = value.split(b";", 1)[0].strip().lower() == b"application/json"
        elif name == b"idempotency-key" and key is None:
            key = value
    if not json or (key is not None and not _KEY.fullmatch(key)):
        return None
    model: type[BaseModel] = DequeueRequest if kind == "dequeue" else _ATTEMPT_CALLS[kind]
    try:
        body = model.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None
    return body, key.decode("ascii") if key is not None else None


def _replay(raw: bytes, receive: Any) -> Any:
    """A ``receive`` that hands over the body read already, then the connection's own."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replay
