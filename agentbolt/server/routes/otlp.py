"""``POST /v1/traces``: OTLP/HTTP trace export (see :mod:`agentbolt.server.otlp` for where the
spans land). The answer is an ``ExportTraceServiceResponse`` in the request's encoding."""

from __future__ import annotations

import zlib
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from agentbolt.schemas import EventSource
from agentbolt.server.otlp import PROTOBUF, BadPayload, OtlpIngest, decode
from agentbolt.server.routes.common import caller_of, source_of
from agentbolt.web import error_response

__all__ = ["router"]

# The body is read raw (protobuf or JSON): documented here. Protobuf is listed as a response
# only: fuzzers cannot make valid protobuf from a "binary" schema.
_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {  # proto3 JSON: null is the empty list
                        "resourceSpans": {
                            "anyOf": [{"type": "array", "items": {"type": "object"}}, {"type": "null"}]
                        }
                    },
                },
            },
        },
    }
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "OTLP ExportTraceServiceResponse, in the request's encoding",
        "content": {"application/json": {"schema": {"type": "object"}}, PROTOBUF: {}},
    },
    415: {
        "description": "Neither protobuf nor JSON",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    },
}


def router(ingest: OtlpIngest, max_body_bytes: int) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/traces", tags=["tracing"], openapi_extra=_OPENAPI, responses=_RESPONSES)
    async def traces(request: Request) -> Response:
        """OTLP/HTTP trace export (``application/x-protobuf`` or ``application/json``)."""
        content_type = request.headers.get("content-type", "").lower()
        protobuf = content_type.startswith(PROTOBUF)
        if not (protobuf or content_type.startswith("application/json")):  # OTLP/HTTP names one
            message = f"content-type must be {PROTOBUF} or application/json"
            return error_response(415, message, "unsupported_media_type")
        encoding = request.headers.get("content-encoding", "").lower()
        try:
            body, from_protobuf = decode(await request.body(), content_type, encoding, max_body_bytes)
            caller = caller_of(request)
            worker_id = caller.worker_id if caller is not None else None
            source = source_of(request, EventSource.RUNNER)
            rejected, why = await ingest.ingest(body, from_protobuf, worker_id, source)
        except (BadPayload, zlib.error) as exc:
            return error_response(400, str(exc), "bad_request")
        return _answer(rejected, why, protobuf)

    return api


def _answer(rejected: int, why: str, protobuf: bool) -> Response:
    if protobuf:
        message = ExportTraceServiceResponse()
        if rejected:
            message.partial_success.rejected_spans = rejected
            message.partial_success.error_message = why
        return Response(message.SerializeToString(), media_type=PROTOBUF)
    body = {"partialSuccess": {"rejectedSpans": rejected, "errorMessage": why}} if rejected else {}
    return Response(orjson.dumps(body), media_type="application/json")
