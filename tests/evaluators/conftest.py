"""What the evaluator tests share: rollouts and events made by hand, and a record of a
conversation of any length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbolt.errors import Conflict
from agentbolt.evaluators import RolloutRecord, record_of
from agentbolt.schemas import (
    Event,
    Mode,
    RewardCreate,
    RewardScale,
    RewardSlot,
    RewardSource,
    RewardState,
    Rollout,
    RolloutStatus,
    Task,
)


def make_rollout(
    rid: str = "ro-1",
    *,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    group_id: str | None = None,
    rewards: dict[str, RewardSlot] | None = None,
    data: dict[str, Any] | None = None,
) -> Rollout:
    return Rollout(
        id=rid,
        task=Task(id=f"task-{rid}", data=data if data is not None else {"question": "What is 2+2?"}),
        mode=Mode.TRAIN,
        status=status,
        resources_version=1,
        timeout_seconds=None,
        max_attempts=1,
        attempts=1,
        group_id=group_id,
        created_at=0.0,
        updated_at=0.0,
        rewards=rewards or {},
    )


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
