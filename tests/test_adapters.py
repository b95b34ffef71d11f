from __future__ import annotations

import itertools
from typing import Any

import pytest

from agentbolt.adapters import (
    AdapterStats,
    chat_row_key,
    latest_attempt,
    rollout_reward,
    to_chat_rows,
    to_trajectories,
    to_transitions,
)
from agentbolt.schemas import Event, EventSource

_ids = itertools.count(1)


def event(type_: str, data: dict[str, Any], attempt: str = "at-1") -> Event:
    return Event(
        id=next(_ids),
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence=None,
        type=type_,
        timestamp=0.0,
        data=data,
        source=EventSource.GATEWAY,  # the gateway's record: what training reads
    )


def llm_call(
    prompt: list[int] | None,
    *completions: list[int] | None,
    logprobs: bool = True,
    attempt: str = "at-1",
    messages: list[dict[str, Any]] | None = None,
    response: dict[str, Any] | None = None,
    error: Any = None,
) -> Event:
    choices = [
        {
            "index": i,
            "message": response or {"role": "assistant", "content": f"c{i}"},
            "finish_reason": "stop",
            "token_ids": ids,
            "logprobs": [-0.1 * (k + 1) for k in range(len(ids))] if logprobs and ids is not None else None,
        }
        for i, ids in enumerate(completions)
    ]
    data = {
        "endpoint": "chat.completions",
        "request": {"messages": messages or [{"role": "user", "content": "hi"}]},
        "prompt_token_ids": prompt,
        "choices": choices,
        "error": error,
    }
    return event("llm_call", data, attempt)


def reward(value: float, attempt: str = "at-1", **extra: Any) -> Event:
    return event("reward", {"value": value, **extra}, attempt)


# ---------------------------------------------------------------------------- trajectories


def test_multi_turn_merge_masks_tool_output_and_user_turns() -> None:
    # turn 1: prompt [1,2,3] -> model [10,11]; tool output [20,21] appended -> model [12]
    # turn 3: user turn [30] appended -> model [13,14]
    calls = [
        llm_call([1, 2, 3], [10, 11]),
        llm_call([1, 2, 3, 10, 11, 20, 21], [12]),
        llm_call([1, 2, 3, 10, 11, 20, 21, 12, 30], [13, 14]),
        reward(1.0, final=True),
    ]
    rows, stats = to_trajectories(calls, group_id="g", task_id="t")
    assert len(rows) == 1 and stats.prefix_mismatches == 0
    row = rows[0]
    assert row.input_ids == (1, 2, 3, 10, 11, 20, 21, 12, 30, 13, 14)
    assert row.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1)
    assert row.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2])
    assert [(s.start, s.end) for s in row.calls] == [(3, 5), (7, 8), (9, 11)]
    assert (row.reward, row.group_id, row.task_id, row.num_model_tokens) == (1.0, "g", "t", 5)


def test_mismatch_starts_a_new_row_and_is_counted() -> None:
    # the template re-renders the end-of-turn token 99 as 98: not a prefix -> new row
    calls = [
        llm_call([1, 2], [10, 99]),
        llm_call([1, 2, 10, 98, 20], [11]),
        llm_call([1, 2, 10, 98, 20, 11, 21], [12]),  # extends the second call: merged
        llm_call([5, 6], [13]),  # an unrelated conversation
    ]
    rows, stats = to_trajectories(calls, reward=0.5)
    assert [r.input_ids for r in rows] == [(1, 2, 10, 99), (1, 2, 10, 98, 20, 11, 21, 12), (5, 6, 13)]
    assert [r.segment_index for r in rows] == [0, 1, 2]
    assert rows[1].loss_mask == (0, 0, 0, 0, 0, 1, 0, 1)  # nothing of the first call is trained twice
    assert stats == AdapterStats(calls=4, prefix_mismatches=2, end_token_mismatches=1)


def test_dropped_end_token_is_a_mismatch_not_fuzzed() -> None:
    rows, stats = to_trajectories([llm_call([1], [10, 99]), llm_call([1, 10, 20], [11])])
    assert len(rows) == 2 and stats.end_token_mismatches == 1


def test_calls_without_ids_or_with_errors_are_skipped_and_counted() -> None:
    calls = [
        llm_call([1, 2], [10]),
        llm_call(None, None),  # upstream gave no ids
        llm_call([1, 2, 10, 3], None),
        llm_call([1, 2], [], error={"message": "boom"}),
        llm_call([1, 2, 10, 3], [11], logprobs=False),
    ]
    rows, stats = to_trajectories(calls)
    assert (stats.calls, stats.skipped_no_ids, stats.skipped_failed) == (5, 2, 1)
    assert rows[0].input_ids == (1, 2, 10, 3, 11) and rows[0].logprobs is None


