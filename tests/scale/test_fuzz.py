"""Fuzzing the HTTP API with schemathesis, against a real server on 127.0.0.1.

Every operation of the OpenAPI document the server serves gets ``AGENTBOLT_FUZZ_EXAMPLES``
(default 20) generated requests, valid and invalid, with an admin token, on SQLite and on
PostgreSQL, and every schemathesis check runs: no 5xx, every answer matches its documented
status, content type and schema, invalid input is refused and valid input accepted.

Three documented exceptions, where JSON Schema has no way to say up front what the server
refuses with a 422 that says so: free-form JSON may hold integers beyond 64 bits, which the
store cannot keep; the named rewards' rules across fields (a scale's high above its low, a
score unless the state is error, names distinct and not ``agent``; an LLM resource's servers,
``base_url`` and ``upstreams``, all different: :data:`CROSS_FIELD`); and the rule across
requests that an ``Idempotency-Key`` names one request (the generator sends the same key with
other bodies: 422 ``IdempotencyKeyReused``, :data:`ACROSS_REQUESTS`).
Generated strings hold no NUL characters: PostgreSQL text cannot, and a NUL gets a 400 there
(:func:`test_nul_characters_are_refused_not_crashed_on` checks that separately).

Schemathesis's stateful phase (:func:`test_stateful`) follows the OpenAPI links the server
documents (publish -> enqueue -> dequeue -> heartbeat / events / finish / cancel on the claimed
attempt, enqueue -> read / cancel, finish -> read, publish -> read):
``AGENTBOLT_FUZZ_SCENARIOS`` (default 20) scenarios of at most ``AGENTBOLT_FUZZ_STEPS``
(default 8) calls each, each on a fresh store holding two queued rollouts, so the attempt
handlers are fuzzed on real, claimed attempts, not only on unknown ids. With ``-s`` both phases
print the operations covered and the cases run. The gateway's operations are left out of the
stateful phase: on a real attempt they forward to the model server of a fuzzed resources
version and answer for it (unreachable: 502; bodies the loose documented schema allows but
OpenAI's API does not: 400); :func:`test_gateway_answers_malformed_chat_requests_with_openai_errors`
covers the gateway on a real attempt.

Besides: oversized bodies get 413 everywhere, and the gateway answers malformed chat requests
with OpenAI-style 4xx errors.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from scale_support import pg_schema, scaled
from schemathesis.specs.openapi.checks import positive_data_acceptance

from agentbolt.client import Client
from agentbolt.schemas import LLM, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread, create_app
from agentbolt.server.run import free_port

TOKEN = "fuzz-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
EXAMPLES = scaled("AGENTBOLT_FUZZ_EXAMPLES", 20)
SCENARIOS = scaled("AGENTBOLT_FUZZ_SCENARIOS", 20)
STEPS = scaled("AGENTBOLT_FUZZ_STEPS", 8)
STATELESS: Counter[str] = Counter()  # cases per operation, on the current ``api`` server
# The handlers of an attempt: the stateful phase must reach them on real, claimed attempts.
ATTEMPT_HANDLERS = tuple(
    f"POST /api/attempts/{{attempt_id}}/{verb}" for verb in ("heartbeat", "events", "finish")
)


def _config(db: str, **kwargs: object) -> ServerConfig:
    return ServerConfig(db=db, tokens={TOKEN: Role.ADMIN}, upstream_timeout=3.0, **kwargs)  # type: ignore[arg-type]


# The document the server serves, built the same way (collection needs it before any server
# runs); test_the_fuzzed_document_is_the_served_one checks they are equal.
OPENAPI = create_app(_config(":memory:")).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.generation.update(allow_x00=False, allow_extra_parameters=False)
# The stateful phase follows the documented links only (schemathesis would also guess links
# from names, 150 of them, and spend the steps on those), with valid requests only: invalid
# ones are the stateless phase's, and a link's body, filled in from the claim, would turn a
# generated invalid body valid while schemathesis still expected a refusal.
schema.config.phases.stateful.inference.algorithms = []
schema.config.phases.stateful.generation.update(modes=[schemathesis.GenerationMode.POSITIVE])


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server with some state to hit: resources (with an upstream api_key), rollouts, a claim.
    Afterwards (with ``-s``) the stateless cases it answered, counted by :func:`test_api`."""
    STATELESS.clear()
    if request.param == "postgres":
        with pg_schema() as db, ServerThread(_config(db)) as srv:
            _populate(srv.url)
            yield srv
    else:
        db = str(tmp_path_factory.mktemp("fuzz") / "fuzz.db")
        with ServerThread(_config(db)) as srv:
            _populate(srv.url)
            yield srv
    print(f"\nstateless ({request.param}): {sum(STATELESS.values())} cases over {len(STATELESS)} operations")


