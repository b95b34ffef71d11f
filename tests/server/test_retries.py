"""Issue 18 over HTTP, against a real server on 127.0.0.1: a write sent again with its
``Idempotency-Key`` gets the first answer, an ended attempt's holder hears why, a task id keeps
its data, and trial resources are never the latest."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from agentbolt.server import ServerConfig, ServerThread


def _post(url: str, path: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"idempotency-key": key} if key is not None else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers)


def _tasks(n: int) -> dict[str, Any]:
    return {"rollouts": [{"task": {"data": {"i": i}}} for i in range(n)]}


def test_an_enqueue_without_ids_sent_again_with_its_key_returns_the_same_rollouts(server):
    first = _post(server.url, "/api/rollouts", _tasks(3), key="enqueue-1")
    again = _post(server.url, "/api/rollouts", _tasks(3), key="enqueue-1")
    assert first.status_code == again.status_code == 201
    assert [r["id"] for r in again.json()] == [r["id"] for r in first.json()]
    assert len({r["id"] for r in first.json()}) == 3
    assert len(httpx.get(f"{server.url}/api/rollouts").json()["items"]) == 3
    other = _post(server.url, "/api/rollouts", _tasks(3), key="enqueue-2")
    unkeyed = _post(server.url, "/api/rollouts", _tasks(3))
    assert len(httpx.get(f"{server.url}/api/rollouts").json()["items"]) == 9
    assert not {r["id"] for r in other.json() + unkeyed.json()} & {r["id"] for r in first.json()}


def test_a_dequeue_sent_again_with_its_key_gets_the_same_claim(server):
    _post(server.url, "/api/rollouts", _tasks(2))
    body = {"worker_id": "w1", "lease_seconds": 20}
    first = _post(server.url, "/api/dequeue", body, key="claim-1").json()
    again = _post(server.url, "/api/dequeue", body, key="claim-1").json()
    assert again == first and first["lease_seconds"] == 20
    stats = httpx.get(f"{server.url}/api/stats").json()["rollouts"]
    assert (stats["running"], stats["queued"]) == (1, 1)
    default = _post(server.url, "/api/dequeue", {"worker_id": "w1"}, key="claim-2").json()
    assert default["lease_seconds"] == 30  # the server's lease (the fixture's config)
    assert default["attempt"]["id"] != first["attempt"]["id"]


def test_a_finish_sent_again_with_its_key_gets_the_rollout_not_a_conflict(server):
    _post(server.url, "/api/rollouts", _tasks(1))
    aid = _post(server.url, "/api/dequeue", {"worker_id": "w1"}).json()["attempt"]["id"]
    finish = {"status": "succeeded", "reward": 0.5, "worker_id": "w1"}
    first = _post(server.url, f"/api/attempts/{aid}/finish", finish, key="finish-1")
    again = _post(server.url, f"/api/attempts/{aid}/finish", finish, key="finish-1")
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    other = _post(server.url, f"/api/attempts/{aid}/finish", finish, key="finish-2")
    assert other.status_code == 409
    assert other.json()["error"] == {
        "type": "AttemptEnded",
        "message": f"attempt {aid!r} is succeeded, not running",
    }


def test_a_publish_sent_again_with_its_key_gets_the_same_version(server):
    body = {"resources": {"p": {"type": "prompt_template", "template": "v1"}}}
    first = _post(server.url, "/api/resources", body, key="publish-1")
    again = _post(server.url, "/api/resources", body, key="publish-1")
    assert first.status_code == again.status_code == 201 and again.json() == first.json()
    assert [r["version"] for r in httpx.get(f"{server.url}/api/resources").json()["items"]] == [1]


@pytest.mark.parametrize("key", ["", "has space", "x" * 201, "clé"])
def test_a_malformed_key_is_a_422_naming_the_header(server, key):
    r = httpx.post(
        f"{server.url}/api/rollouts",
        json=_tasks(1),
        headers={"idempotency-key": key.encode()},  # bytes: httpx sends them as they are
    )
    assert r.status_code == 422 and "Idempotency-Key" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/api/rollouts").json()["items"] == []


def test_trial_resources_are_never_the_latest(server):
    url = server.url
    base = _post(url, "/api/resources", {"resources": {"p": {"type": "prompt_template", "template": "base"}}})
    trial = _post(
        url,
        "/api/resources",
        {"resources": {"p": {"type": "prompt_template", "template": "try"}}, "trial": True},
    )
    assert (base.json()["trial"], trial.json()["trial"]) == (False, True)
    assert httpx.get(f"{url}/api/resources/latest").json()["version"] == base.json()["version"]
    listed = httpx.get(f"{url}/api/resources").json()["items"]
    assert [(r["version"], r["trial"]) for r in listed] == [(2, True), (1, False)]
    _post(url, "/api/rollouts", {"rollouts": [{"task": {}}, {"task": {}, "resources_version": 2}]})
    claims = [_post(url, "/api/dequeue", {"worker_id": "w"}).json() for _ in range(2)]
    assert [c["resources"]["resources"]["p"]["template"] for c in claims] == ["base", "try"]


def test_a_task_id_enqueued_again_with_other_data_is_a_409_conflict(server):
    one = {"rollouts": [{"task": {"id": "t-1", "data": {"q": "2+2"}}}]}
    assert _post(server.url, "/api/rollouts", one).status_code == 201
    assert _post(server.url, "/api/rollouts", one).status_code == 201  # the same task: fine
    other = {"rollouts": [{"task": {"id": "t-1", "data": {"q": "3+3"}}}]}
    r = _post(server.url, "/api/rollouts", other)
    assert r.status_code == 409 and r.json()["error"]["type"] == "Conflict"
    assert "'t-1'" in r.json()["error"]["message"]
    assert len(httpx.get(f"{server.url}/api/rollouts").json()["items"]) == 2


def test_after_a_cancel_the_holder_of_the_attempt_hears_it_is_cancelled(server):
    url = server.url
    [rollout] = _post(url, "/api/rollouts", _tasks(1)).json()
    aid = _post(url, "/api/dequeue", {"worker_id": "w1"}).json()["attempt"]["id"]
    assert _post(url, f"/api/rollouts/{rollout['id']}/cancel", None).json()["status"] == "cancelled"
    for path, body in [
        ("heartbeat", {"worker_id": "w1"}),
        ("events", {"worker_id": "w1", "events": [{"sequence": 0, "type": "message"}]}),
        ("finish", {"worker_id": "w1", "status": "succeeded", "reward": 1}),
    ]:
        r = _post(url, f"/api/attempts/{aid}/{path}", body)
        assert r.status_code == 409, path
        assert r.json()["error"] == {
            "type": "AttemptEnded",
            "message": f"attempt {aid!r} is cancelled, not running",
        }
    assert httpx.get(f"{url}/api/attempts/{aid}").json()["status"] == "cancelled"
    assert httpx.get(f"{url}/api/workers").json()[0]["running"] == 0


def test_the_claim_carries_the_lease_the_server_was_started_with(tmp_path):
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=6.0)
    with ServerThread(config) as srv:
        _post(srv.url, "/api/rollouts", _tasks(1))
        claim = _post(srv.url, "/api/dequeue", {"worker_id": "w1"}).json()
    assert claim["lease_seconds"] == 6.0
    assert claim["attempt"]["lease_expires_at"] == pytest.approx(claim["attempt"]["started_at"] + 6.0)
