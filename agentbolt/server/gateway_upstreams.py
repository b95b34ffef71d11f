"""Several model servers behind one ``LLM`` resource: which one serves an attempt, and which are
up (see :mod:`agentbolt.server.gateway` and ``docs/deployment.md``, "Several model servers").

- **One server per attempt.** The servers of a resource are ranked per attempt by rendezvous
  hashing (highest random weight) of the attempt id and each URL; an attempt's calls go to the
  first of its ranking that is up. So attempts spread evenly, every call of an attempt meets
  the prefix cache its earlier calls filled, and every server replica picks the same server
  for an attempt with no state shared between replicas. An attempt moves only while its server
  is down (and back when it is up again); removing a server moves only its own attempts.
- **Health.** A server is marked down when a call cannot connect to it (or failed before its
  request was written) and by a light probe: every ``probe_interval`` seconds each server of a
  resource in use is asked ``GET {url}/models`` (no key; any answer below 500 counts as up) with
  a ``probe_timeout``. A down server is back once a probe gets an answer.
- **Resources with one server** never come here: their calls take the path they always took.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx

__all__ = ["Upstreams", "public_url", "rank_servers"]

log = logging.getLogger("agentbolt.gateway")


def rank_servers(attempt_id: str, urls: Sequence[str]) -> tuple[str, ...]:
    """``urls`` in the order an attempt tries them: by a hash of (attempt id, URL), highest
    first (rendezvous hashing: the same order on every server replica)."""

    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{attempt_id}\0{url.rstrip('/')}".encode(), digest_size=8).digest()

    return tuple(sorted(urls, key=weight, reverse=True))


def public_url(url: str) -> str:
    """``url`` as recorded in events: without user info or query (where a key could hide)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query and not parts.fragment:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class Upstreams:
    """The health of the servers of multi-server resources, as this gateway sees it."""

    probe_interval = 5.0  # seconds between two probes of every watched server
    probe_timeout = 2.0
    forget_after = 600.0  # stop probing (and forget) a server no attempt was given for this long

    def __init__(self, status_of: Callable[[str, float], Awaitable[int]]) -> None:
        """``status_of(url, timeout)``: the status of ``GET url``, through the gateway's
        connections (raises ``httpx.HTTPError`` or ``OSError`` where none came in time)."""
        self._status_of = status_of
        self.down: dict[str, float] = {}  # URL -> since when (monotonic); read on every call
        self._watched: dict[str, float] = {}  # URL -> when an attempt was last given it
        self._task: asyncio.Task[None] | None = None
        self._public: dict[str, str] = {}

    def public(self, url: str) -> str:
        found = self._public.get(url)
        if found is None:
            found = self._public[url] = public_url(url)
        return found

    def watch(self, urls: Iterable[str]) -> None:
        """Probe these servers from now on (the servers of an attempt's resource)."""
        now = time.monotonic()
        for url in urls:
            self._watched[url] = now
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: the next watch starts it
                self._task = asyncio.get_running_loop().create_task(self._probe_loop())

    def pick(self, ranked: Sequence[str]) -> str:
        """The first server of an attempt's ranking that is up (the first of all when none is)."""
        down = self.down
        if down:
            for url in ranked:
                if url not in down:
                    return url
        return ranked[0]

    def mark_down(self, url: str, why: str) -> None:
        if url not in self.down:
            log.warning("model server %s is down (%s): its attempts go to the others", self.public(url), why)
            self.down[url] = time.monotonic()
        self._watched.setdefault(url, time.monotonic())

    def mark_up(self, url: str) -> None:
        if self.down.pop(url, None) is not None:
            log.warning("model server %s answers again: back in rotation", self.public(url))

    async def probe(self, url: str) -> bool:
        """Whether the server answers ``GET {url}/models`` (any status below 500) in time."""
        try:
            return await self._status_of(f"{url.rstrip('/')}/models", self.probe_timeout) < 500
        except (httpx.HTTPError, OSError):
            return False

    async def probe_all(self) -> None:
        """Probe every watched server once; mark each up or down by its answer."""
        now = time.monotonic()
        for url, seen in list(self._watched.items()):
            if now - seen > self.forget_after:  # no longer in use: known again only from calls
                del self._watched[url]
                self.down.pop(url, None)
        urls = list(self._watched)
        for url, ok in zip(urls, await asyncio.gather(*(self.probe(u) for u in urls)), strict=True):
            if ok:
                self.mark_up(url)
            else:
                self.mark_down(url, "no answer to a probe")

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.probe_all()
            except Exception:  # never let one bad probe end the loop
                log.exception("probing the model servers failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
            self._task = None
