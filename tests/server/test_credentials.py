"""Issued credentials (issue 14, item 2): each attempt's agent key authorises only its own
gateway routes and events URL, and worker tokens bind a runner to the worker id the server
issued. Every forbidden action is tried against a real server on 127.0.0.1, with and without
configured tokens."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.schemas import LLM, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread

ADMIN, RUNNER, READER = "adm-token-5c1e", "run-token-8d2f", "read-token-3b7a"
TOKENS = {ADMIN: Role.ADMIN, RUNNER: Role.RUNNER, READER: Role.READER}
MESSAGES = [{"role": "user", "content": "hi"}]


def _h(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


@dataclass
class Site:
    """A server, its upstream double, and the tokens a runner and an admin use there."""

    server: ServerThread
    runner: str | None
    admin: str | None

    @property
    def url(self) -> str:
        return self.server.url

    def claim(self, worker: str = "w1", lease_seconds: float | None = None) -> dict:
        """One rollout enqueued and claimed: the claim as the runner received it."""
        with Client(self.url, self.admin) as admin:
            admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
        body = {"worker_id": worker, "lease_seconds": lease_seconds}
        claim = httpx.post(f"{self.url}/api/dequeue", json=body, headers=_h(self.runner)).json()
        assert claim is not None
        return claim


def _site(tmp_path, upstream, tokens: dict[str, Role]) -> Iterator[Site]:
    config = ServerConfig(db=str(tmp_path / "cred.db"), tokens=tokens, sweep_interval=0.1)
    with ServerThread(config) as srv:
        admin = ADMIN if tokens else None
        with Client(srv.url, admin) as client:
            client.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
        yield Site(srv, RUNNER if tokens else None, admin)


@pytest.fixture(params=["tokens", "no-tokens"])
def site(request, tmp_path, upstream) -> Iterator[Site]:
    """Both ways a server runs: with configured tokens, and with none (loopback use)."""
    yield from _site(tmp_path, upstream, TOKENS if request.param == "tokens" else {})


@pytest.fixture
def secure(tmp_path, upstream) -> Iterator[Site]:
    yield from _site(tmp_path, upstream, TOKENS)


def _gateway(claim: dict) -> str:
    return claim["resources"]["resources"]["llm"]["base_url"]


def _events_url(url: str, claim: dict) -> str:
    return f"{url}/agent/{claim['rollout']['id']}/{claim['attempt']['id']}/events"


def _chat(claim: dict, key: str | None, gateway: str | None = None) -> httpx.Response:
    body = {"model": "double", "messages": MESSAGES}
    return httpx.post(
        f"{gateway or _gateway(claim)}/chat/completions", json=body, headers=_h(key), timeout=30
    )


def _error(r: httpx.Response) -> tuple[str, str]:
    return r.json()["error"]["type"], r.json()["error"]["message"]


# ---------------------------------------------------------------------------- K1: the agent key


def test_the_claims_llm_api_key_is_the_agent_key_never_a_runner_or_admin_token(secure):
    claims = [secure.claim()]
    with Client(secure.url, ADMIN) as admin:  # an admin's dequeue gets an agent key too
        admin.enqueue([RolloutCreate(task=Task())])
        claims.append(admin.dequeue("w2").model_dump(mode="json"))
    keys = [c["agent_key"] for c in claims]
    for claim, key in zip(claims, keys, strict=True):
        assert key.startswith("ak_") and len(key) == 35
        assert claim["resources"]["resources"]["llm"]["api_key"] == key
        assert RUNNER not in json.dumps(claim) and ADMIN not in json.dumps(claim)
    assert keys[0] != keys[1]
    attempt = httpx.get(f"{secure.url}/api/attempts/{claims[0]['attempt']['id']}", headers=_h(ADMIN))
    assert keys[0] not in attempt.text  # served only to the runner that claimed it


def test_the_agent_key_calls_its_own_gateway_and_events_url(site):
    claim = site.claim()
    key = claim["agent_key"]
    answer = _chat(claim, key)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    models = httpx.get(f"{_gateway(claim)}/models", headers=_h(key))
    assert models.status_code == 200
    r = httpx.post(_events_url(site.url, claim), json={"reward": 0.5, "name": "judge"}, headers=_h(key))
    assert r.status_code == 200 and r.json() == {"added": 1}
    events = httpx.get(f"{site.url}/api/rollouts/{claim['rollout']['id']}/events", headers=_h(site.admin))
    kinds = [(e["type"], e["data"].get("value"), e["data"].get("name")) for e in events.json()["items"]]
    assert ("reward", 0.5, "judge") in kinds and any(k[0] == "llm_call" for k in kinds)


# ---------------------------------------------------------------------------- K2: what it may not do


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/api/rollouts", None),
        ("GET", "/api/resources/latest", None),
        ("GET", "/api/stats", None),
        ("GET", "/api/workers", None),
        ("GET", "/api/rollouts/{rollout}/events", None),
        ("POST", "/api/events/query", {"rollout_ids": ["{rollout}"]}),
        ("POST", "/api/dequeue", {"worker_id": "w1"}),
        ("POST", "/api/attempts/{attempt}/finish", {"status": "succeeded", "worker_id": "w1"}),
        ("POST", "/api/attempts/{attempt}/events", {"events": [], "worker_id": "w1"}),
        ("POST", "/api/resources", {"resources": {}}),
        ("POST", "/api/workers/register", {}),
        ("POST", "/v1/traces", {}),
    ],
)
def test_an_agent_key_is_refused_on_every_api_route(site, method, path, body):
    claim = site.claim()
    ids = {"rollout": claim["rollout"]["id"], "attempt": claim["attempt"]["id"]}
    url = site.url + path.format(**ids)
    content = json.dumps(body).replace("{rollout}", ids["rollout"]) if body is not None else None
    headers = {**_h(claim["agent_key"]), "content-type": "application/json"}
    r = httpx.request(method, url, content=content, headers=headers)
    assert r.status_code == 403, r.text
    kind, message = _error(r)
    assert kind == "forbidden" and "its own attempt" in message


def test_an_agent_key_is_refused_on_another_attempts_gateway_and_events_url(site):
    mine, other = site.claim("w1"), site.claim("w2")
    key = mine["agent_key"]
    for r in (
        _chat(other, key),
        httpx.get(f"{_gateway(other)}/models", headers=_h(key)),
        httpx.post(_events_url(site.url, other), json={"reward": 1}, headers=_h(key)),
        # its own attempt id under another rollout is not its path either
        httpx.post(
            f"{site.url}/agent/{other['rollout']['id']}/{mine['attempt']['id']}/events",
            json={"reward": 1},
            headers=_h(key),
        ),
    ):
        assert r.status_code == 403, r.text
    events = httpx.get(f"{site.url}/api/rollouts/{other['rollout']['id']}/events", headers=_h(site.admin))
    assert events.json()["items"] == []  # nothing reached the other attempt


@pytest.mark.parametrize("key", ["ak_" + "x" * 32, "wt_" + "y" * 32])
def test_an_unknown_issued_credential_is_401(site, key):
    claim = site.claim()
    for r in (
        _chat(claim, key),
        httpx.post(_events_url(site.url, claim), json={"reward": 1}, headers=_h(key)),
        httpx.get(f"{site.url}/api/rollouts", headers=_h(key)),
    ):
        assert r.status_code == 401, r.text
        assert _error(r)[0] == "unauthorized"


def _end(site: Site, claim: dict, how: str) -> str:
    """End the attempt as ``how`` says; the attempt's status afterwards."""
    aid, rid = claim["attempt"]["id"], claim["rollout"]["id"]
    if how == "finished":
        body = {"status": "succeeded", "reward": 1.0, "worker_id": "w1"}
        assert (
            httpx.post(
                f"{site.url}/api/attempts/{aid}/finish", json=body, headers=_h(site.runner)
            ).status_code
            == 200
        )
        return "succeeded"
    if how == "cancelled":
        assert httpx.post(f"{site.url}/api/rollouts/{rid}/cancel", headers=_h(site.admin)).status_code == 200
        return "cancelled"
    deadline = time.monotonic() + 10  # lease lost: the sweep ends it
    while time.monotonic() < deadline:
        status = httpx.get(f"{site.url}/api/attempts/{aid}", headers=_h(site.admin)).json()["status"]
        if status != "running":
            return status
        time.sleep(0.1)
    raise AssertionError("the lease never lapsed")


