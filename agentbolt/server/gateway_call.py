"""What one gateway call carries: the attempt it is for, which logical call it is a try of,
and the refusals the gateway answers itself (see :mod:`agentbolt.server.gateway`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from agentbolt.http1 import Answer
from agentbolt.schemas import LLM
from agentbolt.server.openai_format import Wants, openai_error

__all__ = [
    "CALL_ID_HEADER",
    "MAX_KEY_LENGTH",
    "CallTry",
    "ForwardedCall",
    "LeanRequest",
    "LeanResponse",
    "Refused",
    "Target",
    "json_answer",
    "with_call_id",
]

MAX_KEY_LENGTH = 200  # a longer Idempotency-Key is recorded by its hash
# The recorded ``llm_call`` event's id, on every answer whose call was recorded (not on streams:
# those carry it in the body of a final chunk or event, see ``docs/events.md``).
CALL_ID_HEADER = "X-Agentbolt-Call-Id"


class Refused(Exception):
    """A call the gateway answers itself, with an OpenAI-style error."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, final: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.final = status, type, param, final

    def response(self) -> Response:
        answer = json_answer(openai_error(str(self), self.type, self.status, self.param), self.status)
        if self.final:  # OpenAI's clients retry a 429 unless told not to
            answer.raw_headers.append((b"x-should-retry", b"false"))
        return answer


def json_answer(body: Any, status: int = 200, call_id: int | None = None) -> Response:
    """A JSON answer; with ``call_id`` (the call's record) it is in the header and the body."""
    if call_id is None:
        return JsonAnswer(orjson.dumps(body), status)
    return JsonAnswer(orjson.dumps(with_call_id(body, call_id)), status, call_id)


class JsonAnswer(Response):
    """The ``Response`` Starlette would build for a JSON body (the same headers), made
    directly: building its headers through Starlette's general path cost a tenth of a
    gateway call."""

    media_type = "application/json"

    def __init__(self, content: bytes, status: int = 200, call_id: int | None = None) -> None:
        self.status_code, self.body, self.background = status, content, None
        headers = [] if call_id is None else [(_CALL_ID, b"%d" % call_id)]
        if not (status < 200 or status in (204, 304)):
            headers.append((b"content-length", b"%d" % len(content)))
        headers.append(_JSON)
        self.raw_headers = headers

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


_CALL_ID = CALL_ID_HEADER.lower().encode()
_JSON = (b"content-type", b"application/json")


def with_call_id(body: dict[str, Any], call_id: int | None) -> dict[str, Any]:
    """``body`` with the top-level ``agentbolt`` field naming the call's record (a copy; the
    body as it is when the call has no record). OpenAI's clients keep unknown fields."""
    return body if call_id is None else {**body, "agentbolt": {"call_id": call_id}}


@dataclass(frozen=True)
class Target:
    """What a gateway call needs to know about its attempt; fixed once the attempt exists."""

    rollout_id: str
    attempt_id: str
    resources_version: int | None
    llms: dict[str, LLM]
    # resource name -> its servers in this attempt's order (only resources naming several)
    ranked: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def pick(self, model: Any, role: str | None = None) -> tuple[str, LLM]:
        """The LLM resource serving the call: the one whose model matches ``model``; where
        several match (two roles on one model), the one named ``role`` by the call's URL (a
        role's own base URL, ``.../role/<name>/v1``), else the first; with none matching, the
        only one. With several (roles: ``planner``, ``solver``) and none matching, 404 naming
        them: a call is never recorded as another role's. A ``role`` that is no LLM resource is
        a 404 naming them too. No ``model`` (the model list): the role's, else the first."""
        if not self.llms:
            raise Refused(
                400, "this rollout's resources have no LLM resource to forward to", "invalid_request_error"
            )
        if role is not None and role not in self.llms:
            raise Refused(404, f"no role {role!r}: {self._roles()}", "not_found_error")
        if model is None:  # a model list: the role's server, else the first one's
            name = role or next(iter(self.llms))
            return name, self.llms[name]
        matching = [name for name, llm in self.llms.items() if llm.model == model]
        if matching:
            name = role if role in matching else matching[0]
            return name, self.llms[name]
        if len(self.llms) == 1:
            return next(iter(self.llms.items()))
        raise Refused(
            404,
            f"the model {model!r} is none of this rollout's LLM resources: {self._roles()}",
            "not_found_error",
            "model",
        )

    def _roles(self) -> str:
        """This rollout's LLM resources (its roles), each with its model."""
        return ", ".join(f"{name} (model {llm.model!r})" for name, llm in self.llms.items())


@dataclass(frozen=True)
class CallTry:
    """Which logical call a request is a try of: what the agent's client said about it."""

    key: str | None  # its Idempotency-Key
    body_sha256: str
    retry: int | None  # its x-stainless-retry-count

    @classmethod
    def of(cls, request: Request | Mapping[str, str], body: bytes) -> CallTry:
        """From the request's headers (a request, or its headers in lower case) and body."""
        headers = request.headers if isinstance(request, Request) else request
        key = headers.get("idempotency-key") or None
        if key is not None and len(key) > MAX_KEY_LENGTH:
            key = hashlib.sha256(key.encode()).hexdigest()
        count = headers.get("x-stainless-retry-count", "")
        retry = int(count) if count.isdigit() and len(count) < 6 else None
        return cls(key, hashlib.sha256(body).hexdigest(), retry)


@dataclass
class ForwardedCall:
    """One model call in flight: where it goes and what the record needs."""

    target: Target
    resource: str
    llm: LLM
    endpoint: str
    request: dict[str, Any]
    wants: Wants
    key: str | None
    started: float  # wall clock, the event's timestamp
    t0: float  # perf_counter, for latency
    try_of: CallTry
    responses: dict[str, Any] | None = None  # a Responses request; ``request`` is its chat form
    response_id: str | None = None  # the id of the Response answering it
    upstream: str = ""  # the model server's base URL it is sent to (one of the resource's)
    tried: tuple[str, ...] = ()  # servers it failed to reach (nothing sent)
    examples: int = 0  # example turns the gateway put into ``request`` (its LLM resource's)

    def elapsed_ms(self) -> float:
        return round((time.perf_counter() - self.t0) * 1000, 3)

    def scrub(self, text: str) -> str:
        return text.replace(self.key, "***") if self.key else text


@dataclass(frozen=True)
class LeanRequest:
    """An upstream POST sent through the lean transport's :meth:`~agentbolt.http1.Http1Transport.request`
    (a plain-http upstream, an answer read whole): no httpx request is built."""

    origin: tuple[str, int]
    target: bytes
    headers: list[tuple[bytes, bytes]]
    content: bytes


class LeanHeaders:
    """The headers of a :class:`LeanResponse`, looked up as httpx's are (any case)."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw  # names in lower case

    def get(self, name: str, default: str | None = None) -> str | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self.raw:
            if key == wanted:
                return value.decode("latin-1")
        return default


class LeanResponse:
    """A whole upstream answer, with what the gateway reads of an ``httpx.Response``."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, answer: Answer) -> None:
        self.status_code, self.content = answer.status_code, answer.content
        self.headers = LeanHeaders(answer.headers)

    async def aread(self) -> bytes:
        return self.content

    async def aclose(self) -> None:
        pass  # read whole: its connection is back in the pool already
