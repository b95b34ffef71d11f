"""Fuzzing the HTTP API with schemathesis, against a real server on 127.0.0.1.

Every operation of the OpenAPI document the server serves gets ``AGENTBOLT_FUZZ_EXAMPLES``
(default 20) generated requests, valid and invalid, with an admin token, on SQLite and on
PostgreSQL, and every schemathesis check runs: no 5xx, every answer matches its documented
status, content type and schema, invalid input is refused and valid input accepted.

One documented exception: free-form JSON may hold integers beyond 64 bits, which the store
cannot keep; those get a 422 that says so (JSON Schema has no way to say it up front).
Generated strings hold no NUL characters: PostgreSQL text cannot, and a NUL gets a 400 there
(:func:`test_nul_characters_are_refused_not_crashed_on` checks that separately).

Besides: oversized bodies get 413 everywhere, and the gateway answers malformed chat requests
with OpenAI-style 4xx errors.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from scale_support import pg_schema, scaled
from schemathesis.specs.openapi.checks import positive_data_acceptance

from agentbolt.client import Client
from agentbolt.schemas import LLM, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread, create_app
from agentbolt.server.run import free_port

TOKEN = "fuzz-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
EXAMPLES = scaled("AGENTBOLT_FUZZ_EXAMPLES", 20)


def _config(db: str, **kwargs: object) -> ServerConfig:
    return ServerConfig(db=db, tokens={TOKEN: Role.ADMIN}, upstream_timeout=3.0, **kwargs)  # type: ignore[arg-type]


# The document the server serves, built the same way (collection needs it before any server
# runs); test_the_fuzzed_document_is_the_served_one checks they are equal.
OPENAPI = create_app(_config(":memory:")).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.generation.update(allow_x00=False, allow_extra_parameters=False)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server with some state to hit: resources (with an upstream api_key), rollouts, a claim."""
    if request.param == "postgres":
        with pg_schema() as db, ServerThread(_config(db)) as srv:
            _populate(srv.url)
            yield srv
    else:
        db = str(tmp_path_factory.mktemp("fuzz") / "fuzz.db")
        with ServerThread(_config(db)) as srv:
            _populate(srv.url)
            yield srv


def _populate(url: str) -> None:
    with Client(url, TOKEN) as client:
        client.publish_resources({"llm": LLM(base_url="http://127.0.0.1:9/v1", model="m", api_key="sk-fuzz")})
        client.enqueue([RolloutCreate(task=Task(data={"i": i})) for i in range(5)])
        client.dequeue("fuzz-worker")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api(case, api):
    response = case.call(base_url=api.url, headers=AUTH, timeout=30)
    excluded = []
    if response.status_code == 422 and "integers must fit in 64 bits" in response.text:
        excluded.append(positive_data_acceptance)  # the documented exception (module docstring)
    case.validate_response(
        response, headers=AUTH, excluded_checks=excluded, transport_kwargs={"base_url": api.url}
    )


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