@pytest.mark.parametrize("how", ["finished", "cancelled", "lease lost"])
def test_the_agent_key_after_its_attempt_ended_is_409_naming_the_state(site, how):
    claim = site.claim(lease_seconds=0.5 if how == "lease lost" else None)
    key = claim["agent_key"]
    status = _end(site, claim, how)
    assert status in ("succeeded", "cancelled", "lease_expired")
    for r in (
        _chat(claim, key),
        httpx.post(_events_url(site.url, claim), json={"reward": 1}, headers=_h(key)),
    ):
        assert r.status_code == 409, r.text
        kind, message = _error(r)
        assert kind == "AttemptEnded" and status in message


# ---------------------------------------------------------------------------- K3: the events URL


def test_the_events_url_takes_the_curl_line_of_the_docs(site):
    claim = site.claim()
    env_key, events_url = claim["agent_key"], _events_url(site.url, claim)
    if shutil.which("curl"):
        argv = [
            "curl",
            "-sS",
            "-H",
            f"Authorization: Bearer {env_key}",
            "-H",
            "content-type: application/json",
        ]
        out = subprocess.run(
            [*argv, "-d", '{"reward": 1}', events_url], capture_output=True, text=True, timeout=30
        )
        answer = json.loads(out.stdout)
    else:
        headers = {**_h(env_key), "content-type": "application/json"}
        answer = httpx.post(events_url, content=b'{"reward": 1}', headers=headers).json()
    assert answer == {"added": 1}
    events = httpx.get(f"{site.url}/api/rollouts/{claim['rollout']['id']}/events", headers=_h(site.admin))
    [event] = events.json()["items"]
    assert event["type"] == "reward" and event["data"] == {"value": 1.0}
    assert event["attempt_id"] == claim["attempt"]["id"]


