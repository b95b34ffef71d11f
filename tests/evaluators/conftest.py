"""What the evaluator tests share: rollouts and events made by hand, a record of a conversation
of any length, an in-memory reward writer, and the recorded hosted-judge double over HTTP."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentbolt.client import Client
from agentbolt.errors import Conflict
from agentbolt.evaluators import RolloutRecord, record_of
from agentbolt.schemas import (
    AttemptStatus,
    AwaitedReward,
    Event,
    EventCreate,
    EventSource,
    RewardCreate,
    RewardScale,
    RewardSlot,
    RewardSource,
    RewardState,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Task,
)
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.conftest import finished_rollout


def make_rollout(
    rid: str = "ro-1",
    *,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    group_id: str | None = None,
    rewards: dict[str, RewardSlot] | None = None,
    data: dict[str, Any] | None = None,
) -> Rollout:
    task = Task(id=f"task-{rid}", data=data if data is not None else {"question": "What is 2+2?"})
    return finished_rollout(rid, task=task, status=status, group_id=group_id, rewards=rewards)


def llm_event(
    rid: str, messages: list[dict[str, Any]], answer: str, *, event_id: int = 1, attempt: str = "at-1"
) -> Event:
    data = {
        "endpoint": "chat.completions",
        "request": {"model": "m", "messages": messages},
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        "latency_ms": 250.0,
        "error": None,
    }
    return Event(
        id=event_id,
        rollout_id=rid,
        attempt_id=attempt,
        sequence=event_id,
        type="llm_call",
        timestamp=0.0,
        data=data,
        source=EventSource.GATEWAY,
    )


def conversation_record(
    turns: int, *, turn_chars: int = 100, rid: str = "ro-1", answer: str = "4"
) -> RolloutRecord:
    """A record whose final conversation has a system prompt, a first user message, ``turns``
    middle turns (user/assistant alternating, numbered, ``turn_chars`` long) and ``answer``."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "FIRST: what is 2+2?"},
    ]
    for i in range(turns):
        role = "assistant" if i % 2 == 0 else "user"
        messages.append({"role": role, "content": f"turn{i:03d} " + "x" * (turn_chars - 8)})
    return record_of(make_rollout(rid), [llm_event(rid, messages, answer)])


class MemoryWriter:
    """Rewards kept in a dict, with the store's revision check."""

    def __init__(self, events: dict[str, list[Event]] | None = None) -> None:
        self.events = events or {}
        self.writes: list[tuple[str, RewardCreate]] = []
        self.revisions: dict[tuple[str, str], int] = {}

    def events_of(
        self, rollout_ids: Sequence[str], type: Sequence[str] | None = None
    ) -> dict[str, list[Event]]:
        return {rid: self.events.get(rid, []) for rid in rollout_ids}

    def add_reward(self, rollout_id: str, create: RewardCreate) -> RewardSlot:
        revision = self.revisions.get((rollout_id, create.name), 0)
        if (create.replaces or 0) != revision:
            raise Conflict(f"reward {create.name!r} of rollout {rollout_id} was scored meanwhile")
        self.revisions[(rollout_id, create.name)] = revision + 1
        self.writes.append((rollout_id, create))
        return slot(create.name, RewardState(create.state), revision + 1)


def slot(name: str, state: RewardState, revision: int) -> RewardSlot:
    return RewardSlot(
        name=name,
        source=RewardSource.EVALUATOR,
        scale=RewardScale(),
        state=state,
        revision=revision,
        updated_at=0.0,
    )


RECORDED: dict[str, Any] = json.loads((Path(__file__).parent / "recorded" / "openai_chat.json").read_text())


class _ReplayHandler(http.server.BaseHTTPRequestHandler):
    server: _ReplayServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        self.server.requests.append(
            {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
        )
        answers = self.server.answers
        answer = answers[min(len(self.server.requests), len(answers)) - 1]
        payload = json.dumps(answer["body"]).encode()
        self.send_response(answer["status"])
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


class _ReplayServer(http.server.ThreadingHTTPServer):
    answers: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    base_url: str


@contextmanager
def recorded_judge_server(*names: str) -> Iterator[_ReplayServer]:
    """The recorded hosted-judge double over real HTTP on 127.0.0.1: answers the recorded
    OpenAI-style answers ``names`` in order (the last again when they run out) and keeps the
    requests; ``.base_url`` ends with ``/v1``."""
    server = _ReplayServer(("127.0.0.1", 0), _ReplayHandler)
    server.answers, server.requests = [RECORDED[n] for n in names], []
    server.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------- the real server

ADMIN, EVALUATOR, RUNNER = "admin-token", "evaluator-token", "runner-token"


@pytest.fixture
def served(tmp_path) -> Iterator[ServerThread]:
    config = ServerConfig(
        db=str(tmp_path / "store.db"),
        tokens={ADMIN: Role.ADMIN, EVALUATOR: Role.EVALUATOR, RUNNER: Role.RUNNER},
    )
    with ServerThread(config) as server:
        yield server


def run_rollouts(
    client: Client, answers: Sequence[str | None], awaited: list[AwaitedReward], group_id: str | None = None
) -> list[Rollout]:
    """One rollout per answer, run by hand: a model call answering it, then succeeded (None:
    the attempt fails). The call is posted with the runner's token, as the runner's tracer
    does: evaluators, like training, read only model calls the system wrote."""
    items = [
        RolloutCreate(
            task=Task(data={"question": "2+2?"}), await_rewards=awaited, group_id=group_id, max_attempts=1
        )
        for _ in answers
    ]
    rollouts = client.enqueue(items)
    with Client(client.url, RUNNER) as runner:
        for answer in answers:
            claim = runner.dequeue("worker-1")
            assert claim is not None
            if answer is None:
                runner.finish(claim.attempt.id, AttemptStatus.FAILED, error="crashed", worker_id="worker-1")
                continue
            call = {
                "endpoint": "chat.completions",
                "request": {"messages": [{"role": "user", "content": "2+2?"}]},
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}],
            }
            events = [EventCreate(sequence=0, type="llm_call", data=call)]
            runner.add_events(claim.attempt.id, events, worker_id="worker-1")
            runner.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, worker_id="worker-1")
    return client.wait([r.id for r in rollouts], timeout=10).rollouts
