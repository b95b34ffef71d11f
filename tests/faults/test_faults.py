"""Nothing lost, nothing doubled: each mutating endpoint under each fault, on SQLite and PostgreSQL.

A test runs the whole workflow (:mod:`fault_workflow`) against a real server on 127.0.0.1 with
a fresh store; the first delivery of every logical call to one endpoint gets one fault
(:mod:`fault_injection`): its answer dropped after the server committed, the request delayed
past the client's timeout (and delivered after the retry), the answer reset mid-body, or the
request delivered twice at once. The clients retry as they do (agentbolt's clients with their
idempotency keys, the openai SDK on its own, the OTLP exporter once and then its caller).
Afterwards the database (:mod:`fault_audit`) must hold no duplicate rollout, attempt, event or
resources version, every write the clients saw acknowledged, and every rollout ended once.

``pytest -s`` (or the summary at the end) prints the figures per fault and backend.
"""

from __future__ import annotations

import asyncio

import pytest
from fault_audit import Figures, Ledger, audit
from fault_injection import FAULTS, FaultProxy, Plan
from fault_workflow import CALLS, Wiring, run_workflow

from agentbolt.server import ServerConfig, ServerThread

TIMEOUT = 10.0
# ``delay``: clients time out after DELAY_TIMEOUT seconds; the held request reaches the server
# DELAY seconds after it came, once the retry (at most 0.5 s of backoff later) is in.
DELAY_TIMEOUT, DELAY = 0.75, 1.35


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("endpoint", list(CALLS))
def test_fault(endpoint: str, kind: str, store_url: str, upstream_port: int, figures: list[Figures]) -> None:
    plan = Plan(endpoint, kind)
    config = ServerConfig(db=store_url, lease_seconds=60.0, upstream_timeout=5.0)
    ledger = Ledger()
    error: Exception | None = None
    with ServerThread(config) as server, FaultProxy(server.config.port, plan, delay=DELAY) as proxy:
        timeout = DELAY_TIMEOUT if kind == "delay" else TIMEOUT
        wiring = Wiring(server.url, proxy, plan, timeout, upstream_port)
        try:
            asyncio.run(run_workflow(wiring, ledger))
        except Exception as exc:  # audited all the same, then reported with what the audit found
            error = exc
        proxy.settle()
    findings = audit(store_url, ledger)
    backend = "postgres" if store_url.startswith("postgresql://") else "sqlite"
    figures.append(
        Figures(
            backend,
            endpoint,
            kind,
            plan.injected,
            findings.rollouts,
            len(findings.lost),
            len(findings.duplicated),
        )
    )
    assert error is None and findings.problems == [], f"workflow error: {error!r}; audit: {findings.problems}"
    assert plan.injected == CALLS[endpoint], f"{plan.injected} faults for {CALLS[endpoint]} calls"
    if kind in ("delay", "duplicate"):  # the proxy delivered each faulted request once more
        assert len(proxy.extra) == CALLS[endpoint], proxy.extra
    crashed = [x for x in proxy.extra if not isinstance(x, int) or x >= 500]
    assert crashed == [], f"extra deliveries met: {crashed}"