def test_the_events_url_takes_a_list_and_honours_the_idempotency_key(site):
    claim = site.claim()
    body = [
        {"type": "message", "data": {"text": "step 1"}},
        {"reward": 0.25, "name": "tests"},
        {"type": "reward", "data": {"value": 2, "name": "style"}},
    ]
    headers = {**_h(claim["agent_key"]), "idempotency-key": "post-1"}
    first = httpx.post(_events_url(site.url, claim), json=body, headers=headers)
    again = httpx.post(_events_url(site.url, claim), json=body, headers=headers)
    assert first.json() == {"added": 3} and again.json() == {"added": 3}  # the first answer
    other = httpx.post(
        _events_url(site.url, claim), json=body[:1], headers={**headers, "idempotency-key": "post-2"}
    )
    assert other.json() == {"added": 1}
    items = httpx.get(
        f"{site.url}/api/rollouts/{claim['rollout']['id']}/events", headers=_h(site.admin)
    ).json()["items"]
    assert [(e["type"], e["data"]) for e in items] == [
        ("message", {"text": "step 1"}),
        ("reward", {"value": 0.25, "name": "tests"}),
        ("reward", {"value": 2, "name": "style"}),
        ("message", {"text": "step 1"}),
    ]
    # the runner numbers its own events from 0: the agent's never take those numbers
    runner_event = {"events": [{"sequence": 0, "type": "message"}], "worker_id": "w1"}
    added = httpx.post(
        f"{site.url}/api/attempts/{claim['attempt']['id']}/events", json=runner_event, headers=_h(site.runner)
    )
    assert added.json() == {"added": 1}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ('{"reward": NaN}', "finite number"),
        ('{"reward": Infinity}', "finite number"),
        ('{"reward": 1e999}', "finite number"),
        ('{"reward": "1"}', "number"),
        ('{"type": "reward", "data": {"value": NaN}}', "finite number"),
        ('{"kind": "message"}', "type: Field required"),
        ("{}", "type: Field required"),
        ('{"reward": 1, "type": "message"}', "type: Extra inputs are not permitted"),
        ('{"reward": 1, "data": {}}', "data: Extra inputs are not permitted"),
        ('[{"reward": 1}, 5]', "body.1"),
        ('"hello"', "body"),
    ],
)
def test_a_malformed_event_is_a_422_with_a_message_and_stores_nothing(site, raw, says):
    claim = site.claim()
    headers = {**_h(claim["agent_key"]), "content-type": "application/json"}
    r = httpx.post(_events_url(site.url, claim), content=raw.encode(), headers=headers)
    assert r.status_code == 422, r.text
    kind, message = _error(r)
    assert kind == "validation_error" and says in message, message
    events = httpx.get(f"{site.url}/api/rollouts/{claim['rollout']['id']}/events", headers=_h(site.admin))
    assert events.json()["items"] == []


