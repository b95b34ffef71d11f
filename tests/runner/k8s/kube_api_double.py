"""A TEST DOUBLE of the Kubernetes API server: no cluster runs on this machine.

It serves, over real HTTP on 127.0.0.1, the few routes the launcher uses (Jobs: create, read,
list, watch, delete; pods: list, watch, log; Secrets: create, read, delete), answering with
JSON in the real API's shape. The shapes come from the files beside this module: Job, Pod,
Secret, Status objects and watch events written after the Kubernetes API reference (v1.33) and
checked against its OpenAPI schema by the tests; they were not captured from a live cluster.

A watch (``?watch=true&resourceVersion=V``) is answered as the API server does: a chunked
stream of JSON lines, ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": {...}}``, of every
change after V (each object with its new resourceVersion), then the changes as they come, until
``timeoutSeconds`` (a ``BOOKMARK`` with the current version ends it when bookmarks are asked
for). A version older than the double keeps (:meth:`KubeDouble.expire`) gets the ``ERROR``
event with the 410 Expired Status. Tests can drop a stream mid-way, without the chunked
stream's end (:meth:`KubeDouble.drop_after_next_event`, :meth:`KubeDouble.drop_watches`).
Deleting a Job deletes the Secrets it owns (the garbage collector's part, done at once). The double keeps the Jobs it was given, fills in what the API server
would (uid, resourceVersion, the controller's labels and defaults), and moves a Job through
the states the tests choose (running, complete, failed by deadline or backoff limit, an image
that cannot be pulled) by copying the status of the matching file. It answers 409
AlreadyExists for a second Job of the same name, 404 NotFound for a missing one, and, when
asked, checks a created Job against the OpenAPI schema (422 Invalid) as the API server would.
Every request is recorded, so a test can count creates and deletes.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

HERE = Path(__file__).parent

JOBS = re.compile(r"^/apis/batch/v1/namespaces/(?P<ns>[^/]+)/jobs(?:/(?P<name>[^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?P<log>/log)?)?$")
SECRETS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/secrets(?:/(?P<name>[^/]+))?$")

STATES = {
    "running": ("job-running.json", "pod-running.json"),
    "complete": ("job-complete.json", "pod-succeeded.json"),
    "deadline": ("job-failed-deadline.json", "pod-failed.json"),
    "backoff": ("job-failed-backoff.json", "pod-failed.json"),
    "image-pull": ("job-running.json", "pod-image-pull-backoff.json"),
    "secret-pending": ("job-running.json", "pod-waiting-for-secret.json"),
}
RECORDED_JOB = "agentbolt-at-0123456789abcdef"
"""The Job name in the recorded files (replaced by the real one where a status names it)."""


def recorded(name: str) -> dict[str, Any]:
    return json.loads((HERE / name).read_text())


def status_object(file_name: str, **fill: str) -> dict[str, Any]:
    """A recorded Status with its ``{placeholders}`` filled."""
    text = (HERE / file_name).read_text()
    for key, value in fill.items():
        text = text.replace("{" + key + "}", json.dumps(value)[1:-1])
    return json.loads(text)


def matches(labels: dict[str, str], selector: str | None) -> bool:
    """A label selector of the forms the launcher sends: ``k=v``, ``k``, ``!k``, comma-joined."""
    for term in filter(None, (selector or "").split(",")):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term not in labels:
            return False
    return True


class KubeDouble:
    """The double, on its own thread. ``validate`` (a function of the Job raising on a schema
    violation) makes creates answer 422 like the API server's validation."""

    def __init__(self, validate: Callable[[dict[str, Any]], str | None] | None = None) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.logs: dict[str, str] = {}  # pod name -> its log
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []  # bodies of accepted creates, as sent
        self.lose_create_answers = 0
        """Store this many Jobs but answer 504 Timeout: a create whose answer was lost."""
        self.refuse_creates = 0
        """Answer this many creates 504 Timeout without storing anything (an API server in trouble)."""
        self.refuse_secrets = 0
        """Answer this many Secret creates 403 Forbidden (a Role without ``create`` on secrets)."""
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.created_secrets: list[dict[str, Any]] = []  # bodies of accepted Secret creates, as sent
        self.validate = validate
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []
        """Every change, as (resourceVersion, "jobs"|"pods", type, object): what watches stream."""
        self.oldest = 0
        """Versions below this are compacted: a watch from one gets 410 Expired."""
        self.closed = False
        self._epoch = 0  # drop_watches() bumps it: streams begun before it are dropped
        self._drop_after: set[str] = set()  # kinds whose streams drop after their next event
        self._rv = 200000
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> KubeDouble:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.closed = True
            self.changed.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ what tests drive

    def job(self, name: str, namespace: str = "agents") -> dict[str, Any] | None:
        with self.lock:
            found = self.jobs.get((namespace, name))
            return copy.deepcopy(found) if found else None

    def job_names(self, namespace: str = "agents") -> list[str]:
        with self.lock:
            return sorted(n for ns, n in self.jobs if ns == namespace)

    def count(self, method: str, pattern: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m == method and re.search(pattern, p))

    def secret(self, name: str, namespace: str = "agents") -> dict[str, Any] | None:
        with self.lock:
            found = self.secrets.get((namespace, name))
            return copy.deepcopy(found) if found else None

    def watches(self, kind: str) -> list[str]:
        """The resourceVersion of each watch request of ``kind`` ("jobs", "pods"), in order."""
        with self.lock:
            paths = [urlsplit(p) for m, p in self.requests if m == "GET" and p.split("?")[0].endswith(kind)]
        queries = [{k: v[0] for k, v in parse_qs(p.query).items()} for p in paths]
        return [q.get("resourceVersion", "") for q in queries if q.get("watch") == "true"]

    def lists(self, kind: str) -> int:
        """How many plain lists (not watches) of ``kind`` were asked for."""
        with self.lock:
            paths = [p for m, p in self.requests if m == "GET" and p.split("?")[0].endswith(kind)]
        return sum(1 for p in paths if "watch=true" not in p)

    def drop_after_next_event(self, kind: str) -> None:
        """The next stream of ``kind`` that sends an event breaks off right after it."""
        with self.lock:
            self._drop_after.add(kind)

    def drop_watches(self) -> None:
        """Break off every open stream now (a connection reset)."""
        with self.lock:
            self._epoch += 1
            self.changed.notify_all()

    def expire(self) -> None:
        """Compact: every version up to now is too old to watch from (410), as etcd's compaction
        makes it; open streams are dropped, so their resumes meet it."""
        with self.lock:
            self.oldest = self._rv + 1
            self._epoch += 1
            self.changed.notify_all()

    def set_state(self, name: str, state: str, log: str = "", namespace: str = "agents") -> None:
        """Move a Job (and its one pod) to ``state``: the status of the recorded files."""
        job_file, pod_file = STATES[state]
        with self.lock:
            job = self.jobs[(namespace, name)]
            job["status"] = recorded(job_file)["status"]
            job["metadata"]["resourceVersion"] = self._next_rv()
            self._emit("jobs", "MODIFIED", job)
            new = self._find_pod(job) is None
            pod = self._pod_of(job)
            status = json.dumps(recorded(pod_file)["status"]).replace(RECORDED_JOB, name)
            pod["status"] = json.loads(status)
            pod["metadata"]["resourceVersion"] = self._next_rv()
            self._emit("pods", "ADDED" if new else "MODIFIED", pod)
            if log:
                self.logs[pod["metadata"]["name"]] = log

    def add_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """Put a Job in as if created earlier (by a launcher that is gone)."""
        with self.lock:
            return self._store(body)

    # ------------------------------------------------------------------ the API server's part

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, kind: str, change: str, obj: dict[str, Any]) -> None:
        """Log a change for the watches (the lock held)."""
        self.events.append((int(obj["metadata"]["resourceVersion"]), kind, change, copy.deepcopy(obj)))
        self.changed.notify_all()

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        job = copy.deepcopy(body)
        shape = recorded("job-created.json")
        meta, name = job["metadata"], job["metadata"]["name"]
        uid = str(uuid.uuid4())
        meta.update(
            uid=uid,
            resourceVersion=self._next_rv(),
            generation=1,
            creationTimestamp=shape["metadata"]["creationTimestamp"],
        )
        spec = job["spec"]
        for key in ("completionMode", "suspend", "podReplacementPolicy", "manualSelector"):
            spec.setdefault(key, shape["spec"][key])
        controller = {"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid}
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        pod_meta = spec["template"].setdefault("metadata", {})
        pod_meta["labels"] = {
            **pod_meta.get("labels", {}),
            **controller,
            "batch.kubernetes.io/job-name": name,
            "job-name": name,
        }
        job["status"] = copy.deepcopy(shape["status"])
        self.jobs[(meta["namespace"], name)] = job
        self._emit("jobs", "ADDED", job)
        return copy.deepcopy(job)

    def _find_pod(self, job: dict[str, Any]) -> dict[str, Any] | None:
        for pod in self.pods.values():
            if pod["metadata"]["labels"].get("job-name") == job["metadata"]["name"]:
                return pod
        return None

    def _pod_of(self, job: dict[str, Any]) -> dict[str, Any]:
        meta = job["metadata"]
        if (found := self._find_pod(job)) is not None:
            return found
        shape = recorded("pod-running.json")
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                **shape["metadata"],
                "name": f"{meta['name']}-{uuid.uuid4().hex[:5]}",
                "generateName": f"{meta['name']}-",
                "namespace": meta["namespace"],
                "uid": str(uuid.uuid4()),
                "resourceVersion": self._next_rv(),
                "labels": copy.deepcopy(job["spec"]["template"]["metadata"]["labels"]),
                "ownerReferences": [
                    {**shape["metadata"]["ownerReferences"][0], "name": meta["name"], "uid": meta["uid"]}
                ],
            },
            "spec": {**shape["spec"], **copy.deepcopy(job["spec"]["template"]["spec"])},
            "status": {},
        }
        self.pods[(meta["namespace"], pod["metadata"]["name"])] = pod
        return pod

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: Any, text: bool = False) -> None:
                data = body.encode() if text else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                with double.lock:
                    double.requests.append((method, self.path))
                body = None
                if method == "POST":
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}")
                if query.get("watch") == "true" and method == "GET":
                    kind = "jobs" if JOBS.match(parts.path) else "pods" if PODS.match(parts.path) else ""
                    if kind:
                        return self._watch(kind, query)
                if m := JOBS.match(parts.path):
                    code, answer = double._jobs(method, m["ns"], m["name"], query, body)
                    return self._send(code, answer)
                if m := SECRETS.match(parts.path):
                    code, answer = double._secrets(method, m["ns"], m["name"], body)
                    return self._send(code, answer)
                if (m := PODS.match(parts.path)) and method == "GET":
                    code, answer, text = double._pods(m["ns"], m["name"], bool(m["log"]), query)
                    return self._send(code, answer, text)
                self._send(404, status_object("status-404-job-not-found.json", name=parts.path))

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, kind: str, query: dict[str, str]) -> None:
                """A watch, streamed as the API server does (chunked JSON lines)."""
                self.protocol_version = "HTTP/1.1"  # chunked transfer is HTTP/1.1's
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    if double._stream(kind, query, self._chunk):
                        self._chunk(b"")  # the stream's proper end; a dropped one has none
                except (BrokenPipeError, ConnectionResetError):  # the client stopped watching
                    pass

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler

    def _jobs(
        self, method: str, ns: str, name: str | None, query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        with self.lock:
            if method == "POST" and name is None:
                name = body["metadata"]["name"]
                if self.refuse_creates:
                    self.refuse_creates -= 1
                    return 504, status_object("status-504-timeout.json")
                if (ns, name) in self.jobs:
                    return 409, status_object("status-409-already-exists.json", name=name)
                if self.validate is not None and (problem := self.validate(body)):
                    field, _, detail = problem.partition(": ")
                    return 422, status_object(
                        "status-422-invalid.json", name=name, field=field, detail=detail
                    )
                self.created.append(copy.deepcopy(body))
                stored = self._store(body)
                if self.lose_create_answers:
                    self.lose_create_answers -= 1
                    return 504, status_object("status-504-timeout.json")
                return 201, stored
            if method == "GET" and name is None:
                items = [
                    copy.deepcopy(j)
                    for (n_s, _), j in sorted(self.jobs.items())
                    if n_s == ns and matches(j["metadata"].get("labels", {}), query.get("labelSelector"))
                ]
                meta = {"resourceVersion": self._next_rv()}
                return 200, {"kind": "JobList", "apiVersion": "batch/v1", "metadata": meta, "items": items}
            job = self.jobs.get((ns, name or ""))
            if job is None:
                return 404, status_object("status-404-job-not-found.json", name=name or "")
            if method == "GET":
                return 200, copy.deepcopy(job)
            if method == "DELETE":
                del self.jobs[(ns, name or "")]
                job["metadata"]["resourceVersion"] = self._next_rv()
                self._emit("jobs", "DELETED", job)
                for key, pod in list(self.pods.items()):  # background propagation
                    if pod["metadata"]["labels"].get("job-name") == name:
                        del self.pods[key]
                        pod["metadata"]["resourceVersion"] = self._next_rv()
                        self._emit("pods", "DELETED", pod)
                uid = job["metadata"]["uid"]
                for key, secret in list(self.secrets.items()):  # the garbage collector: owned by the Job
                    if any(o.get("uid") == uid for o in secret["metadata"].get("ownerReferences") or []):
                        del self.secrets[key]
                return 200, status_object("status-200-job-deleted.json", name=name or "", uid=uid)
            return 405, status_object("status-404-job-not-found.json", name=name or "")

    def _pods(self, ns: str, name: str | None, log: bool, query: dict[str, str]) -> tuple[int, Any, bool]:
        with self.lock:
            if name is None:
                items = [
                    copy.deepcopy(p)
                    for (n_s, _), p in sorted(self.pods.items())
                    if n_s == ns and matches(p["metadata"]["labels"], query.get("labelSelector"))
                ]
                meta = {"resourceVersion": self._next_rv()}
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}, False
            if (ns, name) not in self.pods:
                return 404, status_object("status-404-pod-not-found.json", name=name), False
            if log:
                text = self.logs.get(name, "")
                limit = int(query.get("limitBytes") or 0)
                return 200, text.encode()[:limit].decode(errors="ignore") if limit else text, True
            return 200, copy.deepcopy(self.pods[(ns, name)]), False

    def _secrets(self, method: str, ns: str, name: str | None, body: Any) -> tuple[int, Any]:
        with self.lock:
            if method == "POST" and name is None:
                name = body["metadata"]["name"]
                if self.refuse_secrets:
                    self.refuse_secrets -= 1
                    return 403, status_object("status-403-secrets-forbidden.json")
                if (ns, name) in self.secrets:
                    return 409, status_object("status-409-secret-exists.json", name=name)
                if self.validate is not None and (problem := self.validate(body)):
                    field, _, detail = problem.partition(": ")
                    return 422, status_object(
                        "status-422-invalid.json", name=name, field=field, detail=detail
                    )
                for value in (body.get("data") or {}).values():
                    base64.b64decode(value, validate=True)  # the API server refuses what is not base64
                self.created_secrets.append(copy.deepcopy(body))
                shape = recorded("secret-created.json")["metadata"]
                secret = copy.deepcopy(body)
                secret["metadata"].update(
                    uid=str(uuid.uuid4()),
                    resourceVersion=self._next_rv(),
                    creationTimestamp=shape["creationTimestamp"],
                    managedFields=shape["managedFields"],
                )
                self.secrets[(ns, name)] = secret
                return 201, copy.deepcopy(secret)
            found = self.secrets.get((ns, name or ""))
            if found is None:
                return 404, status_object("status-404-secret-not-found.json", name=name or "")
            if method == "GET":
                return 200, copy.deepcopy(found)
            if method == "DELETE":
                del self.secrets[(ns, name or "")]
                uid = found["metadata"]["uid"]
                return 200, status_object("status-200-secret-deleted.json", name=name or "", uid=uid)
            return 405, status_object("status-404-secret-not-found.json", name=name or "")

    def _stream(self, kind: str, query: dict[str, str], send: Callable[[bytes], None]) -> bool:
        """Send the changes of ``kind`` after the query's resourceVersion as they come; False
        when the stream is dropped (no proper end)."""
        selector, since = query.get("labelSelector"), int(query.get("resourceVersion") or 0)
        until = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        line = lambda event: json.dumps(event).encode() + b"\n"  # noqa: E731
        with self.lock:
            epoch = self._epoch
            if since and since < self.oldest:
                text = (HERE / "watch-event-error-410.json").read_text()
                text = text.replace("{version}", str(since)).replace("{oldest}", str(self.oldest))
                send(line(json.loads(text)))
                return True
        sent = since
        while True:
            with self.lock:
                while not self.closed and epoch == self._epoch and time.monotonic() < until:
                    if any(rv > sent for rv, *_ in self.events):
                        break
                    self.changed.wait(0.05)
                if self.closed or epoch != self._epoch:
                    return False
                news = [e for e in self.events if e[0] > sent]
                if not news:  # the server's timeout: a bookmark with the version, then the end
                    if query.get("allowWatchBookmarks") == "true":
                        bookmark = recorded("watch-event-bookmark.json")
                        bookmark["object"]["metadata"]["resourceVersion"] = str(self._rv)
                        if kind == "pods":
                            bookmark["object"] = {
                                "kind": "Pod",
                                "apiVersion": "v1",
                                **{
                                    k: v
                                    for k, v in bookmark["object"].items()
                                    if k not in ("kind", "apiVersion")
                                },
                            }
                        send(line(bookmark))
                    return True
                drop = False
                for rv, of, change, obj in news:
                    sent = rv
                    if of != kind or not matches(obj["metadata"].get("labels") or {}, selector):
                        continue
                    send(line({"type": change, "object": obj}))
                    if kind in self._drop_after:
                        self._drop_after.discard(kind)
                        drop = True
                        break
                if drop:
                    return False
