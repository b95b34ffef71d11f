"""OTLP/HTTP trace ingest: ``POST /v1/traces`` (protobuf or JSON, optionally gzip) -> ``span`` events.

A span lands in the rollout named by its attributes (or its resource's):
``agentbolt.attempt_id`` (and ``agentbolt.rollout_id``, checked when both are given; a rollout id
alone means its latest attempt). Spans without them, or for unknown attempts, are rejected and
counted in the OTLP ``partial_success`` answer, as the protocol asks. Spans may arrive after
their attempt ended (exporters batch), so ended attempts still take them. A request with a
worker token lands spans only in attempts its worker holds or held (the others are rejected,
counted as such): one runner cannot write into another's rollouts. A span the attempt
holds already (same trace and span id: an exporter that retried, a collector that delivered
twice) is skipped.
"""

from __future__ import annotations

import base64
import zlib
from collections import defaultdict
from typing import Any

import orjson
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agentbolt.errors import NotFound
from agentbolt.schemas import Attempt, EventCreate, EventSource, EventType
from agentbolt.server.config import ServerConfig
from agentbolt.server.store_caller import StoreCaller

__all__ = [
    "ATTEMPT_ATTR",
    "PROTOBUF",
    "ROLLOUT_ATTR",
    "BadPayload",
    "OtlpIngest",
    "decode",
    "span_key",
    "spans_from_otlp",
]

ROLLOUT_ATTR = "agentbolt.rollout_id"
ATTEMPT_ATTR = "agentbolt.attempt_id"
PROTOBUF = "application/x-protobuf"
_STATUS = {0: "unset", 1: "ok", 2: "error"}
_KIND = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


class BadPayload(ValueError):
    """A body that is not OTLP: answered with a 400, never a 500."""


def _value(v: dict[str, Any]) -> Any:
    """An OTLP/JSON AnyValue -> plain JSON."""
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        n = int(v["intValue"])  # int64 travels as a string in OTLP/JSON
        if not -(2**63) <= n < 2**63:
            raise BadPayload(f"intValue {n} is out of the int64 range")
        return n
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attributes(v["kvlistValue"].get("values", []))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value") or {}) for kv in items or []}


def _hex(value: str | None, from_protobuf: bool) -> str | None:
    """Span and trace ids: hex in OTLP/JSON, base64 once protobuf bytes go through MessageToDict."""
    if not value:
        return None
    return base64.b64decode(value).hex() if from_protobuf else value.lower()


def _seconds(nanos: Any) -> float | None:
    return int(nanos) / 1e9 if nanos not in (None, "", 0, "0") else None


def _enum(value: Any, names: dict[int, str], prefix: str) -> str:
    """An OTLP enum: a number (OTLP/JSON) or, from other encoders, its name."""
    if isinstance(value, int):
        return names.get(value, str(value))
    return str(value).lower().removeprefix(prefix)


def _span(span: dict[str, Any], service: Any, scope: str | None, from_protobuf: bool) -> dict[str, Any]:
    status = span.get("status") or {}
    code = status.get("code", 0)
    return {
        "name": span.get("name", ""),
        "trace_id": _hex(span.get("traceId"), from_protobuf),
        "span_id": _hex(span.get("spanId"), from_protobuf),
        "parent_span_id": _hex(span.get("parentSpanId"), from_protobuf),
        "kind": _enum(span.get("kind", 0), _KIND, "span_kind_"),
        "start_time": _seconds(span.get("startTimeUnixNano")),
        "end_time": _seconds(span.get("endTimeUnixNano")),
        "attributes": _attributes(span.get("attributes")),
        "status": {
            "code": _enum(code, _STATUS, "status_code_"),
            "message": status.get("message") or None,
        },
        "events": [
            {
                "name": e.get("name", ""),
                "time": _seconds(e.get("timeUnixNano")),
                "attributes": _attributes(e.get("attributes")),
            }
            for e in span.get("events") or []
        ],
        "service": service,
        "scope": scope,
    }


def _objects(obj: dict[str, Any], *keys: str) -> list[dict[str, Any]]:
    """The objects listed under ``keys`` (absent: none); any other shape is a bad payload."""
    out: list[dict[str, Any]] = []
    for key in keys:
        value = obj.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise BadPayload(f"OTLP {key} must be a list of objects")
        out += value
    return out