def _populate(url: str) -> None:
    with Client(url, TOKEN) as client:
        client.publish_resources({"llm": LLM(base_url="http://127.0.0.1:9/v1", model="m", api_key="sk-fuzz")})
        client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(5)])
        client.dequeue("fuzz-worker")


# what the named rewards' model validators say (agentbolt.schemas): rules across fields
CROSS_FIELD = (
    "integers must fit in 64 bits",
    "a scale needs high > low",
    "a score is required (state 'scored')",
    "state 'error' takes an error message and no score",
    "'agent' is the rollout's own reward",
    "'agent' names the rollout's own reward",
    "reward names must be distinct",
    "is named twice",  # an LLM resource's servers (base_url and upstreams) must all differ
)


# a rule across requests: a key sent again with another body (tests/security/test_idempotency.py)
ACROSS_REQUESTS = ('"type":"IdempotencyKeyReused"',)


def _validate(case, response, url: str, additional_checks=None) -> None:
    """Every check, but for the documented exceptions (module docstring)."""
    excluded = []
    if response.status_code == 422 and any(rule in response.text for rule in CROSS_FIELD + ACROSS_REQUESTS):
        excluded.append(positive_data_acceptance)
    case.validate_response(
        response,
        headers=AUTH,
        additional_checks=additional_checks,
        excluded_checks=excluded,
        transport_kwargs={"base_url": url},
    )


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api(case, api):
    STATELESS[case.operation.label] += 1
    response = case.call(base_url=api.url, headers=AUTH, timeout=30)
    _validate(case, response, api.url)


class ApiWorkflow(schema.exclude(path_regex="^/gateway/").as_state_machine()):  # type: ignore[misc]
    """Scenarios along the documented links. Each starts on a fresh store (``fresh_store``
    yields its database) with two queued rollouts: the same calls then get the same answers, which
    Hypothesis needs to replay a scenario. Counts the calls (and 2xx answers) per operation."""

    fresh_store: Callable[[], AbstractContextManager[str]]
    calls: Counter[str] = Counter()
    accepted: Counter[str] = Counter()

    def setup(self) -> None:
        self.stack = ExitStack()
        db = self.stack.enter_context(self.fresh_store())
        # No lease can lapse within a scenario (see before_call), so no sweeps: a sweep holding
        # a row lock makes a PostgreSQL dequeue skip that row, and the replay differ.
        self.url = self.stack.enter_context(ServerThread(_config(db, sweep_interval=3600.0))).url
        items = [{"task": {"data": {"scenario": n}}} for n in range(2)]
        httpx.post(f"{self.url}/api/rollouts", json={"rollouts": items}, headers=AUTH).raise_for_status()

    def teardown(self) -> None:
        self.stack.close()

    def before_call(self, case) -> None:
        """Pin what depends on the clock, so that a replayed scenario gets the same answers
        (the stateless phase fuzzes these fields in full): a valid lease or timeout lasts at
        least a minute, and a valid long poll, which on an empty queue only waits, at most
        0.2 s. Values out of range stay as generated: they make the negative cases."""
        body = case.body if isinstance(case.body, dict) else {}
        rollouts: list[Any] = body["rollouts"] if isinstance(body.get("rollouts"), list) else []
        for part in (body, *rollouts):
            for field in ("lease_seconds", "timeout_seconds"):
                _pin(part, field, valid=(0.0, 60.0), to=60.0)
        if case.operation.label == "POST /api/dequeue":
            _pin(body, "wait", valid=(0.2, 60.0), to=0.2)

    def get_call_kwargs(self, case) -> dict[str, object]:
        return {"base_url": self.url, "headers": AUTH, "timeout": 30}

    def after_call(self, response, case) -> None:
        super().after_call(response, case)
        self.calls[case.operation.label] += 1
        if response.status_code < 300:
            self.accepted[case.operation.label] += 1

    def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
        _validate(case, response, self.url, additional_checks)


