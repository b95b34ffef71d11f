"""OTLP/HTTP trace ingest against a real server: protobuf (from the real OTel exporter) and JSON."""

from __future__ import annotations

import gzip
import json

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from agentbolt.schemas import RolloutCreate, Task


def _two_claims(client):
    client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(2)])
    return client.dequeue("w"), client.dequeue("w")


def _spans(client, rollout_id):
    return [e for e in client.all_events(rollout_id) if e.type == "span"]


def test_protobuf_from_the_otel_exporter_lands_in_the_right_rollout(server, client):
    first, second = _two_claims(client)
    # routing by resource attributes for one provider, by span attributes for the other
    by_resource = TracerProvider(
        resource=Resource.create(
            {
                "service.name": "my-agent",
                "agentbolt.rollout_id": first.rollout.id,
                "agentbolt.attempt_id": first.attempt.id,
            }
        )
    )
    by_span = TracerProvider()
    for provider in (by_resource, by_span):
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{server.url}/v1/traces")))
    with by_resource.get_tracer("t").start_as_current_span(
        "plan", attributes={"k": 1, "tags": ["a", "b"]}
    ) as root:
        with by_resource.get_tracer("t").start_as_current_span("tool") as child:
            child.add_event("called", {"arg": "x"})
            child.set_status(Status(StatusCode.ERROR, "boom"))
    span = by_span.get_tracer("t").start_span("other", attributes={"agentbolt.attempt_id": second.attempt.id})
    span.end()
    for provider in (by_resource, by_span):
        provider.shutdown()
    plan, tool = sorted((e.data for e in _spans(client, first.rollout.id)), key=lambda d: d["name"])
    assert (plan["name"], tool["name"]) == ("plan", "tool")
    assert plan["trace_id"] == f"{root.get_span_context().trace_id:032x}" == tool["trace_id"]
    assert tool["parent_span_id"] == plan["span_id"] == f"{root.get_span_context().span_id:016x}"
    assert plan["attributes"] == {"k": 1, "tags": ["a", "b"]} and plan["service"] == "my-agent"
    assert tool["status"] == {"code": "error", "message": "boom"}
    assert tool["events"][0]["name"] == "called" and tool["events"][0]["attributes"] == {"arg": "x"}
    assert plan["start_time"] <= tool["start_time"] <= tool["end_time"] <= plan["end_time"]
    [other] = _spans(client, second.rollout.id)
    assert other.data["name"] == "other" and other.attempt_id == second.attempt.id and other.sequence is None


def _json_export(attempt_id: str | None, rollout_id: str | None = None) -> dict:
    attributes = [{"key": "agentbolt.attempt_id", "value": {"stringValue": attempt_id}}] if attempt_id else []
    if rollout_id:
        attributes.append({"key": "agentbolt.rollout_id", "value": {"stringValue": rollout_id}})
    kv = {"kvlistValue": {"values": [{"key": "x", "value": {"doubleValue": 0.5}}]}}
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "parentSpanId": "eee19b7ec3c1b173",
        "name": "llm",
        "kind": 3,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001500000000",
        "attributes": [
            *attributes,
            {"key": "n", "value": {"intValue": "3"}},
            {"key": "ok", "value": {"boolValue": True}},
            {"key": "kv", "value": kv},
        ],
        "status": {"code": 1},
    }
    scope_spans = {"scope": {"name": "lib"}, "spans": [span]}
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [scope_spans]}]}


def test_json_lands_in_the_right_rollout(server, client):
    first, second = _two_claims(client)
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(second.attempt.id, second.rollout.id))
    assert r.status_code == 200 and r.json() == {}
    [event] = _spans(client, second.rollout.id)
    assert event.timestamp == 1_700_000_000.0
    data = event.data
    assert (
        data["trace_id"] == "5b8efff798038103d269b633813fc60c"
        and data["parent_span_id"] == "eee19b7ec3c1b173"
    )
    assert data["kind"] == "client" and data["status"]["code"] == "ok" and data["scope"] == "lib"
    assert data["end_time"] - data["start_time"] == 1.5
    assert {k: v for k, v in data["attributes"].items() if not k.startswith("agentbolt.")} == {
        "n": 3,
        "ok": True,
        "kv": {"x": 0.5},
    }
    assert _spans(client, first.rollout.id) == []


