"""The OpenAPI document: what FastAPI generates, plus the error answers routes really give.

FastAPI documents a 200 and its own 422 shape. agentbolt answers every error with one body,
:class:`~agentbolt.schemas.ErrorBody` (from the auth and body-limit middleware, the store's
errors, validation, the gateway's OpenAI-style errors), so each operation lists the statuses
it can get, with that body; and the bearer scheme is declared when the server has tokens.
Found by fuzzing the schema (``tests/scale/test_fuzz.py``).

OpenAPI links say which answer feeds which call: a published version can be read, and rollouts
enqueued after it; an enqueued rollout can be read, cancelled and claimed; a claim's attempt can
be heartbeated, given events, finished and used through the gateway (as the worker holding it),
and its rollout cancelled. Clients and generators can follow them; schemathesis's stateful phase
does, so those handlers are fuzzed on real attempts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from agentbolt.schemas import ErrorBody

__all__ = ["document"]

_REF = {"$ref": "#/components/schemas/ErrorBody"}
_WHY = {
    400: "A value the server cannot use (see the message)",
    401: "Missing or invalid bearer token (when the server has tokens)",
    403: "The token's role may not do this (or a reward that another source gives)",
    404: "Not found",
    409: "Conflict: the attempt is no longer held, the status change is not allowed, or the request contradicts what is stored (a reward scored meanwhile)",
    413: "Request body larger than the server's limit",
    422: "The request does not match the schema (or a score is off its reward's scale)",
    502: "The model server failed or could not be reached",
    504: "The model server timed out",
}
_UNAUTHENTICATED = ("/health",)

_FIRST_ROLLOUT = {"rollout_id": "$response.body#/0/id"}
_CLAIMED = {"attempt_id": "$response.body#/attempt/id"}
_CLAIMED_ROLLOUT = {"rollout_id": "$response.body#/rollout/id"}
_CLAIMED_BOTH = {**_CLAIMED_ROLLOUT, **_CLAIMED}
_HOLDER = {"worker_id": "$response.body#/attempt/worker_id"}
# (source path, method, status) -> link name -> (target method, target path, parameters, body)
_LINKS: dict[tuple[str, str, str], dict[str, tuple[str, str, dict[str, str], dict[str, str] | None]]] = {
    ("/api/rollouts", "post", "201"): {
        "GetRollout": ("get", "/api/rollouts/{rollout_id}", _FIRST_ROLLOUT, None),
        "CancelRollout": ("post", "/api/rollouts/{rollout_id}/cancel", _FIRST_ROLLOUT, None),
        "ListAttempts": ("get", "/api/rollouts/{rollout_id}/attempts", _FIRST_ROLLOUT, None),
        "Dequeue": ("post", "/api/dequeue", {}, None),
    },
    ("/api/dequeue", "post", "200"): {
        "GetAttempt": ("get", "/api/attempts/{attempt_id}", _CLAIMED, None),
        "Heartbeat": ("post", "/api/attempts/{attempt_id}/heartbeat", _CLAIMED, _HOLDER),
        "AddEvents": ("post", "/api/attempts/{attempt_id}/events", _CLAIMED, _HOLDER),
        "Finish": ("post", "/api/attempts/{attempt_id}/finish", _CLAIMED, _HOLDER),
        "CancelRollout": ("post", "/api/rollouts/{rollout_id}/cancel", _CLAIMED_ROLLOUT, None),
        "ListEvents": ("get", "/api/rollouts/{rollout_id}/events", _CLAIMED_ROLLOUT, None),
        "ChatCompletion": (
            "post",
            "/gateway/{rollout_id}/{attempt_id}/v1/chat/completions",
            _CLAIMED_BOTH,
            None,
        ),
        "Models": ("get", "/gateway/{rollout_id}/{attempt_id}/v1/models", _CLAIMED_BOTH, None),
    },
    ("/api/resources", "post", "201"): {
        "GetResources": ("get", "/api/resources/{version}", {"version": "$response.body#/version"}, None),
        "Enqueue": ("post", "/api/rollouts", {}, None),
    },
}


def _statuses(path: str, method: str, op: dict[str, Any]) -> set[int]:
    out = set() if path in _UNAUTHENTICATED else {401, 403}
    if op.get("parameters") or op.get("requestBody"):
        out |= {400, 422}
    if "{" in path:
        out.add(404)
    if method == "post":
        out.add(413)
        if (
            path.startswith(("/api/attempts/", "/gateway/", "/agent/"))
            or path.endswith(("/cancel", "/rewards"))
            or path == "/api/rollouts"
        ):
            out.add(409)
    if path.startswith("/gateway/"):
        out |= {400, 404, 409, 502, 504}
    if path.startswith("/judge/"):
        out |= {400, 502, 504}
    return out


def document(app: FastAPI, auth: bool) -> None:
    """Wrap ``app.openapi`` so every operation documents its error statuses and, when the
    server has tokens, the bearer authentication it needs."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["ErrorBody"] = body
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                for status in sorted(_statuses(path, method, op)):
                    responses[str(status)] = {
                        "description": _WHY[status],
                        "content": {"application/json": {"schema": _REF}},
                    }
        _link(schema)
        for replaced in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape
            components.pop(replaced, None)
        if auth:
            _document_auth(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _link(schema: dict[str, Any]) -> None:
    """Add the OpenAPI links of ``_LINKS``, naming each target by its operationId."""
    paths = schema["paths"]
    for (path, method, status), links in _LINKS.items():
        response = paths[path][method]["responses"][status]
        response["links"] = {}
        for name, (target_method, target_path, parameters, body) in links.items():
            link: dict[str, Any] = {"operationId": paths[target_path][target_method]["operationId"]}
            if parameters:
                link["parameters"] = parameters
            if body:
                link["requestBody"] = body
            response["links"][name] = link


def _document_auth(schema: dict[str, Any]) -> None:
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    for path in _UNAUTHENTICATED:
        for op in schema["paths"].get(path, {}).values():
            op["security"] = []
