"""What agentbolt's two HTTP apps share: the server (:mod:`agentbolt.server`) and the model
engine's OpenAI-compatible face (:mod:`agentbolt.engine.server`).

Both answer every error with one body, ``{"error": {"message": ..., "type": ..., ...}}``: the
shape OpenAI's clients read, and :class:`~agentbolt.schemas.ErrorBody` in the server's OpenAPI
document. :func:`error_body` is its one builder; the extra fields depend on who answers (OpenAI
clients expect ``param`` and ``code``, the server's validation errors add ``details``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["FASTAPI_TELEMETRY_OFF", "error_body", "error_response"]

# FastAPI's built-in OpenTelemetry instrumentation (on whenever opentelemetry is installed)
# costs about 1 ms per request here; agentbolt's apps record what they need themselves.
FASTAPI_TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def error_body(message: str, type: str, **fields: Any) -> dict[str, Any]:
    """``{"error": {"message", "type", **fields}}``."""
    return {"error": {"message": message, "type": type, **fields}}


def error_response(
    status: int, message: str, type: str, headers: Mapping[str, str] | None = None, **fields: Any
) -> JSONResponse:
    """:func:`error_body` as a JSON response with ``status``."""
    return JSONResponse(error_body(message, type, **fields), status_code=status, headers=headers)
