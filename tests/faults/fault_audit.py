"""The audit after a faulty run, read straight from the database (SQLite or PostgreSQL), never
through the server under test: nothing duplicated, nothing the clients saw acknowledged missing,
and every rollout ended exactly once.

A :class:`Ledger` holds what the workflow asked for and what its clients saw acknowledged; each
item it sends carries a marker (in the task data, event data, prompt or resources metadata), so
the audit can tell a stored duplicate from a stored original.
"""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["Figures", "Findings", "Ledger", "audit", "figures_table"]


@dataclass
class Ledger:
    """What the workflow's clients saw acknowledged (each entry: a write the server answered)."""

    items: int = 0
    """Rollouts asked for (each enqueued item once, however often its call was retried)."""
    rollouts: dict[str, str] = field(default_factory=dict)
    """Acknowledged rollout id -> its item marker."""
    claims: dict[str, str] = field(default_factory=dict)
    """Acknowledged attempt id -> its rollout id."""
    worker_id: str = ""
    heartbeats: dict[str, float] = field(default_factory=dict)
    """Attempt id -> the heartbeat time its last acknowledged heartbeat returned."""
    events: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Attempt id -> markers of the events acknowledged."""
    spans: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    """Attempt id -> (trace id, span id) of the spans the exporter saw accepted."""
    prompts: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Attempt id -> the prompts the gateway answered."""
    finished: dict[str, float] = field(default_factory=dict)
    """Rollout id -> the reward of its acknowledged successful finish."""
    cancelled: list[str] = field(default_factory=list)
    published: dict[str, int] = field(default_factory=dict)
    """Resources marker -> the version acknowledged."""


@dataclass
class Findings:
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unended: list[str] = field(default_factory=list)
    rollouts: int = 0

    @property
    def problems(self) -> list[str]:
        return (
            [f"lost: {x}" for x in self.lost] + [f"duplicated: {x}" for x in self.duplicated] + self.unended
        )


@dataclass(frozen=True)
class Figures:
    backend: str
    endpoint: str
    kind: str
    injected: int
    rollouts: int
    lost: int
    duplicated: int


def _query(db: str, sql: str) -> list[tuple[Any, ...]]:
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db) as conn:
            return conn.execute(sql).fetchall()
    lite = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return lite.execute(sql).fetchall()
    finally:
        lite.close()


@dataclass
class _Stored:
    rollouts: dict[str, dict[str, Any]]
    attempts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    resources: dict[int, dict[str, Any]]


def _read(db: str) -> _Stored:
    rollouts = {
        rid: {"status": status, "reward": reward, "ended_at": ended, "item": orjson.loads(data).get("item")}
        for rid, status, reward, ended, data in _query(
            db,
            "SELECT r.id, r.status, r.reward, r.ended_at, t.data FROM rollouts r JOIN tasks t ON t.id = r.task_id",
        )
    }
    keys = ("id", "rollout_id", "worker_id", "status", "heartbeat_at")
    attempts = [
        dict(zip(keys, row, strict=True))
        for row in _query(db, "SELECT id, rollout_id, worker_id, status, heartbeat_at FROM attempts")
    ]
    events = [
        {"attempt_id": aid, "sequence": seq, "type": kind, "data": orjson.loads(data)}
        for aid, seq, kind, data in _query(db, "SELECT attempt_id, sequence, type, data FROM events")
    ]
    resources = {v: orjson.loads(meta) for v, meta in _query(db, "SELECT version, metadata FROM resources")}
    return _Stored(rollouts, attempts, events, resources)


def _extra(counts: Counter[Any], what: str) -> list[str]:
    """One line per copy beyond the first."""
    return [f"{what} {key!r} (copy {n + 2})" for key, count in counts.items() for n in range(count - 1)]


def audit(db: str, ledger: Ledger) -> Findings:
    stored = _read(db)
    out = Findings(rollouts=len(stored.rollouts))
    _check_rollouts(stored, ledger, out)
    _check_attempts(stored, ledger, out)
    _check_events(stored, ledger, out)
    _check_resources(stored, ledger, out)
    return out


def _check_rollouts(stored: _Stored, ledger: Ledger, out: Findings) -> None:
    out.duplicated += _extra(Counter(r["item"] for r in stored.rollouts.values()), "rollout of item")
    if len(stored.rollouts) > ledger.items:
        out.duplicated.append(f"{len(stored.rollouts)} rollouts stored for {ledger.items} items")
    out.lost += [f"rollout {rid}" for rid in ledger.rollouts if rid not in stored.rollouts]
    for rid, reward in ledger.finished.items():
        r = stored.rollouts.get(rid)
        if r is not None and (r["status"] != "succeeded" or r["reward"] != reward):
            out.lost.append(f"finish of {rid} (stored: {r['status']}, reward {r['reward']})")
    for rid in ledger.cancelled:
        r = stored.rollouts.get(rid)
        if r is not None and r["status"] != "cancelled":
            out.lost.append(f"cancel of {rid} (stored: {r['status']})")
    for rid, r in stored.rollouts.items():
        if r["status"] not in ("succeeded", "failed", "cancelled") or r["ended_at"] is None:
            out.unended.append(f"rollout {rid} did not end: {r['status']}")


