"""``agentbolt review`` against a real server on loopback: a person at the terminal walks the
queue by typing on stdin (scores, comments, ``s``, ``q``), rescoring keeps the history, a score
given meanwhile by someone else is never overwritten, and bad input gets one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.schemas import RewardCreate, RewardState
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.server.dashboard.dashboard_data import awaiting_review

TOKENS = {"admintok": Role.ADMIN, "alicetok": Role.REVIEWER, "readtok": Role.READER, "runnertok": Role.RUNNER}
NAMES = {"alicetok": "alice"}
ANSWERS = ["The product is 391.", "It is 414, I think.", "437"]


@pytest.fixture
def review_server(tmp_path: Path) -> Iterator[ServerThread]:
    config = ServerConfig(db=str(tmp_path / "review.db"), tokens=TOKENS, token_names=NAMES, lease_seconds=60)
    server = ServerThread(config).start()
    try:
        yield server
    finally:
        server.stop()
        server.app.state.store.close()


@pytest.fixture
def admin(review_server: ServerThread) -> Iterator[Client]:
    with Client(review_server.url, token="admintok") as client:
        yield client


def review(
    server: ServerThread, *args: str, token: str = "alicetok", stdin: str = ""
) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "AGENTBOLT_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "agentbolt", "review", "--server", server.url, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_walks_the_queue_checks_scores_skips_and_stores_each_score_once(
    review_server: ServerThread, admin: Client
) -> None:
    first, second, third = awaiting_review(review_server.url, "admintok", ANSWERS)
    # first: off the scale, not a number, off the steps, then 4 with a comment; second: skipped;
    # third: 2 without a comment
    typed = "7\nfour\n2.5\n4\nright, shown clearly\ns\n2\n\n"
    done = review(review_server, stdin=typed)
    assert done.returncode == 0, done.stderr
    assert "scored 2, skipped 1" in done.stdout
    # what the reviewer saw: the task, the transcript and the final answer of each
    for answer in ANSWERS:
        assert answer in done.stdout
    assert "What is 17 * 23?" in done.stdout and "final answer" in done.stdout
    assert "no model answer recorded" not in done.stdout
    # each bad score got one line naming the problem, and was asked again
    assert "score 7.0 is outside the scale 1 to 5" in done.stderr
    assert "'four' is not a number" in done.stderr
    assert "not on the scale's steps" in done.stderr
    assert "Traceback" not in done.stderr

    one = admin.get_rollout(first).rewards["human"]
    assert (one.state, one.score, one.value, one.revision) == (RewardState.SCORED, 4, 0.75, 1)
    assert one.author == "alice" and one.comment == "right, shown clearly"
    assert admin.get_rollout(second).rewards["human"].state == RewardState.PENDING
    three = admin.get_rollout(third).rewards["human"]
    assert (three.score, three.comment, three.revision) == (2, None, 1)
    assert [r.score for r in admin.reward_history(first, "human")] == [4]  # stored once
    assert [r.id for r in admin.pending_rewards(name="human").items] == [second]


def test_q_quits_and_limit_stops_after_that_many(review_server: ServerThread, admin: Client) -> None:
    ids = awaiting_review(review_server.url, "admintok", ANSWERS)
    quit_ = review(review_server, stdin="q\n")
    assert quit_.returncode == 0 and "stopped" in quit_.stdout
    assert all(admin.get_rollout(i).pending_rewards == ["human"] for i in ids)

    limited = review(review_server, "--limit", "1", stdin="5\n\n")
    assert limited.returncode == 0, limited.stderr
    assert "scored 1, skipped 0" in limited.stdout
    assert admin.get_rollout(ids[0]).rewards["human"].score == 5
    assert admin.get_rollout(ids[1]).pending_rewards == ["human"]

    ended = review(review_server, stdin="")  # stdin ends: as q
    assert ended.returncode == 0 and "stopped" in ended.stdout


def test_rescore_shows_the_history_and_keeps_it(review_server: ServerThread, admin: Client) -> None:
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1])
    assert review(review_server, stdin="2\nfirst look\n").returncode == 0
    again = review(review_server, "--rescore", rid, stdin="5\non second reading\n")
    assert again.returncode == 0, again.stderr
    assert "history of 'human' (1 revisions)" in again.stdout and "first look" in again.stdout
    assert "scored 5 for 'human' (revision 2)" in again.stdout
    history = admin.reward_history(rid, "human")
    assert [(r.revision, r.score, r.comment) for r in history] == [
        (1, 2, "first look"),
        (2, 5, "on second reading"),
    ]
    assert admin.get_rollout(rid).rewards["human"].value == 1.0


def test_a_score_given_meanwhile_is_not_overwritten(review_server: ServerThread, admin: Client) -> None:
    """Two people on one rollout: the CLI shows it and waits for a score; someone else scores
    it meanwhile. The CLI's score (which replaces revision 0) is refused with who scored, and the
    other person's score stands."""
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1])
    env = {**os.environ, "COLUMNS": "200", "AGENTBOLT_TOKEN": "alicetok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentbolt", "review", "--server", review_server.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    seen = bytearray()
    asked = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 4096):
            seen.extend(chunk)
            if b"q quits" in seen:
                asked.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert asked.wait(60), bytes(seen).decode(errors="replace")
        admin.add_reward(rid, RewardCreate(name="human", score=1, replaces=0, author="bob"))
        proc.stdin.write(b"5\n\n")
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "scored meanwhile" in err and "revision 1 by bob" in err, err
    slot = admin.get_rollout(rid).rewards["human"]
    assert (slot.score, slot.author, slot.revision) == (1, "bob", 1)
    assert len(admin.reward_history(rid, "human")) == 1


def test_bad_input_gets_one_line_and_exit_code_2(review_server: ServerThread, admin: Client) -> None:
    [rid] = awaiting_review(review_server.url, "admintok", ANSWERS[:1])
    reader = review(review_server, token="readtok", stdin="4\n\n")
    assert reader.returncode == 2, (reader.stdout, reader.stderr)
    assert "reviewer token" in reader.stderr and "Traceback" not in reader.stderr
    assert admin.get_rollout(rid).pending_rewards == ["human"]

    unknown = review(review_server, "--rescore", "ro-nope")
    assert unknown.returncode == 2 and "ro-nope" in unknown.stderr and "Traceback" not in unknown.stderr
    no_such = review(review_server, "--rescore", rid, "--name", "stars")
    assert no_such.returncode == 2 and "has no reward 'stars'" in no_such.stderr

    empty = review(review_server, "--name", "stars")
    assert empty.returncode == 0 and "no rollout awaits a score for 'stars'" in empty.stdout