def test_rollout_id_alone_means_its_latest_attempt_and_gzip_works(server, client):
    first, _ = _two_claims(client)
    body = gzip.compress(json.dumps(_json_export(None, first.rollout.id)).encode())
    r = httpx.post(
        f"{server.url}/v1/traces",
        content=body,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 200
    assert [e.attempt_id for e in _spans(client, first.rollout.id)] == [first.attempt.id]


def test_a_worker_token_lands_spans_only_in_its_own_workers_attempts(server, client):
    from agentbolt.client import Client

    with Client(server.url) as runner:
        registration = runner.register_worker("tracer")
        assert registration is not None
        client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(2)])
        mine = runner.dequeue(registration.worker_id)
    theirs = client.dequeue("w-other")
    assert mine is not None and theirs is not None
    token = {"authorization": f"Bearer {registration.worker_token}"}
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(theirs.attempt.id), headers=token)
    assert r.status_code == 200
    assert r.json()["partialSuccess"] == {
        "rejectedSpans": 1,
        "errorMessage": f"1 span(s) name an attempt worker {registration.worker_id!r} does not hold",
    }
    assert _spans(client, theirs.rollout.id) == []
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(None, theirs.rollout.id), headers=token)
    assert r.json()["partialSuccess"]["rejectedSpans"] == 1 and _spans(client, theirs.rollout.id) == []
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(mine.attempt.id), headers=token)
    assert r.status_code == 200 and r.json() == {}
    assert [e.attempt_id for e in _spans(client, mine.rollout.id)] == [mine.attempt.id]
    # without a worker token (no tokens configured here), any attempt still takes spans
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(theirs.attempt.id))
    assert r.json() == {} and len(_spans(client, theirs.rollout.id)) == 1


def test_unrouted_and_unknown_spans_are_rejected_as_partial_success(server, client):
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export(None))
    assert r.json()["partialSuccess"]["rejectedSpans"] == 1
    r = httpx.post(f"{server.url}/v1/traces", json=_json_export("at-unknown"))
    assert r.json()["partialSuccess"]["rejectedSpans"] == 1
    r = httpx.post(
        f"{server.url}/v1/traces",
        content=b"\x0a\x02garbage",
        headers={"content-type": "application/x-protobuf"},
    )
    assert r.status_code == 400
    answer = httpx.post(
        f"{server.url}/v1/traces", content=b"", headers={"content-type": "application/x-protobuf"}
    )
    assert answer.status_code == 200
    ExportTraceServiceResponse().ParseFromString(answer.content)


def test_spans_after_the_attempt_ended_are_kept(server, client):
    first, _ = _two_claims(client)
    from agentbolt.schemas import AttemptStatus

    client.finish(first.attempt.id, AttemptStatus.SUCCEEDED, 1.0)
    httpx.post(f"{server.url}/v1/traces", json=_json_export(first.attempt.id)).raise_for_status()
    assert len(_spans(client, first.rollout.id)) == 1


def test_spans_delivered_twice_are_stored_once(server, client):
    """An exporter that retried, or a collector that delivered twice: a span the attempt holds
    already (same trace and span id) is skipped, in JSON and in protobuf."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    first, second = _two_claims(client)
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/traces", json=_json_export(first.attempt.id))
        assert r.status_code == 200 and r.json() == {}
    [span] = _spans(client, first.rollout.id)
    assert span.data["span_id"] == "eee19b7ec3c1b174"

    captured = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"agentbolt.attempt_id": second.attempt.id}))
    provider.add_span_processor(SimpleSpanProcessor(captured))
    with provider.get_tracer("t").start_as_current_span("outer"):
        provider.get_tracer("t").start_span("inner").end()
    exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces")
    spans = captured.get_finished_spans()
    for _ in range(2):
        exporter.export(spans)
    exporter.shutdown()
    assert sorted(e.data["name"] for e in _spans(client, second.rollout.id)) == ["inner", "outer"]
    # the same ids in another attempt are another span
    httpx.post(f"{server.url}/v1/traces", json=_json_export(second.attempt.id)).raise_for_status()
    assert len(_spans(client, second.rollout.id)) == 3
