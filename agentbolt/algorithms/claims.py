"""How often a program's own claim and the reward it was given disagree.

A program whose reward comes from the user's scorer may still post or write a grade of its own;
the runner records it as a ``reward_claim`` event (:mod:`agentbolt.runner.program_reward`) and
no algorithm trains on it. Only the runner's records count (an agent key may not post this type,
and an older store's rows of unknown source are left out), so a program cannot skew the count. Counted over a batch, claims that disagree with the reward are a
reward-hacking signal: a policy that learned to claim success it does not earn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agentbolt.adapters import latest_attempt
from agentbolt.schemas import Event, EventSource, EventType, Rollout, RolloutStatus

if TYPE_CHECKING:
    from agentbolt.client import Client

__all__ = ["CLAIM_EVENTS", "claim_counts", "fetch_claim_counts"]

CLAIM_EVENTS = [EventType.REWARD_CLAIM.value]
"""The event types to read for :func:`claim_counts`."""


def claim_counts(events_of: Mapping[str, Sequence[Event]]) -> dict[str, int]:
    """``claims``: rollouts whose finishing attempt holds a claim; ``claims_disputed``: those of
    them with a claim that disagrees with the reward given."""
    claimed = disputed = 0
    for events in events_of.values():
        claims = [
            e
            for e in latest_attempt(events)
            if e.type == EventType.REWARD_CLAIM and e.source == EventSource.RUNNER
        ]
        claimed += bool(claims)
        disputed += any(e.data.get("disputed") is True for e in claims)
    return {"claims": claimed, "claims_disputed": disputed}


def fetch_claim_counts(client: Client, rollouts: Sequence[Rollout]) -> dict[str, int]:
    """:func:`claim_counts` over the succeeded ``rollouts``, their claims read from the server."""
    ids = [r.id for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
    return claim_counts(client.events_of(ids, type=CLAIM_EVENTS) if ids else {})
