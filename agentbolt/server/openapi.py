"""The OpenAPI document: what FastAPI generates, plus the error answers routes really give.

FastAPI documents a 200 and its own 422 shape. agentbolt answers every error with one body,
:class:`~agentbolt.schemas.ErrorBody` (from the auth and body-limit middleware, the store's
errors, validation, the gateway's OpenAI-style errors), so each operation lists the statuses
it can get, with that body; and the bearer scheme is declared when the server has tokens.
Found by fuzzing the schema (``tests/scale/test_fuzz.py``).
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
    403: "The token's role may not do this",
    404: "Not found",
    409: "Conflict: the attempt is no longer held, or the status change is not allowed",
    413: "Request body larger than the server's limit",
    422: "The request does not match the schema",
    502: "The model server failed or could not be reached",
    504: "The model server timed out",
}
_UNAUTHENTICATED = ("/health",)


def _statuses(path: str, method: str, op: dict[str, Any]) -> set[int]:
    out = set() if path in _UNAUTHENTICATED else {401, 403}
    if op.get("parameters") or op.get("requestBody"):
        out |= {400, 422}
    if "{" in path:
        out.add(404)
    if method == "post":
        out.add(413)
        if path.startswith(("/api/attempts/", "/gateway/")) or path.endswith("/cancel"):
            out.add(409)
    if path.startswith("/gateway/"):
        out |= {400, 404, 409, 502, 504}
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
        for replaced in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape
            components.pop(replaced, None)
        if auth:
            _document_auth(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_auth(schema: dict[str, Any]) -> None:
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    for path in _UNAUTHENTICATED:
        for op in schema["paths"].get(path, {}).values():
            op["security"] = []