def _pin(part: object, field: str, valid: tuple[float, float], to: float) -> None:
    """Set a number of a JSON object in the request to ``to`` when it lies in ``valid``
    (low excluded, high included); anything else stays as generated."""
    if (
        isinstance(part, dict)
        and type(part.get(field)) in (int, float)
        and valid[0] < part[field] <= valid[1]
    ):
        part[field] = to


STATEFUL_SETTINGS = settings(
    max_examples=SCENARIOS,
    stateful_step_count=STEPS,
    phases=[Phase.generate],  # as schemathesis runs it: no shrinking (a failure prints its calls)
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_stateful(backend, tmp_path):
    scenario = itertools.count()

    @contextmanager
    def sqlite_file() -> Iterator[str]:
        yield str(tmp_path / f"scenario-{next(scenario)}.db")

    ApiWorkflow.fresh_store = staticmethod(pg_schema if backend == "postgres" else sqlite_file)  # type: ignore[assignment]
    ApiWorkflow.calls.clear()
    ApiWorkflow.accepted.clear()
    ApiWorkflow.run(settings=STATEFUL_SETTINGS)
    calls, accepted = ApiWorkflow.calls, ApiWorkflow.accepted
    print(
        f"\nstateful ({backend}): {sum(calls.values())} cases over {len(calls)} operations, {SCENARIOS} scenarios"
    )
    for label in sorted(calls):
        print(f"  {calls[label]:4d} cases, {accepted[label]:4d} 2xx  {label}")
    assert sum(accepted[label] for label in ATTEMPT_HANDLERS) > 0, "no attempt handler met a real attempt"


# What a link's target needs besides what the link fills in, and what each source is sent.
_TARGET_BODIES = {
    "/api/attempts/{attempt_id}/events": {"events": [{"type": "message", "data": {"n": 1}}]},
    "/api/attempts/{attempt_id}/finish": {"status": "succeeded", "reward": 1.0},
    "/api/dequeue": {"worker_id": "linked"},
    "/api/rollouts": {"rollouts": [{"task": {"data": {"linked": True}}}]},
    "/gateway/{rollout_id}/{attempt_id}/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    },
}
_SOURCE_BODIES = {
    "/api/resources": {
        "resources": {"llm": {"type": "llm", "base_url": "http://127.0.0.1:9/v1", "model": "m"}}
    },
    "/api/rollouts": _TARGET_BODIES["/api/rollouts"],
    "/api/dequeue": {"worker_id": "linked"},
}


def _pointer(expression: str, body: object) -> object:
    """A ``$response.body#/a/0/b`` runtime expression, read from ``body``."""
    for part in expression.removeprefix("$response.body#/").split("/"):
        body = body[int(part)] if isinstance(body, list) else body[part]  # type: ignore[index]
    return body


def _links() -> Iterator[tuple[str, str, int, str, dict[str, Any]]]:
    """(source path, method, status, link name, link) for every link of the document."""
    for path, operations in OPENAPI["paths"].items():
        for method, op in operations.items():
            for status, response in op["responses"].items():
                for name, link in response.get("links", {}).items():
                    yield path, method, int(status), name, link


def test_every_link_leads_to_a_real_object(tmp_path):
    """Each documented link, followed once from a fresh answer of its source: the target finds
    the object the link names (a 2xx; the gateway forwards, and its model server is down: 502)."""
    targets = {op["operationId"]: (m, p) for p, ops in OPENAPI["paths"].items() for m, op in ops.items()}
    links = list(_links())
    with (
        ServerThread(_config(str(tmp_path / "links.db"))) as srv,
        httpx.Client(base_url=srv.url, headers=AUTH) as http,
    ):
        http.post("/api/resources", json=_SOURCE_BODIES["/api/resources"]).raise_for_status()
        for path, method, status, name, link in links:
            if path == "/api/dequeue":  # a claim needs a queued rollout
                http.post("/api/rollouts", json=_TARGET_BODIES["/api/rollouts"]).raise_for_status()
            source = http.request(method, path, json=_SOURCE_BODIES[path])
            assert source.status_code == status, (path, source.text)
            target_method, target_path = targets[link["operationId"]]
            params = {k: _pointer(v, source.json()) for k, v in link.get("parameters", {}).items()}
            filled = {k: _pointer(v, source.json()) for k, v in link.get("requestBody", {}).items()}
            body = {**_TARGET_BODIES.get(target_path, {}), **filled} if target_method == "post" else None
            answer = http.request(target_method, target_path.format(**params), json=body)
            down = target_path.endswith("/chat/completions") and answer.status_code == 502
            assert answer.status_code < 300 or down, (name, answer.status_code, answer.text)
    assert len(links) >= 12, f"only {len(links)} links documented"


def test_the_fuzzed_document_is_the_served_one(api):
    assert httpx.get(f"{api.url}/openapi.json", headers=AUTH).json() == OPENAPI


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_nul_characters_are_refused_not_crashed_on(backend, tmp_path):
    def run(url: str) -> None:
        bad = [
            ("GET", "/api/rollouts/a%00b", None),
            ("GET", "/api/attempts/a%00b", None),
            ("POST", "/api/dequeue", {"worker_id": "w\x00"}),
            ("POST", "/api/rollouts", {"rollouts": [{"id": "x\x00", "task": {"data": {}}}]}),
            ("POST", "/api/rollouts", {"rollouts": [{"task": {"id": "t\x00", "data": {"k": "v\x00"}}}]}),
            ("GET", "/api/rollouts?group_id=g%00", None),
        ]
        for method, path, body in bad:
            r = httpx.request(method, f"{url}{path}", json=body, headers=AUTH)
            assert r.status_code < 500, (method, path, r.status_code, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["message"]

    if backend == "postgres":
        with pg_schema() as db, ServerThread(_config(db)) as srv:
            run(srv.url)
    else:
        with ServerThread(_config(str(tmp_path / "nul.db"))) as srv:
            run(srv.url)


def test_oversized_bodies_get_413_everywhere(tmp_path):
    with ServerThread(_config(str(tmp_path / "big.db"), max_body_bytes=4096)) as srv:
        big = b'{"x": "' + b"y" * 8192 + b'"}'

        def chunks() -> Iterator[bytes]:  # no content-length: the limit is counted as it arrives
            yield big[:100]
            yield big[100:]

        for path in (
            "/api/rollouts",
            "/api/dequeue",
            "/api/attempts/a/events",
            "/api/resources",
            "/gateway/r/a/v1/chat/completions",
            "/v1/traces",
        ):
            for content in (big, chunks()):
                r = httpx.post(
                    f"{srv.url}{path}", content=content, headers={**AUTH, "content-type": "application/json"}
                )
                assert r.status_code == 413, (path, r.status_code, r.text)
                assert "larger than 4096 bytes" in r.json()["error"]["message"]


MALFORMED_CHAT = [
    b"not json",
    b"[1, 2]",
    b"{}",
    b'{"model": "double", "messages": []}',
    b'{"model": "double", "messages": "hi"}',
    b'{"model": "double", "messages": [{"content": "no role"}]}',
    b'{"model": "double", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "double", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    b'{"model": "double", "messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": 5}',
    b'{"model": "double", "messages": [{"role": "user", "content": "hi"}], "n": 0}',
    b'{"model": "double", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}',
]


def test_gateway_answers_malformed_chat_requests_with_openai_errors(tmp_path):
    """A real attempt whose LLM is a live model server: malformed calls get an OpenAI-style
    400 from the gateway (the model server is never bothered), a good one goes through."""
    port = free_port()
    here = Path(__file__).parent
    upstream = subprocess.Popen(
        [sys.executable, str(here / "upstream_proc.py"), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert upstream.stdout is not None and upstream.stdout.readline().startswith("READY")
        with ServerThread(_config(str(tmp_path / "gw.db"))) as srv, Client(srv.url, TOKEN) as client:
            client.publish_resources({"llm": LLM(base_url=f"http://127.0.0.1:{port}/v1", model="double")})
            client.enqueue([RolloutCreate(task=Task(data={}))])
            claim = client.dequeue("w")
            assert claim is not None
            url = f"{srv.url}/gateway/{claim.rollout.id}/{claim.attempt.id}/v1/chat/completions"
            for body in MALFORMED_CHAT:
                r = httpx.post(url, content=body, headers={**AUTH, "content-type": "application/json"})
                assert r.status_code == 400, (body, r.status_code, r.text)
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error" and error["message"], (body, error)
                assert set(error) >= {"message", "type", "param", "code"}
            r = httpx.post(
                url, json={"model": "double", "messages": [{"role": "user", "content": "hi"}]}, headers=AUTH
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "echo: hi"
            calls = [e for e in client.all_events(claim.rollout.id) if e.type == "llm_call"]
            assert len(calls) == 1  # refused calls are not forwarded, so not recorded either
    finally:
        upstream.kill()
        upstream.wait(10)
