"""An attempt's quota on its events URL: how many events, and how many bytes of them, its agent
may post.

Counted on the attempt's row (``agent_events``, ``agent_bytes``) in the transaction that
stores the events, so every server replica sees the same counts (on PostgreSQL the row's lock
orders two posts of one attempt). A post that would go over a limit is refused whole and
counts nothing: :class:`~agentbolt.errors.QuotaExceeded`, 429 for the count, 413 for the
bytes. What the runner uploads (``/api/attempts/{id}/events``) and what the gateway records
are not counted: the quota is on what the agent writes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentbolt.errors import NotFound, QuotaExceeded
from agentbolt.store.database import Tx

__all__ = ["EventQuota", "charge_agent_events"]


@dataclass(frozen=True)
class EventQuota:
    """Limits per attempt on what its agent posts to its events URL; 0 turns one off."""

    events: int = 10_000
    """Events, all posts together."""
    bytes: int = 64 * 1024 * 1024
    """Bytes of events: each event's type and its data as stored (JSON)."""


def charge_agent_events(tx: Tx, attempt_id: str, rows: list[tuple[Any, ...]], quota: EventQuota) -> None:
    """Count ``rows`` ((type, timestamp, data, key) each) against the attempt's quota, or raise
    :class:`QuotaExceeded` (the caller's transaction rolls back, the counts with it)."""
    size = sum(len(r[0]) + len(r[2]) for r in rows)
    row = tx.one(
        "UPDATE attempts SET agent_events = agent_events + ?, agent_bytes = agent_bytes + ? "
        "WHERE id = ? RETURNING agent_events, agent_bytes",
        (len(rows), size, attempt_id),
    )
    if row is None:
        raise NotFound("attempt", attempt_id)
    count, total = row
    if quota.events and count > quota.events:
        raise QuotaExceeded(
            f"quota exceeded: this attempt's agent may post at most {quota.events} events "
            f"(server option quota_events); {count - len(rows)} are stored, this request has "
            f"{len(rows)}. The attempt goes on; nothing of this request was stored",
            429,
        )
    if quota.bytes and total > quota.bytes:
        raise QuotaExceeded(
            f"quota exceeded: this attempt's agent may post at most {quota.bytes} bytes of events "
            f"(server option quota_event_bytes); {total - size} are stored, this request has "
            f"{size}. The attempt goes on; nothing of this request was stored",
            413,
        )
