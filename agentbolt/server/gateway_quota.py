"""The gateway's quota of model calls per attempt, and its refusal of a reused key.

Calls are counted in memory, per server replica, for the attempts it served lately (the
newest 10,000): a try the gateway forwards counts, whatever its answer; one it refuses
(attempt ended, quota reached, bad request) does not. Behind several replicas an attempt
may make up to the limit on each replica it reaches, and a restart counts from 0: a bound
on a runaway agent, not an exact count (``docs/deployment.md``). Counting in the store would
cost a write on every call, the gateway's hot path.
"""

from __future__ import annotations

from collections import OrderedDict

from agentbolt.errors import IdempotencyKeyReused, QuotaExceeded
from agentbolt.server.gateway_call import Refused

__all__ = ["CallQuota", "key_reused"]

_KEPT = 10_000  # attempts whose counts a replica keeps


class CallQuota:
    """Model calls per attempt on this replica; ``limit`` 0 counts nothing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: OrderedDict[str, int] = OrderedDict()

    def take(self, attempt_id: str) -> None:
        """Count one call of the attempt, or raise :class:`Refused` (429) when it made its
        ``limit`` already."""
        if not self.limit:
            return
        counts = self._counts
        made = counts.get(attempt_id, 0)
        if made >= self.limit:
            raise Refused(
                429,
                f"quota exceeded: an attempt may make at most {self.limit} model calls through the "
                "gateway (server option quota_calls); this call was not forwarded",
                QuotaExceeded.__name__,
                final=True,
            )
        counts[attempt_id] = made + 1
        counts.move_to_end(attempt_id)
        while len(counts) > _KEPT:
            counts.popitem(last=False)


def key_reused(key: str) -> Refused:
    """The 422 of a call whose ``Idempotency-Key`` an earlier call of the attempt was sent with
    another body (never forwarded, never joined to that call's record)."""
    return Refused(
        422,
        f"Idempotency-Key {key!r} was first sent with another body: a key names one call, and "
        "its retries send the same body; make a new key for a new call",
        IdempotencyKeyReused.__name__,
        param="Idempotency-Key",
    )