def test_n_greater_than_one_follows_the_continued_choice() -> None:
    calls = [llm_call([1], [10], [11]), llm_call([1, 11, 5], [12], [13])]
    rows, _ = to_trajectories(calls)
    assert rows[0].input_ids == (1, 11, 5, 12)  # choice 1 was continued; choice 0 at the end
    assert [s.choice_index for s in rows[0].calls] == [1, 0]
    transitions, _ = to_transitions(calls)
    assert [(t.call_index, t.choice_index) for t in transitions] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_attempts_are_kept_apart() -> None:
    events = [
        llm_call([1], [10], attempt="at-1"),
        llm_call([1], [11], attempt="at-2"),
        llm_call([1, 11, 2], [12], attempt="at-2"),
        reward(1.0, attempt="at-2", final=True),
    ]
    rows, stats = to_trajectories(events)
    assert [(r.attempt_id, r.reward, r.segment_index) for r in rows] == [("at-1", None, 0), ("at-2", 1.0, 0)]
    assert stats.prefix_mismatches == 0
    assert [e.attempt_id for e in latest_attempt(events)] == ["at-2"] * 3


def test_call_spans_keep_step_rewards_and_declared_states_per_attempt() -> None:
    first, second, third = llm_call([1], [10]), llm_call([1, 10, 2], [11]), llm_call([1, 10, 2, 11, 3], [12])
    other = llm_call([1], [10], attempt="at-2")
    events = [
        first,
        second,
        third,
        other,
        event("state", {"key": "room-a", "llm_call_id": first.id}),
        event("state", {"key": "room-b", "llm_call_id": first.id}),  # the last one counts
        event("state", {"key": "room-c", "llm_call_id": str(third.id)}),
        event("state", {"key": "", "llm_call_id": second.id}),  # empty key: ignored
        event("state", {"key": "x" * 513, "llm_call_id": second.id}),  # too long: ignored
        event("state", {"key": "elsewhere", "llm_call_id": other.id}, attempt="at-2"),
        reward(0.25, llm_call_id=second.id),
        reward(0.5, llm_call_id=second.id),  # two for one call: summed
        reward(-1.0, llm_call_id=other.id, attempt="at-2"),  # the other attempt's call
        reward(1.0, final=True),
    ]
    rows, _ = to_trajectories(events)
    mine, theirs = rows
    assert [(s.step_reward, s.state) for s in mine.calls] == [
        (None, "room-b"),
        (0.75, None),
        (None, "room-c"),
    ]
    assert [s.reward for s in mine.calls] == [1.0, 0.75, 1.0]  # today's meaning kept
    assert [(s.step_reward, s.state) for s in theirs.calls] == [(-1.0, "elsewhere")]
    assert mine.reward == 1.0 and theirs.reward is None


# ---------------------------------------------------------------------------- transitions and rewards


def test_transitions_reward_rule_with_per_call_override() -> None:
    first, second = llm_call([1], [10]), llm_call([1, 10, 2], [11])
    events = [first, second, reward(0.2, llm_call_id=second.id), reward(1.0, final=True)]
    rows, stats = to_transitions(events)
    assert [(r.event_id, r.reward) for r in rows] == [(first.id, 1.0), (second.id, 0.2)]
    assert rows[1].prompt_ids == (1, 10, 2) and rows[1].completion_ids == (11,)
    assert rows[1].logprobs == pytest.approx([-0.1])
    explicit, _ = to_transitions(events, reward=3.0)
    assert [r.reward for r in explicit] == [3.0, 0.2]
    assert stats.calls == 2


def test_rollout_reward_precedence() -> None:
    partial = [reward(0.25), reward(0.5), reward(9.0, llm_call_id=1)]
    assert rollout_reward(partial) == 0.75  # sum of rollout-level events
    assert rollout_reward([*partial, reward(1.0, final=True), reward(0.0, final=True)]) == 0.0  # last final
    assert rollout_reward(partial, reward=2.0) == 2.0
    assert rollout_reward([event("reward", {"value": None})]) is None


# ---------------------------------------------------------------------------- chat rows

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def test_chat_rows_keep_the_last_call_with_tool_calls() -> None:
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}
    tool_call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"e": "2+2"}}}
    asked = {"role": "assistant", "content": None, "tool_calls": [tool_call], "refusal": None}
    first = llm_call([1], [2], messages=[system, user], response=asked)
    first.data["request"]["tools"] = TOOLS
    tool_msg = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    history = [system, user, {"role": "assistant", "tool_calls": [tool_call]}, tool_msg]
    second = llm_call([1, 2, 3], [4], messages=history, response={"role": "assistant", "content": "4"})
    second.data["request"]["tools"] = TOOLS
    rows = to_chat_rows([first, second])
    assert len(rows) == 1
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+2"}'}}
    assert rows[0] == {
        "messages": [
            system,
            user,
            {"role": "assistant", "tool_calls": [call]},
            tool_msg,
            {"role": "assistant", "content": "4"},
        ],
        "tools": TOOLS,
    }
    again = to_chat_rows([second])
    assert chat_row_key(again[0]) == chat_row_key(rows[0])


def test_chat_rows_keep_independent_conversations_and_skip_failures() -> None:
    a = llm_call([1], [2], messages=[{"role": "user", "content": "a"}])
    b = llm_call([1], [2], messages=[{"role": "user", "content": "b"}])
    failed = llm_call([1], [], messages=[{"role": "user", "content": "c"}], error={"message": "x"})
    rows = to_chat_rows([a, b, failed])
    assert [r["messages"][0]["content"] for r in rows] == ["a", "b"]
    assert "tools" not in rows[0]
