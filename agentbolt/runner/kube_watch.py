"""Following the launcher's Jobs and pods with the Kubernetes client's watch, not a poll.

A :class:`Follower` is one thread (the client is blocking; the launcher's event loop is not)
that streams the changes of one kind of object (``jobs`` or ``pods``, by the launcher's label)
from a resourceVersion, and hands each to the launcher's loop:

* it starts from the version of the launcher's own first list (nothing is missed between the
  list and the watch);
* a stream the API server ends (``timeoutSeconds``) or that drops (a connection reset, a proxy
  timing out) is resumed from the last resourceVersion seen, events and bookmarks both;
* ``410 Gone`` (the version is older than what the API server keeps) lists the objects again,
  for a fresh version, and hands the whole list over (``SYNC``) before watching on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agentbolt.runner import kube_state
from agentbolt.runner.kube_api import KubeApi, KubeError

__all__ = ["Deliver", "Follower", "Watched"]

log = logging.getLogger("agentbolt.kubernetes")

Deliver = Callable[[str, str, Any], None]
"""``deliver(kind, type, payload)``: an event (``ADDED``, ``MODIFIED``, ``DELETED`` and the
object), or ``SYNC`` and ``(items, listed)`` after a list (``listed``: monotonic time before it)."""


class Follower(threading.Thread):
    """Watch ``kind`` objects matching ``selector`` from ``version`` until :meth:`stop`."""

    def __init__(
        self,
        api: KubeApi,
        kind: str,
        selector: str,
        version: str,
        deliver: Deliver,
        *,
        timeout: int = 300,
        retry: float = 1.0,
    ) -> None:
        super().__init__(name=f"agentbolt-watch-{kind}", daemon=True)
        from kubernetes import watch

        self.api, self.kind, self.selector, self.version = api, kind, selector, version
        self.deliver, self.timeout, self.retry = deliver, timeout, retry
        self.watcher = watch.Watch()
        self.stopped = threading.Event()
        self.streams = self.resumed = self.relisted = 0

    def stop(self) -> None:
        """End the watch now (the client's stop also shuts the stream's socket)."""
        self.stopped.set()
        self.watcher.stop()

    def run(self) -> None:
        while not self.stopped.is_set():
            if not self.version and not self._relist():
                self.stopped.wait(self.retry)
                continue
            try:
                self._stream()
            except KubeError as exc:
                if self.stopped.is_set():
                    return
                if exc.status == 410:  # compacted: only a fresh list gives a version to watch from
                    log.info("watch of %s: %s; listing them again", self.kind, exc)
                    self.version = ""
                    continue
                log.warning(
                    "watch of %s dropped (%s); resuming from resourceVersion %s",
                    *(self.kind, exc, self.version),
                )
                self.resumed += 1
                self.stopped.wait(self.retry)
            except Exception:  # never let the thread die silently: log and go on from the version
                if self.stopped.is_set():
                    return
                log.exception("watch of %s failed; resuming from resourceVersion %s", self.kind, self.version)
                self.stopped.wait(self.retry)

    def _stream(self) -> None:
        self.streams += 1
        events = self.api.watch(self.kind, self.selector, self.version, self.timeout, self.watcher)
        for kind, obj in events:
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.version = str(version)
            if self.stopped.is_set():
                return
            if kind != "BOOKMARK":
                self.deliver(self.kind, kind, obj)

    def _relist(self) -> bool:
        listed = time.monotonic()
        try:
            items, self.version = self.api.listing(self.kind, self.selector)
        except KubeError as exc:
            log.warning("listing %s to watch them again: %s; trying again", self.kind, exc)
            return False
        self.relisted += 1
        self.deliver(self.kind, "SYNC", (items, listed))
        return True


class Watched:
    """The launcher's Jobs and pods as the watches last showed them (read on the event loop)."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.gone: set[str] = set()
        """Jobs the launcher deleted whose deletion the watch has not shown yet."""

    def deleted(self, name: str) -> None:
        self.gone.add(name)
        self.jobs.pop(name, None)

    def pod_of(self, job: str) -> dict[str, Any] | None:
        return kube_state.pods_by_job(list(self.pods.values())).get(job)

    def apply(self, kind: str, change: str, payload: Any) -> list[tuple[str, str]]:
        """Take in a change (or a ``SYNC``); the Jobs it concerns, with the change to each."""
        if change == "SYNC":
            items, _ = payload
            names = {obj["metadata"]["name"]: obj for obj in items}
            if kind == "jobs":
                self.jobs = {n: job for n, job in names.items() if n not in self.gone}
            else:
                self.pods = names
            return [(name, "SYNC") for name in self.jobs]
        name = payload["metadata"]["name"]
        if kind == "pods":
            if change == "DELETED":
                self.pods.pop(name, None)
            else:
                self.pods[name] = payload
            return [(job, "MODIFIED") for job in kube_state.pods_by_job([payload])]
        if change == "DELETED":
            self.jobs.pop(name, None)
            self.gone.discard(name)
        elif name not in self.gone:
            self.jobs[name] = payload
        return [(name, change)]
