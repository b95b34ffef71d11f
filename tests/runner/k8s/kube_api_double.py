"""A TEST DOUBLE of the Kubernetes API server: no cluster runs on this machine.

It serves, over real HTTP on 127.0.0.1, the few routes the launcher uses (Jobs: create, read,
list, delete; pods: list, log), answering with JSON in the real API's shape. The shapes come
from the files beside this module: Job, Pod and Status objects written after the Kubernetes API
reference (v1.33) and checked against its OpenAPI schema by the tests; they were not captured
from a live cluster. The double keeps the Jobs it was given, fills in what the API server
would (uid, resourceVersion, the controller's labels and defaults), and moves a Job through
the states the tests choose (running, complete, failed by deadline or backoff limit, an image
that cannot be pulled) by copying the status of the matching file. It answers 409
AlreadyExists for a second Job of the same name, 404 NotFound for a missing one, and, when
asked, checks a created Job against the OpenAPI schema (422 Invalid) as the API server would.
Every request is recorded, so a test can count creates and deletes.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

HERE = Path(__file__).parent

JOBS = re.compile(r"^/apis/batch/v1/namespaces/(?P<ns>[^/]+)/jobs(?:/(?P<name>[^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?P<log>/log)?)?$")

STATES = {
    "running": ("job-running.json", "pod-running.json"),
    "complete": ("job-complete.json", "pod-succeeded.json"),
    "deadline": ("job-failed-deadline.json", "pod-failed.json"),
    "backoff": ("job-failed-backoff.json", "pod-failed.json"),
    "image-pull": ("job-running.json", "pod-image-pull-backoff.json"),
}


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
        self.validate = validate
        self.lock = threading.Lock()
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

    def set_state(self, name: str, state: str, log: str = "", namespace: str = "agents") -> None:
        """Move a Job (and its one pod) to ``state``: the status of the recorded files."""
        job_file, pod_file = STATES[state]
        with self.lock:
            job = self.jobs[(namespace, name)]
            job["status"] = recorded(job_file)["status"]
            job["metadata"]["resourceVersion"] = self._next_rv()
            pod = self._pod_of(job)
            pod["status"] = recorded(pod_file)["status"]
            pod["metadata"]["resourceVersion"] = self._next_rv()
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
        return copy.deepcopy(job)

    def _pod_of(self, job: dict[str, Any]) -> dict[str, Any]:
        meta = job["metadata"]
        for pod in self.pods.values():
            if pod["metadata"]["labels"].get("job-name") == meta["name"]:
                return pod
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
                if m := JOBS.match(parts.path):
                    code, answer = double._jobs(method, m["ns"], m["name"], query, body)
                    return self._send(code, answer)
                if (m := PODS.match(parts.path)) and method == "GET":
                    code, answer, text = double._pods(m["ns"], m["name"], bool(m["log"]), query)
                    return self._send(code, answer, text)
                self._send(404, status_object("status-404-job-not-found.json", name=parts.path))

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
                for key, pod in list(self.pods.items()):  # background propagation
                    if pod["metadata"]["labels"].get("job-name") == name:
                        del self.pods[key]
                uid = job["metadata"]["uid"]
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
