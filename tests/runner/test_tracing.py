"""The runner's tracer: user spans, emit_* calls and the agent's own OpenTelemetry spans land
in the rollout as ``span`` events; with tracing off, user spans are plain events."""

from __future__ import annotations

import asyncio

from opentelemetry import trace

from agentbolt.client import Client
from agentbolt.runner import worker
from agentbolt.runner.agent import emit_message, emit_reward, rollout
from agentbolt.runner.tracing import span
from agentbolt.runner.worker import Runner
from agentbolt.schemas import RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread


@rollout
def traced_agent(task: Task) -> float:
    with span("retrieve", query="q") as s:
        s.set_attribute("hits", 3)
        emit_reward(0.5, name="partial")
    with trace.get_tracer("user-lib").start_as_current_span("user.instrumented"):
        emit_message("inside the user's span")
    return 1.0


@rollout
async def traced_async_agent(task: Task) -> float:
    with span("think"):
        await asyncio.sleep(0)
    with trace.get_tracer("user-lib").start_as_current_span("user.async"):
        pass
    return 0.0


def _run(runner: Runner) -> None:
    asyncio.run(asyncio.wait_for(runner.run(), 60))


def _by_name(client, rollout_id):
    events = [e for e in client.all_events(rollout_id) if e.type == "span"]
    return {e.data["name"]: e.data for e in events}, events


def test_tracing_on_exports_user_emit_and_instrumented_spans(server, client):
    [ro] = client.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
    _run(Runner(traced_agent, server.url, max_rollouts=1, tracing=True))
    spans, events = _by_name(client, ro.id)
    assert {
        "agentbolt.rollout",
        "retrieve",
        "agentbolt.reward",
        "user.instrumented",
        "agentbolt.message",
    } <= set(spans)
    root = spans["agentbolt.rollout"]
    assert root["parent_span_id"] is None and root["attributes"]["agentbolt.task_id"] == ro.task.id
    assert {e.data["trace_id"] for e in events} == {root["trace_id"]}
    assert spans["retrieve"]["parent_span_id"] == root["span_id"]
    assert spans["retrieve"]["attributes"]["query"] == "q" and spans["retrieve"]["attributes"]["hits"] == 3
    rewards = [e.data for e in events if e.data["name"] == "agentbolt.reward"]
    partial = next(r for r in rewards if r["attributes"].get("agentbolt.reward.name") == "partial")
    assert (
        partial["parent_span_id"] == spans["retrieve"]["span_id"]
        and partial["attributes"]["agentbolt.reward.value"] == 0.5
    )
    final = next(r for r in rewards if r["attributes"].get("agentbolt.reward.final"))
    assert final["parent_span_id"] == root["span_id"]  # emitted by the runner after the agent returned
    assert spans["agentbolt.message"]["parent_span_id"] == spans["user.instrumented"]["span_id"]
    assert spans["user.instrumented"]["parent_span_id"] == root["span_id"]
    # the ordinary events are still there, once
    assert [e.data["value"] for e in client.all_events(ro.id) if e.type == "reward"] == [0.5, 1.0]


def test_tracing_on_with_an_async_agent(server, client):
    [ro] = client.enqueue([RolloutCreate(task=Task())])
    _run(Runner(traced_async_agent, server.url, max_rollouts=1, tracing=True))
    spans, _ = _by_name(client, ro.id)
    root = spans["agentbolt.rollout"]
    assert spans["think"]["parent_span_id"] == spans["user.async"]["parent_span_id"] == root["span_id"]


def test_tracing_off_records_user_spans_as_events_without_otel_export(server, client, monkeypatch):
    monkeypatch.delenv("AGENTBOLT_TRACING", raising=False)
    [ro] = client.enqueue([RolloutCreate(task=Task())])
    runner = Runner(traced_agent, server.url, max_rollouts=1)
    assert runner.tracer is None
    _run(runner)
    spans, events = _by_name(client, ro.id)
    assert set(spans) == {"retrieve"}  # no root, no per-event spans, no export of the user's OTel span
    retrieve = events[0]
    assert retrieve.sequence is not None  # it travelled in the runner's own event batch
    assert (
        retrieve.data["attributes"] == {"query": "q", "hits": 3} and retrieve.data["status"]["code"] == "ok"
    )
    assert retrieve.data["end_time"] >= retrieve.data["start_time"]


def test_span_outside_a_rollout_is_a_no_op():
    with span("nothing") as s:
        s.set_attribute("k", 1)


@rollout
def failing_agent(task: Task) -> float:
    with span("step"):
        raise ValueError("no luck")


def test_tracing_on_marks_a_failed_rollout(server, client):
    [ro] = client.enqueue([RolloutCreate(task=Task(), max_attempts=1)])
    _run(Runner(failing_agent, server.url, max_rollouts=1, tracing=True))
    spans, _ = _by_name(client, ro.id)
    assert spans["step"]["status"] == {"code": "error", "message": "ValueError: no luck"}
    assert spans["agentbolt.rollout"]["status"]["code"] == "error"
    exception = spans["agentbolt.exception"]
    assert (
        exception["status"]["code"] == "error"
        and exception["attributes"]["agentbolt.exception.type"] == "ValueError"
    )
    assert exception["parent_span_id"] == spans["agentbolt.rollout"]["span_id"]


def test_spans_are_exported_with_the_worker_token_not_the_runners_own(tmp_path, monkeypatch):
    """With configured tokens the runner registers and then holds a worker token; its span export
    sends that token too (the runner's own token is the enrollment credential), and the server
    takes the spans under it."""
    admin, enrollment = "adm-token-71e2", "run-token-4a9c"
    config = ServerConfig(
        db=str(tmp_path / "t.db"), tokens={admin: Role.ADMIN, enrollment: Role.RUNNER}, sweep_interval=0.1
    )
    sent: list[str | None] = []

    class SpyTracer(worker.Tracer):  # the real exporter; the spy only notes the token it gets
        def __init__(self, server_url: str, token: str | None = None) -> None:
            sent.append(token)
            super().__init__(server_url, token)

    monkeypatch.setattr(worker, "Tracer", SpyTracer)
    with ServerThread(config) as srv, Client(srv.url, token=admin) as client:
        [ro] = client.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        runner = Runner(traced_agent, srv.url, token=enrollment, max_rollouts=1, tracing=True)
        _run(runner)
        spans, _ = _by_name(client, ro.id)
    assert sent == [runner.client.token] and sent[0] not in (None, enrollment, admin)
    assert {"agentbolt.rollout", "retrieve", "user.instrumented"} <= set(spans)