def _check_attempts(stored: _Stored, ledger: Ledger, out: Findings) -> None:
    by_id = {a["id"]: a for a in stored.attempts}
    out.duplicated += [
        f"attempt {a['id']} of {a['rollout_id']}, a claim no client saw"
        for a in stored.attempts
        if a["id"] not in ledger.claims
    ]
    out.duplicated += _extra(Counter(ledger.claims.values()), "claim handed out again for rollout")
    for aid, rid in ledger.claims.items():
        a = by_id.get(aid)
        if a is None or a["rollout_id"] != rid or a["worker_id"] != ledger.worker_id:
            out.lost.append(f"claim {aid} of {rid} (stored: {a})")
    for aid, beat in ledger.heartbeats.items():
        if aid in by_id and by_id[aid]["heartbeat_at"] < beat - 1e-6:
            out.lost.append(f"heartbeat of {aid} at {beat} (stored: {by_id[aid]['heartbeat_at']})")
    for rid, r in stored.rollouts.items():
        ended = [a["status"] for a in stored.attempts if a["rollout_id"] == rid]
        if r["status"] == "succeeded" and ended != ["succeeded"]:
            out.unended.append(f"rollout {rid} succeeded with attempts {ended}")
        if r["status"] != "succeeded" and "succeeded" in ended:
            out.unended.append(f"rollout {rid} is {r['status']} but has a succeeded attempt")


def _check_events(stored: _Stored, ledger: Ledger, out: Findings) -> None:
    events = stored.events
    seqs = Counter((e["attempt_id"], e["sequence"]) for e in events if e["sequence"] is not None)
    out.duplicated += _extra(seqs, "event (attempt, sequence)")
    markers = Counter((e["attempt_id"], e["data"].get("marker")) for e in events if "marker" in e["data"])
    out.duplicated += _extra(markers, "event")
    spans = Counter(
        (e["attempt_id"], e["data"].get("trace_id"), e["data"].get("span_id"))
        for e in events
        if e["type"] == "span"
    )
    out.duplicated += _extra(spans, "span")
    calls = Counter((e["attempt_id"], _prompt(e["data"])) for e in events if e["type"] == "llm_call")
    out.duplicated += _extra(calls, "llm_call")
    for aid, sent in ledger.events.items():
        out.lost += [f"event {m} of {aid}" for m in sent if markers[(aid, m)] == 0]
    for aid, sent_spans in ledger.spans.items():
        out.lost += [f"span {s} of {aid}" for s in sent_spans if spans[(aid, *s)] == 0]
    for aid, prompts in ledger.prompts.items():
        out.lost += [f"llm_call {p!r} of {aid}" for p in prompts if calls[(aid, p)] == 0]


def _prompt(data: dict[str, Any]) -> str | None:
    messages = (data.get("request") or {}).get("messages") or [{}]
    return messages[-1].get("content")


def _check_resources(stored: _Stored, ledger: Ledger, out: Findings) -> None:
    out.duplicated += _extra(Counter(m.get("marker") for m in stored.resources.values()), "resources version")
    for marker, version in ledger.published.items():
        meta = stored.resources.get(version)
        if meta is None or meta.get("marker") != marker:
            out.lost.append(f"resources {marker} as version {version} (stored: {meta})")


def figures_table(figures: list[Figures]) -> list[str]:
    """Per fault kind and backend: faults injected, rollouts, lost, duplicated."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for f in figures:
        row = totals[(f.kind, f.backend)]
        for i, n in enumerate((1, f.injected, f.rollouts, f.lost, f.duplicated)):
            row[i] += n
    lines = [f"{'fault':<10} {'backend':<9} {'runs':>5} {'faults':>7} {'rollouts':>9} {'lost':>5} {'dup':>5}"]
    for (kind, backend), (runs, injected, rollouts, lost, dup) in sorted(totals.items()):
        lines.append(f"{kind:<10} {backend:<9} {runs:>5} {injected:>7} {rollouts:>9} {lost:>5} {dup:>5}")
    bad = [f for f in figures if f.lost or f.duplicated]
    lines += [f"  {f.endpoint}/{f.kind}/{f.backend}: lost {f.lost}, duplicated {f.duplicated}" for f in bad]
    return lines