def test_without_configured_tokens_the_gateway_and_events_url_need_no_key(tmp_path, upstream):
    for site in _site(tmp_path, upstream, {}):
        claim = site.claim()
        assert _chat(claim, None).status_code == 200
        assert _chat(claim, "any-old-key").status_code == 200  # clients that insist on some key
        r = httpx.post(_events_url(site.url, claim), json={"reward": 1})
        assert r.json() == {"added": 1}


def test_runner_and_admin_tokens_may_post_to_the_events_url(secure):
    claim = secure.claim()
    for token in (RUNNER, ADMIN):
        r = httpx.post(_events_url(secure.url, claim), json={"reward": 1}, headers=_h(token))
        assert r.json() == {"added": 1}
    r = httpx.post(_events_url(secure.url, claim), json={"reward": 1}, headers=_h(READER))
    assert r.status_code == 403
    r = httpx.post(
        f"{secure.url}/agent/ro-other/{claim['attempt']['id']}/events", json={"reward": 1}, headers=_h(ADMIN)
    )
    assert r.status_code == 404


# ---------------------------------------------------------------------------- K4: worker identity


def _register(url: str, token: str | None, name: str | None = "host-1") -> httpx.Response:
    return httpx.post(f"{url}/api/workers/register", json={"name": name}, headers=_h(token))


def test_runner_and_admin_tokens_register_workers_readers_cannot(secure):
    ids = set()
    for token in (RUNNER, ADMIN):
        r = _register(secure.url, token)
        assert r.status_code == 201, r.text
        issued = r.json()
        assert issued["worker_id"].startswith("host-1-") and issued["worker_token"].startswith("wt_")
        ids.add(issued["worker_id"])
    assert len(ids) == 2  # the same hint never gives the same id
    assert _register(secure.url, READER).status_code == 403
    assert _register(secure.url, None).status_code == 401
    token = _register(secure.url, RUNNER).json()["worker_token"]
    r = _register(secure.url, token)
    assert r.status_code == 403 and "cannot register another worker" in _error(r)[1]
    listed = httpx.get(f"{secure.url}/api/workers", headers=_h(ADMIN)).text
    assert token not in listed and "wt_" not in listed


@pytest.mark.parametrize(
    ("action", "body"),
    [("heartbeat", {}), ("events", {"events": [{"type": "message"}]}), ("finish", {"status": "succeeded"})],
)
def test_a_worker_token_acts_only_for_its_own_worker(secure, action, body):
    issued = _register(secure.url, RUNNER).json()
    mine, token = issued["worker_id"], issued["worker_token"]
    with Client(secure.url, ADMIN) as admin:
        admin.enqueue([RolloutCreate(task=Task()), RolloutCreate(task=Task())])
    r = httpx.post(f"{secure.url}/api/dequeue", json={"worker_id": "someone-else"}, headers=_h(token))
    assert r.status_code == 403 and "cannot act for 'someone-else'" in _error(r)[1]
    claim = httpx.post(f"{secure.url}/api/dequeue", json={"worker_id": mine}, headers=_h(token)).json()
    assert claim["attempt"]["worker_id"] == mine
    # another runner's attempt: a worker token may not name that runner
    theirs = httpx.post(f"{secure.url}/api/dequeue", json={"worker_id": "w-other"}, headers=_h(RUNNER)).json()
    post = f"{secure.url}/api/attempts/{theirs['attempt']['id']}/{action}"
    r = httpx.post(post, json={**body, "worker_id": "w-other"}, headers=_h(token))
    assert r.status_code == 403, r.text
    r = httpx.post(post, json=body, headers=_h(token))  # its own worker: not the holder
    assert r.status_code == 409 and "another worker" in _error(r)[1]
    own = f"{secure.url}/api/attempts/{claim['attempt']['id']}/{action}"
    assert httpx.post(own, json=body, headers=_h(token)).status_code == 200  # worker_id left out
    state = httpx.get(f"{secure.url}/api/attempts/{theirs['attempt']['id']}", headers=_h(ADMIN)).json()
    assert state["status"] == "running"  # the refused writes changed nothing


