"""How the server's routes reach the store, and what they never hand out.

- :class:`StoreCaller` runs the synchronous store's methods without blocking the event loop.
- :class:`WakeUp` wakes long-polling requests when this process changed the queue.
- :func:`redact` takes LLM API keys out of resources before any answer carries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
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
    worker thread for PostgreSQL (network round trips must not block the event loop).

    On SQLite the calls made in one turn of the event loop share one commit (group commit):
    the first opens a transaction, each runs in a savepoint of it (rolled back alone on
    error), and at the end of the turn one COMMIT writes them all; only then does any of them
    return or raise. Durability is the same as one commit per call (no answer before its
    commit), for fewer commits and WAL pages written."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        # as many threads as the store has connections: more would only queue on the pool
        # (and a plain executor costs half of anyio's worker threads per call)
        inline = store.backend == "sqlite"
        self.threads = None if inline else ThreadPoolExecutor(store.db.connections, "agentbolt-store")
        self._grouped = inline and hasattr(store.db, "open_group")
        self._last: tuple[int, _Group] | None = None  # the thread and group of the last call

    async def __call__(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        if self.threads is None:
            if not self._grouped:
                return fn(*args, **kwargs)
            last, thread = self._last, threading.get_ident()
            if last is None or last[0] != thread:  # the group is looked up once per thread change
                last = self._last = (thread, _group(self.store.db))
            return await last[1].call(fn, args, kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            self.threads, functools.partial(fn, *args, **kwargs)
        )

    async def read(self, fn: Callable[..., R], *args: Any) -> R:
        """A call that only reads: as :meth:`__call__`, except that on SQLite with no group
        open in this event-loop turn it is answered at once (it can only see committed rows:
        there is nothing to wait for), with no transaction of its own. With a group open it
        joins it: it may see the group's writes, so it answers after their commit."""
        if self._grouped and self.threads is None:
            last = self._last
            if last is not None and last[0] == threading.get_ident() and last[1].waiting is None:
                return fn(*args)
        return await self(fn, *args)

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=True)


# one group per database and thread: apps sharing a store in one event loop share its group
_GROUPS: weakref.WeakKeyDictionary[Any, dict[int, _Group]] = weakref.WeakKeyDictionary()


def _group(db: Any) -> _Group:
    groups = _GROUPS.get(db)
    if groups is None:
        groups = _GROUPS[db] = {}
    thread = threading.get_ident()
    group = groups.get(thread)
    if group is None:
        group = groups[thread] = _Group(db)
    return group


class _Group:
    """The calls of one event-loop turn, committed together (see :class:`StoreCaller`)."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.waiting: list[tuple[asyncio.Future[Any], bool, Any]] | None = None  # None: no group open

    async def call(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        loop = asyncio.get_running_loop()
        if self.waiting is None:
            self.db.open_group()
            self.waiting = []
            loop.call_soon(self._commit)
        future: asyncio.Future[R] = loop.create_future()
        try:
            result: Any = fn(*args, **kwargs)
        except Exception as exc:  # answered after the commit too: it may rest on the group's writes
            self.waiting.append((future, False, exc))
        else:
            self.waiting.append((future, True, result))
        return await future

    def _commit(self) -> None:
        waiting, self.waiting = self.waiting or [], None
        try:
            self.db.commit_group()
        except Exception as exc:
            for future, _, _ in waiting:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, ok, value in waiting:
            if future.done():  # its caller went away
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


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
