"""Tracing: user spans, and OpenTelemetry export of everything a rollout does.

``with agentbolt.span("tool", query=q): ...`` marks a step of an agent. What it becomes
depends on the runner:

- tracing off (the default, and the cheap path): a ``span`` event in the rollout's own event
  batch — no OpenTelemetry, no extra HTTP;
- tracing on (``Runner(tracing=True)`` or ``AGENTBOLT_TRACING=1``): an OpenTelemetry span. The
  runner then wraps each rollout in a root span, turns each ``emit_*`` call into a short child
  span (``agentbolt.reward``, ...), and exports over OTLP/HTTP to the server's ``/v1/traces``,
  which stores them as ``span`` events of that rollout. Spans made by the agent's own
  OpenTelemetry instrumentation land there too: a span processor on the global tracer
  provider stamps every span started inside a rollout with ``agentbolt.rollout_id`` and
  ``agentbolt.attempt_id`` and routes it to the runner that runs the rollout.

If the application configured an SDK ``TracerProvider`` before the runner started, the
processor joins it (the application's own exporters keep working); otherwise one is installed.
Spans started outside any rollout are left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import orjson

from agentbolt.runner.agent import RolloutContext, active_rollout
from agentbolt.schemas import EventCreate, EventType

__all__ = ["ATTEMPT_ATTR", "ROLLOUT_ATTR", "SpanHandle", "Tracer", "span", "tracing_enabled"]

ROLLOUT_ATTR = "agentbolt.rollout_id"
ATTEMPT_ATTR = "agentbolt.attempt_id"

# attempt id -> the Tracer (runner) exporting its spans; bounded, so late spans still find it
_ROUTES: OrderedDict[str, Tracer] = OrderedDict()
_ROUTES_LOCK = threading.Lock()
_PROCESSOR: Any = None
_INSTALL_LOCK = threading.Lock()
# (trace_id, span_id) of the enclosing light span, for nesting when OpenTelemetry is off
_light_parent: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "agentbolt_span", default=None
)


def tracing_enabled(flag: bool | None = None) -> bool:
    """An explicit flag, else the ``AGENTBOLT_TRACING`` environment variable."""
    if flag is not None:
        return flag
    return os.environ.get("AGENTBOLT_TRACING", "").lower() in ("1", "true", "yes", "on")


def _route(attempt_id: str) -> Tracer | None:
    with _ROUTES_LOCK:
        return _ROUTES.get(attempt_id)


def _attr(value: Any) -> Any:
    """OpenTelemetry attribute values are primitives (or lists of one primitive type)."""
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return orjson.dumps(value, default=str).decode()


class SpanHandle:
    """What ``with span(...) as s`` gives: ``s.set_attribute(k, v)``, ``s.add_event(name)``."""

    def __init__(self, otel_span: Any = None) -> None:
        self._otel = otel_span
        self.attributes: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []

    def set_attribute(self, key: str, value: Any) -> None:
        if self._otel is not None:
            self._otel.set_attribute(key, _attr(value))
        else:
            self.attributes[key] = value

    def add_event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if self._otel is not None:
            self._otel.add_event(name, {k: _attr(v) for k, v in (attributes or {}).items()})
        else:
            self.events.append({"name": name, "time": time.time(), "attributes": attributes or {}})


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[SpanHandle]:
    """Mark a step of the agent (see the module docstring); a no-op outside a rollout."""
    ctx = active_rollout()
    tracer = _route(ctx.attempt.id) if ctx is not None else None
    if tracer is not None:
        otel = tracer.otel_tracer.start_as_current_span(
            name, attributes={k: _attr(v) for k, v in attributes.items()}
        )
        with otel as otel_span:
            yield SpanHandle(otel_span)
        return
    if ctx is None:
        yield SpanHandle()
        return
    with _light_span(ctx, name, attributes) as handle:
        yield handle


@contextlib.contextmanager
def _light_span(ctx: RolloutContext, name: str, attributes: dict[str, Any]) -> Iterator[SpanHandle]:
    parent = _light_parent.get()
    trace_id = parent[0] if parent else secrets.token_hex(16)
    span_id = secrets.token_hex(8)
    handle = SpanHandle()
    handle.attributes.update(attributes)
    token = _light_parent.set((trace_id, span_id))
    start, status = time.time(), {"code": "ok", "message": None}
    try:
        yield handle
    except BaseException as exc:
        status = {"code": "error", "message": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        _light_parent.reset(token)
        ctx.emit(
            EventType.SPAN,
            {
                "name": name,
                "trace_id": trace_id,
                "span_id": span_id,
                "parent_span_id": parent[1] if parent else None,
                "kind": "internal",
                "start_time": start,
                "end_time": time.time(),
                "attributes": {k: _json_safe(v) for k, v in handle.attributes.items()},
                "status": status,
                "events": handle.events,
            },
        )


def _json_safe(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value, default=str))


def _processor() -> Any:
    """The process-wide span processor, joined to the global tracer provider once."""
    global _PROCESSOR
    with _INSTALL_LOCK:
        if _PROCESSOR is None:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            provider = trace.get_tracer_provider()
            if not isinstance(provider, TracerProvider):  # the API's default: nobody set one up
                provider = TracerProvider(resource=Resource.create({"service.name": "agentbolt-runner"}))
                trace.set_tracer_provider(provider)
            _PROCESSOR = _make_processor()
            provider.add_span_processor(_PROCESSOR)
        return _PROCESSOR


def _make_processor() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor

    class RolloutSpanProcessor(SpanProcessor):
        """Stamps spans started inside a rollout and hands finished ones to its runner."""

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            ctx = active_rollout()
            if ctx is not None:
                span.set_attribute(ROLLOUT_ATTR, ctx.rollout.id)
                span.set_attribute(ATTEMPT_ATTR, ctx.attempt.id)
                return
            parent = trace.get_current_span(parent_context)  # e.g. a thread that did not copy the context
            attrs = getattr(parent, "attributes", None) or {}
            if ATTEMPT_ATTR in attrs:
                span.set_attribute(ROLLOUT_ATTR, attrs.get(ROLLOUT_ATTR, ""))
                span.set_attribute(ATTEMPT_ATTR, attrs[ATTEMPT_ATTR])

        def on_end(self, span: Any) -> None:
            attempt_id = (span.attributes or {}).get(ATTEMPT_ATTR)
            tracer = _route(attempt_id) if attempt_id else None
            if tracer is not None:
                tracer.batch.on_end(span)

    return RolloutSpanProcessor()


class Tracer:
    """A runner's OpenTelemetry export: its rollouts' spans go to ``{server}/v1/traces``."""

    def __init__(self, server_url: str, token: str | None = None, schedule_delay: float = 0.5) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        _processor()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        exporter = OTLPSpanExporter(
            endpoint=f"{server_url.rstrip('/')}/v1/traces", headers=headers, timeout=10
        )
        self.batch = BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay * 1000)
        self.otel_tracer = trace.get_tracer("agentbolt")

    @contextlib.contextmanager
    def rollout(self, ctx: RolloutContext) -> Iterator[None]:
        """Trace one rollout: a root span around it, and a child span per emitted event (also
        those the runner emits after the agent returned). Must run in the rollout's own
        context, so that the agent's spans become children of the root."""
        with _ROUTES_LOCK:
            _ROUTES[ctx.attempt.id] = self
            while len(_ROUTES) > 10_000:
                _ROUTES.popitem(last=False)
        attributes = {
            "agentbolt.task_id": ctx.task.id,
            "agentbolt.mode": ctx.rollout.mode.value,
            "agentbolt.attempt": ctx.attempt.number,
        }
        with self.otel_tracer.start_as_current_span("agentbolt.rollout", attributes=attributes) as root:
            ctx.listeners.append(functools.partial(self._on_event, ctx, root))
            yield

    def _on_event(self, ctx: RolloutContext, root: Any, event: EventCreate) -> None:
        from opentelemetry import trace

        if event.type == EventType.SPAN:
            return
        attributes = {f"agentbolt.{event.type}.{k}": _attr(v) for k, v in event.data.items() if v is not None}
        attributes.update(
            {
                ROLLOUT_ATTR: ctx.rollout.id,
                ATTEMPT_ATTR: ctx.attempt.id,
                "agentbolt.event.sequence": event.sequence if event.sequence is not None else -1,
            }
        )
        inside = trace.get_current_span().get_span_context().is_valid
        parent = None if inside else trace.set_span_in_context(root)
        stamp = int(event.timestamp * 1e9)
        otel_span = self.otel_tracer.start_span(
            f"agentbolt.{event.type}", context=parent, attributes=attributes, start_time=stamp
        )
        if event.type == EventType.EXCEPTION:
            otel_span.set_status(trace.Status(trace.StatusCode.ERROR, str(event.data.get("message", ""))))
        otel_span.end(end_time=stamp)

    def flush(self, timeout: float = 10.0) -> bool:
        """Export what is pending now (blocking; the runner calls it from a thread)."""
        return bool(self.batch.force_flush(int(timeout * 1000)))

    def shutdown(self) -> None:
        with _ROUTES_LOCK:
            for attempt_id in [a for a, t in _ROUTES.items() if t is self]:
                del _ROUTES[attempt_id]
        self.batch.shutdown()