def test_a_worker_token_uses_only_its_own_workers_gateways(secure):
    issued = _register(secure.url, RUNNER).json()
    token = issued["worker_token"]
    mine, theirs = secure.claim(issued["worker_id"]), secure.claim("w-other")
    assert _chat(mine, token).status_code == 200
    r = _chat(theirs, token)
    assert r.status_code == 403 and "does not hold this attempt" in _error(r)[1]
    assert httpx.get(f"{_gateway(theirs)}/models", headers=_h(token)).status_code == 403
    assert _chat(theirs, RUNNER).status_code == 200  # a plain runner token is not bound (compatibility)
    r = httpx.post(_events_url(secure.url, theirs), json={"reward": 1}, headers=_h(token))
    assert r.status_code == 409 and "another worker" in _error(r)[1]


def test_a_worker_token_has_no_admin_rights(secure):
    token = _register(secure.url, RUNNER).json()["worker_token"]
    body = {"resources": {"p": {"type": "prompt_template", "template": "x"}}}
    assert httpx.post(f"{secure.url}/api/resources", json=body, headers=_h(token)).status_code == 403
    assert httpx.post(f"{secure.url}/api/rollouts/x/cancel", headers=_h(token)).status_code == 403
    assert (
        httpx.get(f"{secure.url}/api/rollouts", headers=_h(token)).status_code == 200
    )  # reads, like a runner


def test_a_registered_client_claims_as_its_worker(secure):
    with Client(secure.url, RUNNER) as runner, Client(secure.url, ADMIN) as admin:
        registration = runner.register_worker("trainer-runner")
        assert registration is not None and runner.token == registration.worker_token
        admin.enqueue([RolloutCreate(task=Task())])
        claim = runner.dequeue(registration.worker_id)
        assert claim is not None and claim.attempt.worker_id == registration.worker_id
        assert math.isclose(claim.lease_seconds or 0, 30.0)


def test_gateway_url_follows_the_balancers_scheme_and_host(secure):
    """Behind a TLS-terminating balancer (a trusted peer: uvicorn trusts 127.0.0.1 unless
    FORWARDED_ALLOW_IPS says otherwise) the claim hands the agent an https gateway URL on the
    public host, not the replica's own plain-http address."""
    with Client(secure.url, secure.admin) as admin:
        admin.enqueue([RolloutCreate(task=Task(data={"q": 1}))])
    headers = {**_h(secure.runner), "x-forwarded-proto": "https", "host": "agents.example.com"}
    claim = httpx.post(f"{secure.url}/api/dequeue", json={"worker_id": "w1"}, headers=headers).json()
    assert _gateway(claim).startswith("https://agents.example.com/gateway/")


# ---------------------------------------------------------------------------- revocation, expiry


def test_a_revoked_workers_token_is_refused_at_once_and_its_attempts_move_on(secure):
    issued = _register(secure.url, RUNNER).json()
    wid, token = issued["worker_id"], issued["worker_token"]
    claim = secure.claim(wid)  # the runner token names it; then its own token, so that it is cached
    attempt = f"{secure.url}/api/attempts/{claim['attempt']['id']}"
    assert httpx.post(f"{attempt}/heartbeat", json={}, headers=_h(token)).status_code == 200
    revoke = f"{secure.url}/api/workers/{wid}/revoke"
    for who in (RUNNER, READER, token):
        assert httpx.post(revoke, headers=_h(who)).status_code == 403
    r = httpx.post(revoke, headers=_h(ADMIN))
    assert r.status_code == 200 and r.json()["id"] == wid and r.json()["revoked_at"] > 0
    revoked_at = r.json()["revoked_at"]
    # the very next call with its token (cached as valid a moment ago) is refused, and says why
    r = httpx.post(f"{attempt}/heartbeat", json={}, headers=_h(token))
    assert r.status_code == 401 and _error(r)[0] == "WorkerRevoked" and "revoked" in _error(r)[1]
    # its running attempt ended as after a lapsed lease, with the reason; the rollout is queued again
    with Client(secure.url, ADMIN) as admin:
        [ended] = admin.list_attempts(claim["rollout"]["id"])
        assert ended.status.value == "lease_expired" and f"worker {wid!r} was revoked" in (ended.error or "")
        assert admin.get_rollout(claim["rollout"]["id"]).status.value == "queued"
        # no token may claim under its id: the plain runner token naming it is refused too,
        # and the claim it tried is rolled back
        r = httpx.post(f"{secure.url}/api/dequeue", json={"worker_id": wid}, headers=_h(RUNNER))
        assert r.status_code == 401 and _error(r)[0] == "WorkerRevoked"
        assert admin.get_rollout(claim["rollout"]["id"]).status.value == "queued"
        [listed] = [w for w in admin.list_workers() if w.id == wid]
        assert listed.revoked_at == revoked_at and listed.running == 0
        again = admin.revoke_worker(wid)  # revoking again changes nothing
        assert again.revoked_at == revoked_at
    r = httpx.post(f"{secure.url}/api/workers/nobody-1/revoke", headers=_h(ADMIN))
    assert r.status_code == 404 and "nobody-1" in _error(r)[1]


