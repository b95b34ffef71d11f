"""Named rewards over HTTP, against a real server on 127.0.0.1 with every kind of token: who may
score (reviewer, evaluator, admin) and who may not (reader, runner, an agent key), as whom a
score is stored, the 404/409/422 answers and their messages, the pending queue, idempotent
retries, and the sync and async clients."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from agentbolt.client import AsyncClient, Client
from agentbolt.errors import Conflict, InvalidInput, NotFound
from agentbolt.schemas import (
    AttemptStatus,
    AwaitedReward,
    RewardCreate,
    RewardScale,
    RewardSource,
    RewardState,
    Rollout,
    RolloutCreate,
    Task,
)
from agentbolt.server import Role, ServerConfig, ServerThread
from agentbolt.server.run import free_port, wait_healthy

ADMIN, RUNNER, READER = "adm-7f1c", "run-2b9e", "read-4d0a"
ALICE, BOB, EVALUATOR = "rev-alice-81a3", "rev-bob-3c5e", "eval-66d2"
TOKENS = {
    ADMIN: Role.ADMIN,
    RUNNER: Role.RUNNER,
    READER: Role.READER,
    ALICE: Role.REVIEWER,
    BOB: Role.REVIEWER,
    EVALUATOR: Role.EVALUATOR,
}
NAMES = {ALICE: "alice", BOB: "bob"}
STARS = RewardScale(low=1, high=5, step=1)
AWAITED = [
    AwaitedReward(name="human", source=RewardSource.REVIEWER, scale=STARS),
    AwaitedReward(name="judge", source=RewardSource.EVALUATOR),
]


def _h(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


@dataclass
class Site:
    server: ServerThread
    admin: Client

    @property
    def url(self) -> str:
        return self.server.url

    def finished(self, n: int = 1, status: AttemptStatus = AttemptStatus.SUCCEEDED) -> list[Rollout]:
        """``n`` rollouts awaiting a human and a judge score, run to the end."""
        items = [RolloutCreate(task=Task(data={"i": i}), await_rewards=AWAITED) for i in range(n)]
        rollouts = self.admin.enqueue(items)
        for _ in rollouts:
            claim = self.admin.dequeue("w1")
            assert claim is not None
            self.admin.finish(
                claim.attempt.id, status, reward=1.0, error="boom" if status != "succeeded" else None
            )
        return [self.admin.get_rollout(r.id) for r in rollouts]

    def score(
        self, token: str | None, rollout_id: str, key: str | None = None, **body: object
    ) -> httpx.Response:
        headers = {**_h(token), **({"idempotency-key": key} if key else {})}
        return httpx.post(f"{self.url}/api/rollouts/{rollout_id}/rewards", json=body, headers=headers)


def _error(response: httpx.Response) -> tuple[str, str]:
    error = response.json()["error"]
    return error["type"], error["message"]


@pytest.fixture
def site(tmp_path) -> Iterator[Site]:
    config = ServerConfig(db=str(tmp_path / "rewards.db"), tokens=TOKENS, token_names=NAMES)
    with ServerThread(config) as server, Client(server.url, ADMIN) as admin:
        yield Site(server, admin)


def test_reviewer_scores_as_its_token_name(site: Site) -> None:
    (rollout,) = site.finished()
    r = site.score(
        ALICE, rollout.id, name="human", score=4, comment="clear", author="mallory", source="evaluator"
    )
    assert r.status_code == 201, r.text
    slot = r.json()
    assert (slot["author"], slot["source"], slot["revision"], slot["value"]) == ("alice", "reviewer", 1, 0.75)
    # bob rescores what he saw (revision 1); the history keeps both
    r = site.score(BOB, rollout.id, name="human", score=2, replaces=1)
    assert r.status_code == 201 and r.json()["author"] == "bob"
    history = httpx.get(f"{site.url}/api/rollouts/{rollout.id}/rewards?name=human", headers=_h(ALICE)).json()
    assert [(h["revision"], h["score"], h["author"]) for h in history] == [(1, 4, "alice"), (2, 2, "bob")]
    # a reviewer cannot give the judge's reward
    r = site.score(ALICE, rollout.id, name="judge", score=1)
    assert r.status_code == 403 and _error(r) == (
        "Forbidden",
        "reward 'judge' is given by evaluators, not by reviewers",
    )
    info = httpx.get(f"{site.url}/api/dashboard/info", headers=_h(BOB)).json()
    assert (info["role"], info["name"]) == ("reviewer", "bob")


def test_evaluator_scores_as_the_judge_it_names(site: Site) -> None:
    (rollout,) = site.finished()
    r = site.score(
        EVALUATOR, rollout.id, name="judge", score=0.8, author="rubric-judge", data={"reason": "ok"}
    )
    assert r.status_code == 201, r.text
    assert (r.json()["author"], r.json()["source"], r.json()["data"]) == (
        "rubric-judge",
        "evaluator",
        {"reason": "ok"},
    )
    r = site.score(EVALUATOR, rollout.id, name="fn", score=1)  # not awaited: a new evaluator slot
    assert r.status_code == 201 and r.json()["author"] == "evaluator"
    r = site.score(EVALUATOR, rollout.id, name="human", score=5)
    assert r.status_code == 403 and "given by reviewers" in _error(r)[1]
    got = site.admin.get_rollout(rollout.id)
    assert set(got.rewards) == {"human", "judge", "fn"} and got.pending_rewards == ["human"]


def test_admin_scores_as_the_slot_or_the_body_says(site: Site) -> None:
    (rollout,) = site.finished()
    slot = site.admin.add_reward(rollout.id, RewardCreate(name="human", score=3))
    assert (slot.source, slot.author) == (RewardSource.REVIEWER, "admin")
    slot = site.admin.add_reward(rollout.id, RewardCreate(name="extra", score=0.5, author="script"))
    assert (slot.source, slot.author) == (RewardSource.EVALUATOR, "script")
    slot = site.admin.add_reward(
        rollout.id, RewardCreate(name="panel", score=1, source=RewardSource.REVIEWER)
    )
    assert slot.source == RewardSource.REVIEWER


def test_readers_runners_and_agents_cannot_score(site: Site) -> None:
    items = [RolloutCreate(task=Task(data={"q": 1}), await_rewards=AWAITED)]
    (rollout,) = site.admin.enqueue(items)
    claim = site.admin.dequeue("w1")
    assert claim is not None and claim.agent_key
    agent_key = claim.agent_key
    site.admin.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, reward=1.0)
    for token, role in ((READER, "reader"), (RUNNER, "runner")):
        r = site.score(token, rollout.id, name="human", score=3)
        assert r.status_code == 403 and f"role {role!r} may not POST" in _error(r)[1], r.text
    r = site.score(agent_key, rollout.id, name="human", score=3)
    assert r.status_code == 403 and "an agent key may only call its own attempt" in _error(r)[1]
    assert site.score(None, rollout.id, name="human", score=3).status_code == 401
    # reviewers and evaluators read, but write nothing else
    for token in (ALICE, EVALUATOR):
        assert httpx.get(f"{site.url}/api/rewards/pending", headers=_h(token)).status_code == 200
        r = httpx.post(f"{site.url}/api/rollouts/{rollout.id}/cancel", headers=_h(token))
        assert r.status_code == 403
        r = httpx.post(f"{site.url}/api/rollouts", json={"rollouts": []}, headers=_h(token))
        assert r.status_code == 403
    assert site.admin.reward_history(rollout.id) == []


def test_error_answers_name_the_problem(site: Site) -> None:
    (rollout,) = site.finished()
    r = site.score(ALICE, "ro-missing", name="human", score=3)
    assert r.status_code == 404 and _error(r) == ("NotFound", "rollout 'ro-missing' not found")
    r = site.score(ALICE, rollout.id, name="human", score=9)
    assert r.status_code == 422 and _error(r) == (
        "InvalidInput",
        "reward 'human': score 9.0 is outside the scale 1 to 5",
    )
    r = site.score(ALICE, rollout.id, name="human", score=3.5)
    assert r.status_code == 422 and "not on the scale's steps" in _error(r)[1]
    r = site.score(ALICE, rollout.id, name="agent", score=1)
    assert r.status_code == 422 and "'agent' is the rollout's own reward" in _error(r)[1]
    r = site.score(ALICE, rollout.id, name="human")
    assert r.status_code == 422 and "a score is required" in _error(r)[1]
    assert site.score(ALICE, rollout.id, name="human", score=3).status_code == 201
    r = site.score(BOB, rollout.id, name="human", score=4)  # bob saw no score: replaces 0
    assert r.status_code == 409
    assert _error(r) == (
        "Conflict",
        f"reward 'human' of rollout '{rollout.id}' was scored meanwhile (revision 1 by alice); reload and score again",
    )
    (queued,) = site.admin.enqueue([RolloutCreate(task=Task(data={"q": "later"}), await_rewards=AWAITED)])
    r = site.score(ALICE, queued.id, name="human", score=3)
    assert r.status_code == 409 and "is queued: rewards are given to finished rollouts" in _error(r)[1]
    assert [h.score for h in site.admin.reward_history(rollout.id)] == [3]


def test_a_retried_score_is_stored_once(site: Site) -> None:
    (rollout,) = site.finished()
    first = site.score(ALICE, rollout.id, key="form-1", name="human", score=5)
    again = site.score(ALICE, rollout.id, key="form-1", name="human", score=5)  # a double click
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    assert len(site.admin.reward_history(rollout.id, "human")) == 1


def test_pending_queue_and_history_through_the_clients(site: Site) -> None:
    rollouts = site.finished(3)
    site.finished(1, AttemptStatus.FAILED)
    with Client(site.url, ALICE) as alice:
        queue = alice.pending_rewards(source="reviewer")
        assert [r.id for r in queue.items] == [r.id for r in rollouts]
        assert queue.items[0].rewards["human"].scale == STARS
        slot = alice.add_reward(rollouts[0].id, RewardCreate(name="human", score=5))
        assert slot.state == RewardState.SCORED and slot.author == "alice"
        with pytest.raises(Conflict, match="scored meanwhile"):
            alice.add_reward(rollouts[0].id, RewardCreate(name="human", score=1))
        with pytest.raises(InvalidInput, match="outside the scale"):
            alice.add_reward(rollouts[1].id, RewardCreate(name="human", score=0))
        with pytest.raises(NotFound):
            alice.reward_history("ro-missing")
        page = alice.pending_rewards(name="human", limit=1)
        assert [r.id for r in page.items] == [rollouts[1].id] and page.next_cursor
        rest = alice.pending_rewards(name="human", cursor=page.next_cursor)
        assert [r.id for r in rest.items] == [rollouts[2].id]
    assert [r.id for r in site.admin.pending_rewards(name="judge", source="evaluator").items] == [
        r.id for r in rollouts
    ]

    async def evaluate() -> None:
        with_client = AsyncClient(site.url, EVALUATOR)
        try:
            queue = await with_client.pending_rewards(name="judge")
            for r in queue.items:
                await with_client.add_reward(r.id, RewardCreate(name="judge", score=0.5, author="j"))
            assert await with_client.pending_rewards(name="judge") == type(queue)(items=[], next_cursor=None)
            history = await with_client.reward_history(rollouts[0].id)
            assert [(h.name, h.author) for h in history] == [("human", "alice"), ("judge", "j")]
        finally:
            await with_client.aclose()

    asyncio.run(evaluate())
    waited = site.admin.wait([r.id for r in rollouts], timeout=1)
    assert [r.rewards["judge"].value for r in waited.rollouts] == [0.5, 0.5, 0.5]
    assert [r.pending_rewards for r in waited.rollouts] == [[], ["human"], ["human"]]


# ---------------------------------------------------------------------------- the judge proxy

JUDGE_KEY = "sk-judge-kept-on-the-server"
CHAT = {"model": "double", "messages": [{"role": "user", "content": "Score this answer."}]}


@pytest.fixture
def judge_site(tmp_path, upstream) -> Iterator[Site]:
    config = ServerConfig(
        db=str(tmp_path / "judge.db"),
        tokens=TOKENS,
        token_names=NAMES,
        upstream_api_keys={upstream.base_url: JUDGE_KEY},
        upstream_timeout=1.0,
    )
    with ServerThread(config) as server, Client(server.url, ADMIN) as admin:
        yield Site(server, admin)


def _judge(site: Site, token: str | None, upstream: str, body: object = CHAT) -> httpx.Response:
    headers = {**_h(token), "x-agentbolt-upstream": upstream}
    return httpx.post(f"{site.url}/judge/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_judge_proxy_injects_the_key_the_server_holds(judge_site: Site, upstream) -> None:
    for token in (EVALUATOR, ADMIN):
        r = _judge(judge_site, token, upstream.base_url)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert JUDGE_KEY not in r.text
    assert [c.headers["authorization"] for c in upstream.calls] == [f"Bearer {JUDGE_KEY}"] * 2
    assert upstream.calls[0].body == CHAT and upstream.calls[0].path == "/v1/chat/completions"
    # not a rollout's call: nothing is recorded in the store
    assert judge_site.admin.stats()["events"] == 0


def test_judge_proxy_refuses_what_it_should(judge_site: Site, upstream) -> None:
    r = _judge(judge_site, EVALUATOR, "http://127.0.0.1:9/v1")
    assert r.status_code == 403
    assert "holds no key for 'http://127.0.0.1:9/v1'" in r.json()["error"]["message"]
    for token, role in ((ALICE, "reviewer"), (READER, "reader"), (RUNNER, "runner")):
        r = _judge(judge_site, token, upstream.base_url)
        assert r.status_code == 403 and f"role {role!r} may not POST /judge/" in r.json()["error"]["message"]
    r = _judge(judge_site, EVALUATOR, "file:///etc/passwd")
    assert r.status_code == 422 and "X-Agentbolt-Upstream" in r.json()["error"]["message"]
    r = _judge(judge_site, EVALUATOR, upstream.base_url, {"model": "double", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{judge_site.url}/judge/v1/chat/completions", json=CHAT, headers=_h(EVALUATOR))
    assert r.status_code == 422 and "X-Agentbolt-Upstream" in r.json()["error"]["message"]
    assert upstream.calls == []  # none of these reached the model server


def test_judge_proxy_passes_upstream_errors_and_timeouts(judge_site: Site, upstream) -> None:
    upstream.fail_next.append(400)
    r = _judge(judge_site, EVALUATOR, upstream.base_url)
    assert r.status_code == 400 and r.json()["error"]["message"] == "injected 400"
    r = _judge(judge_site, EVALUATOR, upstream.base_url, {**CHAT, "model": "error-500"})
    assert r.status_code == 500 and "backend failed for Bearer ***" in r.json()["error"]["message"]
    assert JUDGE_KEY not in r.text  # the model server echoed the key: scrubbed
    upstream.delay_next.append(3.0)
    r = _judge(judge_site, EVALUATOR, upstream.base_url)
    assert r.status_code == 504 and "the judge model timed out" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- the server command


def _cli_server(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "agentbolt", "server", "--log-level", "warning", *args]
    environ = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)


@pytest.mark.parametrize("from_env", [True, False])
def test_server_command_takes_reviewer_and_evaluator_tokens(tmp_path, upstream, from_env: bool) -> None:
    """The reviewer tokens and upstream keys from the environment (comma-separated) or from
    repeated options (an option given replaces the environment variable)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "--db",
        str(tmp_path / "cli.db"),
        "--port",
        str(port),
        "--token",
        "adm",
        "--evaluator-token",
        "ev",
    ]
    if from_env:
        env = {
            "AGENTBOLT_REVIEWER_TOKENS": "alice=tok-a1, bob=tok-b2",
            "AGENTBOLT_UPSTREAM_KEYS": f"{upstream.base_url}=sk-j",
        }
    else:
        env = {}
        args += ["--reviewer-token", "alice=tok-a1", "--reviewer-token", "bob=tok-b2"]
        args += ["--upstream-key", f"{upstream.base_url}=sk-j"]
    server = _cli_server(*args, env=env)
    try:
        wait_healthy(url, 60, "adm")
        for token, name in (("tok-a1", "alice"), ("tok-b2", "bob")):
            info = httpx.get(f"{url}/api/dashboard/info", headers=_h(token)).json()
            assert (info["role"], info["name"]) == ("reviewer", name), info
        assert httpx.get(f"{url}/api/dashboard/info", headers=_h("ev")).json()["role"] == "evaluator"
        headers = {**_h("ev"), "x-agentbolt-upstream": upstream.base_url}
        r = httpx.post(f"{url}/judge/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 200 and upstream.calls[-1].headers["authorization"] == "Bearer sk-j"
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--reviewer-token", "alice"), "--reviewer-token takes NAME=TOKEN: item 1 is not of that form"),
        (("--reviewer-token", "alice=t1,bob="), "item 2 is not of that form"),
        (("--reviewer-token", "alice=t1", "--reviewer-token", "alice=t2"), "'alice' is given twice"),
        (("--token", "same", "--reviewer-token", "alice=same"), "the same token is given twice"),
        (("--upstream-key", "http://x/v1"), "--upstream-key takes BASE_URL=KEY"),
    ],
)
def test_server_command_refuses_bad_token_options(tmp_path, args: tuple[str, ...], message: str) -> None:
    server = _cli_server("--db", str(tmp_path / "bad.db"), "--port", str(free_port()), *args)
    out, err = server.communicate(timeout=60)
    assert server.returncode == 2 and message in err and "Traceback" not in err, err
    assert "t1" not in err and "same'" not in err  # secrets are not echoed
