"""How the clients (:mod:`agentbolt.client`) retry a call: connection errors and 5xx answers
with exponential backoff and full jitter, a call still failing logged (a warning at its third
failure, then at every twentieth), so a client that rides out an outage says so.

An outage (no connection, 502, 503, 504) is retried up to ``RetryPolicy.attempts`` times
(forever for the runner); a 500 answer, the server failing on this very request, which sending
it again usually meets again, at most ``RetryPolicy.server_errors`` times, so that one request
the server cannot handle ends in an error its caller handles (the runner fails that attempt
with the reason: :class:`~agentbolt.errors.ServerFailed`) rather than a slot retrying it
forever. 4xx answers are never retried: they
raise the error the server names (:func:`agentbolt.client_api.raise_for`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import httpx

from agentbolt.client_api import ApiRequest, ServerError
from agentbolt.errors import ServerFailed, ServerUnavailable

__all__ = ["Retries", "RetryPolicy", "retryable"]

log = logging.getLogger("agentbolt.client")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    """Tries per call; ``0`` retries forever (the runner uses that while the server is down)."""
    base_delay: float = 0.2
    max_delay: float = 10.0
    server_errors: int = 5
    """Tries per call answered HTTP 500, even when ``attempts`` is 0: the server failed on this
    request, and a fault of its own is not an outage to wait out."""

    def delay(self, attempt: int) -> float:
        # the exponent capped: 2.0**1024 overflows, which a runner retrying forever would reach
        return random.uniform(0, min(self.max_delay, self.base_delay * 2.0 ** min(attempt, 64)))

    def gives_up(self, attempt: int, server_errors: int = 0) -> bool:
        """After the call's ``attempt + 1``-th failure, ``server_errors`` of them HTTP 500."""
        if server_errors >= max(self.server_errors, 1):
            return True
        return self.attempts > 0 and attempt + 1 >= self.attempts


class Retries:
    """One call's failures so far: decides whether to try again, and says when it keeps failing."""

    __slots__ = ("call", "failures", "policy", "server_errors", "url")

    def __init__(self, policy: RetryPolicy, url: str, call: ApiRequest[Any]) -> None:
        self.policy, self.url, self.call = policy, url, call
        self.failures = self.server_errors = 0

    def delay_after(self, exc: Exception) -> float:
        """The wait before the next try; raises ``exc`` (not retryable) or
        :class:`ServerUnavailable` (given up)."""
        if not retryable(exc):
            raise exc
        if isinstance(exc, ServerError) and exc.status == 500:
            self.server_errors += 1
        policy, call = self.policy, self.call
        self.failures += 1
        if policy.gives_up(self.failures - 1, self.server_errors):
            failed = f"{call.method} {self.url}{call.path} failed after {self.failures} tries: {exc}"
            if self.server_errors >= max(policy.server_errors, 1):  # the server fails on this request
                raise ServerFailed(failed) from exc
            raise ServerUnavailable(failed) from exc
        if self.failures == 3 or self.failures % 20 == 0:
            log.warning(
                "%s %s%s has failed %d times (%s); trying again",
                call.method,
                self.url,
                call.path,
                self.failures,
                exc,
            )
        return policy.delay(self.failures - 1)


def retryable(exc: Exception) -> bool:
    return isinstance(exc, httpx.TransportError) or (isinstance(exc, ServerError) and exc.status >= 500)
