"""How the server's routes reach the store, and what they never hand out.

- :class:`StoreCaller` runs the synchronous store's methods without blocking the event loop.
- :class:`WakeUp` wakes long-polling requests when this process changed the queue.
- :func:`redact` takes LLM API keys out of resources before any answer carries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from agentbolt.schemas import LLM, Resources
from agentbolt.store import SqlStore

__all__ = ["REDACTED", "StoreCaller", "WakeUp", "redact"]

R = TypeVar("R")
REDACTED = "<redacted>"


def redact(res: Resources | None) -> Resources | None:
    """LLM API keys are for the gateway's upstream calls only: the API never serves them."""
    if res is None or not any(isinstance(r, LLM) and r.api_key for r in res.resources.values()):
        return res
    clean = {
        k: r.model_copy(update={"api_key": REDACTED}) if isinstance(r, LLM) and r.api_key else r
        for k, r in res.resources.items()
    }
    return res.model_copy(update={"resources": clean})


class StoreCaller:
    """Calls the synchronous store: inline for SQLite (sub-millisecond, one connection), in a
    worker thread for PostgreSQL (network round trips must not block the event loop)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        # as many threads as the store has connections: more would only queue on the pool
        # (and a plain executor costs half of anyio's worker threads per call)
        inline = store.backend == "sqlite"
        self.threads = None if inline else ThreadPoolExecutor(store.db.connections, "agentbolt-store")

    async def __call__(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        if self.threads is None:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, functools.partial(fn, *args, **kwargs)
        )

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=True)


class WakeUp:
    """Wakes long-polling requests when this process changed the queue (an enqueue, a finish,
    an expiry). Other replicas' changes are seen by the waiters' fallback polling."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
