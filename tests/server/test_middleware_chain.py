"""Every request takes one middleware chain, CORS configured or not: the same body limit, auth
and fast paths on a real server on 127.0.0.1, for the runner's and the gateway's hot POSTs as
for every other route; with CORS, its headers ride on every answer of the chain."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from agentbolt.server import Role, ServerConfig, ServerThread
from agentbolt.server.routes import runner_fast

ADMIN, RUNNER, READER = "adm-chain-1", "run-chain-2", "read-chain-3"
TOKENS = {ADMIN: Role.ADMIN, RUNNER: Role.RUNNER, READER: Role.READER}
ORIGIN = "https://ui.example"
LIMIT = 2000
BIG = {"rollouts": [{"task": {"data": {"blob": "x" * (2 * LIMIT)}}}]}
GATEWAY = "/gateway/r-none/a-none/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# (method, path, token, body) -> (status, error type) the server answers, CORS or not
EXPECTED = [
    (("GET", "/health", None, None), (200, None)),
    (("GET", "/api/rollouts", None, None), (401, "unauthorized")),
    (("GET", "/api/rollouts", "bad-token", None), (401, "unauthorized")),
    (("GET", "/api/rollouts", READER, None), (200, None)),
    (("POST", "/api/rollouts", READER, {"rollouts": []}), (403, "forbidden")),
    (("POST", "/api/rollouts", ADMIN, BIG), (413, "too_large")),
    (("POST", "/api/dequeue", None, {"worker_id": "w"}), (401, "unauthorized")),
    (("POST", "/api/dequeue", READER, {"worker_id": "w"}), (403, "forbidden")),
    (("POST", "/api/dequeue", RUNNER, {"worker_id": "w"}), (200, None)),
    (("POST", "/api/dequeue", RUNNER, {"worker_id": "w" * (2 * LIMIT)}), (413, "too_large")),
    (("POST", "/api/attempts/a-none/heartbeat", None, {}), (401, "unauthorized")),
    (("POST", GATEWAY, None, CHAT), (401, "unauthorized")),
    (("POST", GATEWAY, READER, CHAT), (403, "forbidden")),
    (("POST", GATEWAY, RUNNER, CHAT), (404, "not_found_error")),
    (("POST", GATEWAY, RUNNER, {**CHAT, "user": "x" * (2 * LIMIT)}), (413, "too_large")),
]


@pytest.fixture(params=[False, True], ids=["no-cors", "cors"])
def server(request, tmp_path) -> Iterator[tuple[ServerThread, bool]]:
    cors = request.param
    config = ServerConfig(
        db=str(tmp_path / "chain.db"),
        tokens=TOKENS,
        max_body_bytes=LIMIT,
        cors_origins=(ORIGIN,) if cors else (),
    )
    with ServerThread(config) as srv:
        yield srv, cors


def _send(url: str, method: str, path: str, token: str | None, body: object, **extra) -> httpx.Response:
    headers = {"origin": ORIGIN, **({"authorization": f"Bearer {token}"} if token else {})}
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30, **extra)


def _error_type(r: httpx.Response) -> str | None:
    if r.status_code < 400:
        return None
    return r.json()["error"]["type"]


@pytest.mark.parametrize(
    ("sent", "expected"), EXPECTED, ids=[f"{m} {p} {s}" for (m, p, _, _), (s, _) in EXPECTED]
)
def test_the_chain_answers_the_same_with_and_without_cors(server, sent, expected):
    srv, cors = server
    r = _send(srv.url, *sent)
    assert (r.status_code, _error_type(r)) == expected, r.text
    # CORS wraps the whole chain when configured (refusals too), and is absent otherwise
    assert r.headers.get("access-control-allow-origin") == (ORIGIN if cors else None)


@pytest.mark.parametrize("path", ["/api/rollouts", "/api/dequeue", GATEWAY])
def test_a_body_over_the_limit_without_a_declared_length_is_refused(server, path):
    """The body limit counts what comes, not only what the client declared."""
    srv, _ = server

    def chunks():
        yield b'{"worker_id": "'
        yield b"w" * (2 * LIMIT)
        yield b'"}'

    headers = {"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
    r = httpx.post(f"{srv.url}{path}", content=chunks(), headers=headers, timeout=30)
    assert (r.status_code, _error_type(r)) == (413, "too_large")


def test_an_error_in_a_fast_path_is_a_logged_500(server, monkeypatch, caplog):
    srv, cors = server

    async def broken(*args, **kwargs):
        raise RuntimeError("store on fire")

    monkeypatch.setattr(runner_fast, "claim_work", broken)
    r = _send(srv.url, "POST", "/api/dequeue", RUNNER, {"worker_id": "w"})
    assert (r.status_code, _error_type(r)) == (500, "internal_error")
    assert "store on fire" not in r.text
    assert any("unhandled error on POST /api/dequeue" in m for m in caplog.messages)
    assert r.headers.get("access-control-allow-origin") == (ORIGIN if cors else None)


def test_cors_preflight_is_answered_only_when_configured(server):
    srv, cors = server
    headers = {"origin": ORIGIN, "access-control-request-method": "POST"}
    for path in ("/api/rollouts", "/api/dequeue", GATEWAY):
        r = httpx.options(f"{srv.url}{path}", headers=headers, timeout=30)
        if cors:
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        else:
            assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers
