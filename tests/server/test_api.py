"""The HTTP API against a real uvicorn on 127.0.0.1: happy paths and every kind of bad input."""

from __future__ import annotations

import httpx
import pytest

from agentbolt.server import Role, ServerConfig, ServerThread


def _enqueue(url, n=1, **extra):
    body = {"rollouts": [{"task": {"data": {"i": i}}, **extra} for i in range(n)]}
    r = httpx.post(f"{url}/api/rollouts", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _claim(url, worker="w1"):
    r = httpx.post(f"{url}/api/dequeue", json={"worker_id": worker})
    assert r.status_code == 200
    return r.json()


def test_health_and_openapi(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path in (
        "/api/rollouts",
        "/api/dequeue",
        "/api/attempts/{attempt_id}/finish",
        "/api/resources",
        "/api/rollouts/{rollout_id}/events",
        "/api/rollouts/wait",
    ):
        assert path in spec["paths"], path


def test_full_cycle_over_http(server):
    url = server.url
    r = httpx.post(
        f"{url}/api/resources",
        json={"resources": {"system_prompt": {"type": "prompt_template", "template": "Be brief."}}},
    )
    assert r.status_code == 201 and r.json()["version"] == 1
    [rollout] = _enqueue(url)
    claim = _claim(url)
    assert claim["rollout"]["id"] == rollout["id"]
    assert claim["resources"]["resources"]["system_prompt"]["template"] == "Be brief."
    aid = claim["attempt"]["id"]
    events = {
        "events": [
            {"sequence": 0, "type": "message", "data": {"content": "hi"}},
            {"sequence": 1, "type": "reward", "data": {"value": 1}},
        ]
    }
    assert httpx.post(f"{url}/api/attempts/{aid}/events", json=events).json() == {"added": 2}
    assert httpx.post(f"{url}/api/attempts/{aid}/events", json=events).json() == {"added": 0}
    assert httpx.post(f"{url}/api/attempts/{aid}/heartbeat", json={}).status_code == 200
    done = httpx.post(f"{url}/api/attempts/{aid}/finish", json={"status": "succeeded", "reward": 1.0})
    assert done.json()["status"] == "succeeded"
    page = httpx.get(f"{url}/api/rollouts/{rollout['id']}/events").json()
    assert [e["type"] for e in page["items"]] == ["message", "reward"]
    waited = httpx.post(
        f"{url}/api/rollouts/wait", json={"rollout_ids": [rollout["id"]], "timeout": 1}
    ).json()
    assert waited["done"] is True
    assert httpx.get(f"{url}/api/stats").json()["rollouts"]["succeeded"] == 1
    assert httpx.get(f"{url}/api/workers").json()[0]["id"] == "w1"


def test_empty_queue_dequeues_null(server):
    r = httpx.post(f"{server.url}/api/dequeue", json={"worker_id": "w"})
    assert r.status_code == 200 and r.json() is None


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/api/rollouts", {"rollouts": []}, 422),
        ("POST", "/api/rollouts", {"rollouts": [{"task": {"data": {}}, "mode": "nonsense"}]}, 422),
        ("POST", "/api/rollouts", {"rollouts": [{"task": {"data": {}}, "max_attempts": 0}]}, 422),
        ("POST", "/api/rollouts", {"rollouts": [{"task": {"data": {}}, "unknown": 1}]}, 422),
        ("POST", "/api/rollouts", "not json", 422),
        ("GET", "/api/rollouts?status=bogus", None, 422),
        ("GET", "/api/rollouts?limit=0", None, 422),
        ("GET", "/api/rollouts?cursor=abc", None, 422),
        ("GET", "/api/rollouts/missing", None, 404),
        ("POST", "/api/rollouts/missing/cancel", None, 404),
        ("GET", "/api/rollouts/missing/attempts", None, 404),
        ("GET", "/api/rollouts/missing/events", None, 404),
        ("POST", "/api/rollouts/wait", {"rollout_ids": []}, 422),
        ("POST", "/api/events/query", {"rollout_ids": []}, 422),
        ("POST", "/api/events/query", {"rollout_ids": ["x"] * 1001}, 422),
        ("POST", "/api/events/query", {"rollout_ids": ["x"], "cursor": "abc"}, 422),
        ("POST", "/api/events/query", {"rollout_ids": ["x"], "limit": 0}, 422),
        ("POST", "/api/events/query", {"rollout_ids": "x"}, 422),
        ("POST", "/api/rollouts/wait", {"rollout_ids": ["x"], "timeout": 999}, 422),
        ("POST", "/api/dequeue", {}, 422),
        ("POST", "/api/dequeue", {"worker_id": "w", "lease_seconds": -1}, 422),
        ("GET", "/api/attempts/missing", None, 404),
        ("POST", "/api/attempts/missing/heartbeat", {}, 404),
        ("POST", "/api/attempts/missing/events", {"events": []}, 404),
        ("POST", "/api/attempts/missing/events", {"events": [{"type": ""}]}, 422),
        ("POST", "/api/attempts/missing/finish", {"status": "succeeded"}, 404),
        ("POST", "/api/attempts/missing/finish", {"status": "running"}, 422),
        ("POST", "/api/resources", {"resources": {"x": {"type": "unknown"}}}, 422),
        ("POST", "/api/resources", {}, 422),
        ("GET", "/api/resources/99", None, 404),
        ("GET", "/api/resources/abc", None, 422),
    ],
)
def test_bad_input_gets_a_clear_json_error(server, method, path, body, status):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.request(method, f"{server.url}{path}", **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/api/rollouts", "GET, POST"),
        ("DELETE", "/api/rollouts/wait", "POST"),  # not the GET of /api/rollouts/{rollout_id}
        ("GET", "/api/dequeue", "POST"),
        ("PUT", "/api/attempts/a1/finish", "POST"),
        ("POST", "/api/resources/latest", "GET"),
        ("GET", "/v1/traces", "POST"),
        ("POST", "/health", "GET"),
        ("POST", "/dashboard", "GET"),
    ],
)
def test_a_wrong_method_gets_405_with_every_method_the_path_takes(server, method, path, allow):
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.json()["error"]["type"] == "http_error"


def test_invalid_transitions_are_409_and_change_nothing(server):
    url = server.url
    [rollout] = _enqueue(url)
    aid = _claim(url)["attempt"]["id"]
    assert (
        httpx.post(f"{url}/api/attempts/{aid}/finish", json={"status": "failed", "error": "x"}).status_code
        == 200
    )
    again = httpx.post(f"{url}/api/attempts/{aid}/finish", json={"status": "succeeded", "reward": 1})
    assert again.status_code == 409
    assert again.json()["error"] == {
        "type": "AttemptEnded",
        "message": f"attempt {aid!r} is failed, not running",
    }
    late = httpx.post(f"{url}/api/attempts/{aid}/events", json={"events": [{"sequence": 0, "type": "x"}]})
    assert late.status_code == 409 and late.json()["error"]["type"] == "AttemptEnded"
    # the agent failed: the rollout failed at once (issue 18), and a failed rollout is final
    assert httpx.get(f"{url}/api/rollouts/{rollout['id']}").json()["status"] == "failed"
    refused = httpx.post(f"{url}/api/rollouts/{rollout['id']}/cancel")
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "InvalidTransition"
    assert httpx.get(f"{url}/api/rollouts/{rollout['id']}/events").json()["items"] == []
    # cancelling a cancelled rollout answers it again
    [queued] = _enqueue(url)
    first = httpx.post(f"{url}/api/rollouts/{queued['id']}/cancel")
    second = httpx.post(f"{url}/api/rollouts/{queued['id']}/cancel")
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json() and second.json()["status"] == "cancelled"


def test_non_finite_reward_is_rejected_without_a_partial_write(server):
    url = server.url
    [rollout] = _enqueue(url)
    aid = _claim(url)["attempt"]["id"]
    r = httpx.post(
        f"{url}/api/attempts/{aid}/finish",
        content=b'{"status": "succeeded", "reward": NaN}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422
    assert httpx.get(f"{url}/api/rollouts/{rollout['id']}").json()["status"] == "running"


def test_wrong_worker_cannot_touch_an_attempt(server):
    url = server.url
    _enqueue(url)
    aid = _claim(url, "owner")["attempt"]["id"]
    r = httpx.post(f"{url}/api/attempts/{aid}/finish", json={"status": "succeeded", "worker_id": "intruder"})
    assert r.status_code == 409
    assert "another worker" in r.json()["error"]["message"]


def test_enqueue_is_idempotent_with_ids(server):
    first = _enqueue(server.url, id="fixed-id")
    second = _enqueue(server.url, id="fixed-id")
    assert first[0]["id"] == second[0]["id"] == "fixed-id"
    assert len(httpx.get(f"{server.url}/api/rollouts").json()["items"]) == 1


def test_pagination_walks_every_rollout_once(server):
    _enqueue(server.url, n=25)
    seen, cursor = [], None
    while True:
        params = {"limit": 10, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{server.url}/api/rollouts", params=params).json()
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) == 25


def test_oversized_body_gets_413(tmp_path):
    config = ServerConfig(db=str(tmp_path / "s.db"), max_body_bytes=1000)
    with ServerThread(config) as srv:
        big = {"rollouts": [{"task": {"data": {"blob": "x" * 5000}}}]}
        r = httpx.post(f"{srv.url}/api/rollouts", json=big)
        assert r.status_code == 413 and "larger" in r.json()["error"]["message"]

        def chunks():
            yield b'{"rollouts": [{"task": {"data": {"blob": "'
            yield b"x" * 5000
            yield b'"}}}]}'

        r = httpx.post(
            f"{srv.url}/api/rollouts", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert httpx.get(f"{srv.url}/api/rollouts").json()["items"] == []


def test_auth_roles(tmp_path):
    tokens = {"adm": Role.ADMIN, "run": Role.RUNNER, "read": Role.READER}
    with ServerThread(ServerConfig(db=str(tmp_path / "a.db"), tokens=tokens)) as srv:
        url = srv.url

        def h(t):
            return {"authorization": f"Bearer {t}"}

        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/api/rollouts").status_code == 401
        assert httpx.get(f"{url}/api/rollouts", headers=h("wrong")).status_code == 401
        assert httpx.get(f"{url}/api/rollouts", headers=h("read")).status_code == 200
        body = {"rollouts": [{"task": {"data": {}}}]}
        assert httpx.post(f"{url}/api/rollouts", json=body, headers=h("read")).status_code == 403
        assert httpx.post(f"{url}/api/rollouts", json=body, headers=h("run")).status_code == 403
        assert httpx.post(f"{url}/api/rollouts", json=body, headers=h("adm")).status_code == 201
        assert httpx.post(f"{url}/api/dequeue", json={"worker_id": "w"}, headers=h("read")).status_code == 403
        assert httpx.post(f"{url}/api/dequeue", json={"worker_id": "w"}, headers=h("run")).json() is not None


def test_cors_is_off_by_default(server):
    r = httpx.options(
        f"{server.url}/api/rollouts",
        headers={"origin": "http://evil.example", "access-control-request-method": "GET"},
    )
    assert "access-control-allow-origin" not in r.headers
