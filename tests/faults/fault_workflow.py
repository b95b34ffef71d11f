"""The work each fault test does: every mutating endpoint called as the algorithms, a runner, an
agent's model client and its span exporter call it, through the clients the faults sit under.

In order: publish resources (an ``LLM`` on the model double), enqueue three rollouts in two
calls (ids left to the client, then one given), claim each (dequeue), heartbeat, post a batch of
numbered events (as the runner does), post events to the attempt's events URL as a program
agent does (unnumbered, with an ``Idempotency-Key`` its retries repeat), export two spans over
OTLP, make one chat call through the gateway with the ``openai`` SDK, finish two attempts,
enqueue one more rollout, cancel the running third and the queued fourth, and publish again.
Each acknowledged answer goes into the :class:`Ledger`.

The chat call sends no key, as the SDK does, so a retry is known by its
``x-stainless-retry-count``; except under ``duplicate``: a request delivered twice is the same
try twice, which without a key cannot be told from an agent asking the same thing twice (two
calls, by design), so there the agent gives each call a key.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from fault_audit import Ledger
from fault_injection import AsyncDropTransport, DropTransport, FaultProxy, Plan
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentbolt.client import AsyncClient, Client
from agentbolt.schemas import (
    LLM,
    AttemptStatus,
    Claim,
    EventCreate,
    PromptTemplate,
    Resource,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.server.otlp import ATTEMPT_ATTR, ROLLOUT_ATTR

__all__ = ["CALLS", "Wiring", "run_workflow"]

WORKER = "faults-worker"
# Logical calls the workflow makes to each endpoint: each one's first delivery gets the fault.
CALLS = {
    "publish": 2,
    "enqueue": 3,
    "dequeue": 3,
    "heartbeat": 3,
    "events": 3,
    "agent_events": 3,
    "otlp": 3,
    "gateway": 3,
    "finish": 2,
    "cancel": 2,
}
EXPORT_TRIES = 3  # tries of a caller that retries by itself (OTLP export, a program's events)


@dataclass
class Wiring:
    """Where each client sends its requests: agentbolt's clients and the program's through a
    dropping transport straight to the server (``drop``), or through the proxy (every other
    fault); the openai SDK and the OTLP exporter bring their own HTTP stacks, so they always go
    through the proxy."""

    server_url: str
    proxy: FaultProxy
    plan: Plan
    timeout: float
    upstream_port: int

    def client(self) -> Client:
        if self.plan.kind == "drop":
            return Client(self.server_url, timeout=self.timeout, transport=DropTransport(self.plan))
        return Client(self.proxy.url, timeout=self.timeout)

    def runner_client(self) -> AsyncClient:
        if self.plan.kind == "drop":
            return AsyncClient(self.server_url, timeout=self.timeout, transport=AsyncDropTransport(self.plan))
        return AsyncClient(self.proxy.url, timeout=self.timeout)

    def program_client(self) -> httpx.Client:
        """A program agent's HTTP client (it retries by itself: :func:`_agent_events`)."""
        if self.plan.kind == "drop":
            return httpx.Client(
                base_url=self.server_url, timeout=self.timeout, transport=DropTransport(self.plan)
            )
        return httpx.Client(base_url=self.proxy.url, timeout=self.timeout)

    def model_client(self, claim: Claim) -> openai.OpenAI:
        base_url = f"{self.proxy.url}/gateway/{claim.rollout.id}/{claim.attempt.id}/v1"
        return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=2, timeout=self.timeout)

    def exporter(self) -> OTLPSpanExporter:
        return OTLPSpanExporter(endpoint=f"{self.proxy.url}/v1/traces", timeout=self.timeout)


async def run_workflow(wiring: Wiring, ledger: Ledger) -> None:
    ledger.worker_id = WORKER
    llm = LLM(base_url=f"http://127.0.0.1:{wiring.upstream_port}/v1", model="double")
    exporter = wiring.exporter()
    runner = wiring.runner_client()
    try:
        with wiring.client() as client, wiring.program_client() as program:
            _publish(client, ledger, "first", {"llm": llm})
            _enqueue(client, ledger, [_item(0), _item(1)])
            _enqueue(client, ledger, [_item(2, rollout_id="ro-given-2")])
            claims = [await _claim(runner, ledger) for _ in range(3)]
            for claim in claims:
                await _heartbeat(runner, ledger, claim)
                await _events(runner, ledger, claim)
                _agent_events(program, ledger, claim)
                _export(exporter, ledger, claim)
                _chat(wiring, ledger, claim)
            for n, claim in enumerate(claims[:2]):
                await _finish(runner, ledger, claim, reward=0.25 + n)
            queued = _enqueue(client, ledger, [_item(3)])
            for rollout_id in (claims[2].rollout.id, queued[0]):
                _cancel(client, ledger, rollout_id)
            _publish(client, ledger, "second", {"prompt": PromptTemplate(template="say {x}")})
    finally:
        await runner.aclose()
        exporter.shutdown()


def _item(n: int, rollout_id: str | None = None) -> RolloutCreate:
    return RolloutCreate(id=rollout_id, task=Task(data={"item": f"item-{n}"}))


def _publish(client: Client, ledger: Ledger, marker: str, resources: dict[str, Resource]) -> None:
    version = client.publish_resources(resources, metadata={"marker": marker}).version
    ledger.published[marker] = version


def _enqueue(client: Client, ledger: Ledger, items: list[RolloutCreate]) -> list[str]:
    ledger.items += len(items)
    rollouts = client.enqueue(items)
    assert len(rollouts) == len(items), rollouts
    for r in rollouts:
        ledger.rollouts[r.id] = r.task.data["item"]
    return [r.id for r in rollouts]


async def _claim(runner: AsyncClient, ledger: Ledger) -> Claim:
    claim = await runner.dequeue(WORKER)
    assert claim is not None, "the queue holds a rollout, yet dequeue found none"
    ledger.claims[claim.attempt.id] = claim.rollout.id
    return claim


async def _heartbeat(runner: AsyncClient, ledger: Ledger, claim: Claim) -> None:
    attempt = await runner.heartbeat(claim.attempt.id, WORKER)
    ledger.heartbeats[attempt.id] = attempt.heartbeat_at


async def _events(runner: AsyncClient, ledger: Ledger, claim: Claim) -> None:
    batch = [EventCreate(sequence=i, type="message", data={"marker": f"seq-{i}"}) for i in range(3)]
    await runner.add_events(claim.attempt.id, batch, WORKER)
    ledger.events[claim.attempt.id] += [e.data["marker"] for e in batch]


def _agent_events(program: httpx.Client, ledger: Ledger, claim: Claim) -> None:
    """Post to the events URL as a program agent would: one key, sent again by each retry."""
    events: list[dict[str, Any]] = [{"type": "tool_call", "data": {"marker": f"agent-{i}"}} for i in range(2)]
    events.append({"reward": 0.5, "name": "agent"})  # the reward shorthand: data carries no marker
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    url = f"/agent/{claim.rollout.id}/{claim.attempt.id}/events"
    for _ in range(EXPORT_TRIES):
        try:
            answer = program.post(url, json=events, headers=headers)
        except httpx.TransportError:
            continue
        answer.raise_for_status()
        ledger.events[claim.attempt.id] += ["agent-0", "agent-1"]
        return
    raise AssertionError(f"the events URL failed {EXPORT_TRIES} times")


def _spans(claim: Claim) -> list[ReadableSpan]:
    """Two finished spans of the claimed attempt, made by the OpenTelemetry SDK."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("faults")
    route = {ATTEMPT_ATTR: claim.attempt.id, ROLLOUT_ATTR: claim.rollout.id}
    for step in range(2):
        with tracer.start_as_current_span(f"step-{step}", attributes=route):
            pass
    spans = list(memory.get_finished_spans())
    provider.shutdown()
    return spans


def _export(exporter: OTLPSpanExporter, ledger: Ledger, claim: Claim) -> None:
    spans = _spans(claim)
    for _ in range(EXPORT_TRIES):
        if exporter.export(spans) is SpanExportResult.SUCCESS:
            ids = [(f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for s in spans]
            ledger.spans[claim.attempt.id] += ids
            return
    raise AssertionError(f"the OTLP export failed {EXPORT_TRIES} times")


def _chat(wiring: Wiring, ledger: Ledger, claim: Claim) -> None:
    prompt = f"hello from {claim.attempt.id}"
    keyed = {"Idempotency-Key": uuid.uuid4().hex} if wiring.plan.kind == "duplicate" else None
    with wiring.model_client(claim) as llm:
        answer = llm.chat.completions.create(
            model="double", messages=[{"role": "user", "content": prompt}], extra_headers=keyed
        )
    assert answer.choices[0].message.content == f"echo: {prompt}"
    ledger.prompts[claim.attempt.id].append(prompt)


async def _finish(runner: AsyncClient, ledger: Ledger, claim: Claim, reward: float) -> None:
    rollout = await runner.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, reward=reward, worker_id=WORKER)
    assert rollout.status is RolloutStatus.SUCCEEDED and rollout.reward == reward, rollout
    ledger.finished[rollout.id] = reward


def _cancel(client: Client, ledger: Ledger, rollout_id: str) -> None:
    rollout = client.cancel(rollout_id)
    assert rollout.status is RolloutStatus.CANCELLED, rollout
    ledger.cancelled.append(rollout_id)