def spans_from_otlp(
    body: dict[str, Any], from_protobuf: bool = False
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(routing attributes, span event data) for each span of an OTLP/JSON export body.
    A body that is not shaped like OTLP raises :class:`BadPayload` (a 400), never a 500."""
    out = []
    try:
        for rs in _objects(body, "resourceSpans"):
            resource = _attributes((rs.get("resource") or {}).get("attributes"))
            routing = {k: str(resource[k]) for k in (ROLLOUT_ATTR, ATTEMPT_ATTR) if k in resource}
            for ss in _objects(rs, "scopeSpans", "instrumentationLibrarySpans"):
                scope = (ss.get("scope") or ss.get("instrumentationLibrary") or {}).get("name")
                for span in _objects(ss, "spans"):
                    data = _span(span, resource.get("service.name"), scope, from_protobuf)
                    attrs = data["attributes"]
                    route = {
                        **routing,
                        **{k: str(attrs[k]) for k in (ROLLOUT_ATTR, ATTEMPT_ATTR) if k in attrs},
                    }
                    out.append((route, data))
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # a field of the wrong type
        if isinstance(exc, BadPayload):
            raise
        raise BadPayload(f"malformed OTLP body: {type(exc).__name__}: {exc}") from None
    return out


def decode(raw: bytes, content_type: str, encoding: str, limit: int) -> tuple[dict[str, Any], bool]:
    """The export body as OTLP/JSON, and whether it came as protobuf (``gzip`` inflated up to
    ``limit`` bytes); :class:`BadPayload` when it is neither."""
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=31)
        raw = inflater.decompress(raw, limit)
        if inflater.unconsumed_tail:
            raise BadPayload(f"decompressed body larger than {limit} bytes")
    elif encoding not in ("", "identity"):
        raise BadPayload(f"unsupported content-encoding {encoding!r}")
    if content_type.startswith(PROTOBUF):
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(raw)
        except DecodeError as exc:
            raise BadPayload(f"invalid OTLP protobuf: {exc}") from None
        return MessageToDict(message, use_integers_for_enums=True), True
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadPayload(f"invalid OTLP JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadPayload("an OTLP JSON body is an object")
    return body, False


def span_key(data: dict[str, Any]) -> str | None:
    """What recognises a span delivered again: its trace and span id (none without both)."""
    if data["trace_id"] and data["span_id"]:
        return f"span:{data['trace_id']}:{data['span_id']}"
    return None


class OtlpIngest:
    def __init__(self, call: StoreCaller, config: ServerConfig) -> None:
        self.call, self.store, self.config = call, call.store, config

    async def attempt_for(
        self, route: dict[str, Any], cache: dict[tuple[Any, Any], Attempt | None]
    ) -> Attempt | None:
        key = (route.get(ROLLOUT_ATTR), route.get(ATTEMPT_ATTR))
        if key not in cache:
            cache[key] = await self._resolve(*key)
        return cache[key]

    async def _resolve(self, rollout_id: Any, attempt_id: Any) -> Attempt | None:
        try:
            if attempt_id:
                attempt = await self.call(self.store.get_attempt, str(attempt_id))
                return attempt if not rollout_id or attempt.rollout_id == str(rollout_id) else None
            if rollout_id:
                attempts = await self.call(self.store.list_attempts, str(rollout_id))
                return attempts[-1] if attempts else None
        except NotFound:
            return None
        return None

    async def ingest(
        self,
        body: dict[str, Any],
        from_protobuf: bool,
        worker_id: str | None = None,
        source: EventSource = EventSource.RUNNER,
    ) -> tuple[int, str]:
        """Record the spans; return (rejected count, why). ``worker_id``: the worker a worker
        token binds the caller to (its spans land only in that worker's attempts); ``source``:
        who posted them."""
        by_attempt: dict[str, list[EventCreate]] = defaultdict(list)
        keys: dict[str, list[str | None]] = defaultdict(list)
        cache: dict[tuple[Any, Any], Attempt | None] = {}
        rejected, unrouted, foreign = 0, 0, 0
        for route, data in spans_from_otlp(body, from_protobuf):
            if not route:
                unrouted += 1
                continue
            attempt = await self.attempt_for(route, cache)
            if attempt is None:
                rejected += 1
                continue
            if worker_id is not None and attempt.worker_id != worker_id:
                foreign += 1
                continue
            attempt_id = attempt.id
            by_attempt[attempt_id].append(
                EventCreate(type=EventType.SPAN, timestamp=data["start_time"] or 0.0, data=data)
            )
            keys[attempt_id].append(span_key(data))
        for attempt_id, events in by_attempt.items():
            await self.call(self.store.record_events, attempt_id, events, keys[attempt_id], source)
        why = []
        if unrouted:
            why.append(f"{unrouted} span(s) carry no {ATTEMPT_ATTR} / {ROLLOUT_ATTR} attribute")
        if rejected:
            why.append(f"{rejected} span(s) name an unknown attempt or rollout")
        if foreign:
            why.append(f"{foreign} span(s) name an attempt worker {worker_id!r} does not hold")
        return unrouted + rejected + foreign, "; ".join(why)