def test_a_runner_token_cannot_revoke_a_worker_whose_id_starts_with_register(secure):
    wid = _register(secure.url, RUNNER, name="register").json()["worker_id"]
    assert wid.startswith("register-")
    r = httpx.post(f"{secure.url}/api/workers/{wid}/revoke", headers=_h(RUNNER))
    assert r.status_code == 403


def test_a_worker_token_expires_when_its_worker_goes_unseen(tmp_path, upstream, monkeypatch):
    from agentbolt.server import middleware

    monkeypatch.setattr(middleware, "RECHECK_S", 0.2)  # look tokens up again soon
    config = ServerConfig(db=str(tmp_path / "ttl.db"), tokens=TOKENS, worker_token_ttl=1.5)
    with ServerThread(config) as srv:
        busy, idle = (_register(srv.url, RUNNER).json() for _ in range(2))
        assert busy["token_ttl_seconds"] == idle["token_ttl_seconds"] == 1.5  # the runner beats within it
        dequeue = f"{srv.url}/api/dequeue"
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # one keeps being seen (an empty dequeue counts)
            r = httpx.post(dequeue, json={"worker_id": busy["worker_id"]}, headers=_h(busy["worker_token"]))
            assert r.status_code == 200, r.text
            time.sleep(0.3)
        r = httpx.post(dequeue, json={"worker_id": idle["worker_id"]}, headers=_h(idle["worker_token"]))
        assert r.status_code == 401 and _error(r)[0] == "WorkerTokenExpired"
        assert "register again" in _error(r)[1]
        # the runner token it enrolled with registers again: a new identity that works
        with Client(srv.url, RUNNER) as runner:
            runner.register_worker("host-1")
            again = runner.register_worker("host-1")  # after a registration: still the runner token
            assert again is not None and runner.token == again.worker_token
            assert runner.dequeue(again.worker_id) is None


def test_registered_runners_only_leaves_the_runner_token_reads_and_registration(tmp_path, upstream):
    config = ServerConfig(db=str(tmp_path / "strict.db"), tokens=TOKENS, registered_runners_only=True)
    with ServerThread(config) as srv:
        with Client(srv.url, ADMIN) as admin:
            [ro] = admin.enqueue([RolloutCreate(task=Task())])
        refused = [
            httpx.post(f"{srv.url}/api/dequeue", json={"worker_id": "w1"}, headers=_h(RUNNER)),
            httpx.post(
                f"{srv.url}/api/attempts/at-x/heartbeat", json={"worker_id": "w1"}, headers=_h(RUNNER)
            ),
            httpx.post(f"{srv.url}/v1/traces", json={}, headers=_h(RUNNER)),
        ]
        for r in refused:
            assert r.status_code == 403 and "registered runners" in _error(r)[1], r.text
        assert httpx.get(f"{srv.url}/api/rollouts", headers=_h(RUNNER)).status_code == 200
        r = httpx.post(
            f"{srv.url}/api/rollouts/wait", json={"rollout_ids": [ro.id], "timeout": 0}, headers=_h(RUNNER)
        )
        assert r.status_code == 200  # a POST that only reads
        issued = _register(srv.url, RUNNER).json()
        body = {"worker_id": issued["worker_id"]}
        claim = httpx.post(f"{srv.url}/api/dequeue", json=body, headers=_h(issued["worker_token"])).json()
        assert claim["attempt"]["worker_id"] == issued["worker_id"]
        with Client(srv.url, ADMIN) as admin:  # the admin token is not affected
            assert admin.dequeue("w-admin") is None
