"""Events of a rollout -> training rows, from the token ids the gateway recorded.

Nothing here tokenizes text: every id comes from an ``llm_call`` event exactly as the model
server returned it (see ``docs/events.md``), and only from one the system wrote
(:func:`system_calls`: source ``gateway``, or ``runner`` for the runner's own tracer): a model
call an agent posted is never a training row. Three views of the same events:

- :func:`to_transitions` - one :class:`TransitionRow` per call and choice (prompt ids,
  completion ids, logprobs, reward): the single-turn view.
- :func:`to_trajectories` - one :class:`TrajectoryRow` per conversation: consecutive calls are
  merged into one token sequence when the next prompt extends the previous prompt + completion
  *exactly*, with ``loss_mask`` 1 on model-generated tokens only.
- :func:`to_chat_rows` - OpenAI chat fine-tuning rows (messages + tool calls) for SFT export.

Decisions a reader should know:

- Events of several attempts of one rollout are kept apart: rows never mix attempts, and the
  reward rule is applied per attempt. Use :func:`latest_attempt` to train on the last try only.
- Reward rule (:func:`rollout_reward`): an explicit ``reward`` argument, else the value of the last
  ``reward`` event with ``"final": true``, else the sum of the rollout-level ``reward`` events
  (those without ``llm_call_id``), else ``None``. That value goes to every call; ``reward``
  events with an ``llm_call_id`` override it for that call (several for one call are summed).
- Merging is exact-prefix only, never fuzzy. A chat template that re-renders the previous
  completion differently (most often its end-of-turn token) breaks the prefix; the call then
  starts a new row and is counted in :class:`AdapterStats` (``end_token_mismatches`` singles out
  a divergence at the previous completion's last token), so users see it instead of training
  on silently shifted masks. The opposite case, a template that appends an end-of-turn token
  the completion lacked, is an exact prefix and merges: that token is masked 0, like all
  template tokens. An agent that runs independent conversations (sub-agents) starts
  new rows by design; those are counted as mismatches too.
- With ``n > 1`` each choice is its own transition. A trajectory follows the choice that the
  next prompt continues (choice 0 when none or at the end); the other choices appear in
  transitions only.
- Per turn (one call), :class:`CallSpan` also keeps the call's own rewards (``step_reward``: the
  sum of the ``reward`` events naming it, None when none) and the environment state the agent
  declared for it (``state``: the ``key`` of the last ``state`` event naming it, see
  :func:`call_states`); :mod:`agentbolt.algorithms.credit` turns them into per-turn advantages.
- ``TrajectoryRow.logprobs`` holds 0.0 at masked positions; it is ``None`` when any merged call
  lacks logprobs (recompute them with the policy then).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from agentbolt.schemas import SYSTEM_SOURCES, Event, EventSource, EventType
from agentbolt.turns import drop_examples

__all__ = [
    "AdapterStats",
    "CallSpan",
    "TrajectoryRow",
    "TransitionRow",
    "call_rewards",
    "call_states",
    "chat_row_key",
    "latest_attempt",
    "rollout_reward",
    "split_attempts",
    "system_calls",
    "to_chat_rows",
    "to_trajectories",
    "to_transitions",
]


# ---------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class AdapterStats:
    """What the adapters saw, left out or split; add two with ``+``."""

    calls: int = 0
    """``llm_call`` events seen."""
    skipped_no_ids: int = 0
    """Calls left out because the upstream returned no prompt or completion token ids: those the
    gateway recorded text-only (``token_ids: false``, an upstream that rejects
    ``return_token_ids``) still serve APO and SFT from text."""
    skipped_failed: int = 0
    """Calls left out because they carry an ``error`` or no choices."""
    prefix_mismatches: int = 0
    """Trajectories only: calls that did not extend the previous sequence and began a new row."""
    end_token_mismatches: int = 0
    """Of ``prefix_mismatches``: the divergence is at the previous completion's last token."""

    def __add__(self, other: AdapterStats) -> AdapterStats:
        return AdapterStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class TransitionRow:
    """One choice of one model call."""

    rollout_id: str
    attempt_id: str
    event_id: int
    call_index: int
    """Position of the call among the attempt's ``llm_call`` events (skipped ones included)."""
    choice_index: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    """One per completion token, or None when the upstream gave none."""
    reward: float | None


@dataclass(frozen=True)
class CallSpan:
    """Where one call's completion sits in a :class:`TrajectoryRow`: ``input_ids[start:end]``."""

    event_id: int
    choice_index: int
    start: int
    end: int
    reward: float | None
    """The call's reward under the reward rule (a per-call reward event overrides)."""
    step_reward: float | None = None
    """Sum of the reward events attached to this call; None when none is."""
    state: str | None = None
    """The ``key`` of the last ``state`` event naming this call: the environment state the
    model answered in that turn (None when the agent declared none)."""


@dataclass(frozen=True)
class TrajectoryRow:
    """Merged token sequence of consecutive calls of one attempt."""

    rollout_id: str
    attempt_id: str
    segment_index: int
    """0 for the attempt's first row; > 0 after a prefix mismatch."""
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 = generated by the model, 0 = prompt, tool output, user turn or template tokens."""
    logprobs: tuple[float, ...] | None
    """Aligned with input_ids, 0.0 where loss_mask is 0; None when a merged call had none."""
    reward: float | None
    """The attempt's reward (per-call overrides live in ``calls``)."""
    calls: tuple[CallSpan, ...]
    group_id: str | None = None
    task_id: str | None = None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


# ---------------------------------------------------------------------------- events -> calls


@dataclass(frozen=True)
class _ChoiceTokens:
    """The completion token ids (and logprobs) of one choice of a recorded call."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None


@dataclass(frozen=True)
class _CallTokens:
    """The token ids one ``llm_call`` event recorded: its prompt and each choice's completion."""

    event: Event
    call_index: int
    prompt_ids: tuple[int, ...]
    choices: tuple[_ChoiceTokens, ...]


def split_attempts(events: Sequence[Event]) -> list[list[Event]]:
    """Events grouped by attempt, attempts in order of their first event, order kept inside."""
    by_attempt: dict[str, list[Event]] = {}
    for event in events:
        by_attempt.setdefault(event.attempt_id, []).append(event)
    return list(by_attempt.values())


def latest_attempt(events: Sequence[Event]) -> list[Event]:
    """The events of the attempt whose first event came last (the retry that finished)."""
    attempts = split_attempts(events)
    return attempts[-1] if attempts else []


def _parse_choice(raw: dict[str, Any]) -> _ChoiceTokens | None:
    token_ids = raw.get("token_ids")
    if token_ids is None:
        return None
    logprobs = raw.get("logprobs")
    if logprobs is not None and len(logprobs) != len(token_ids):
        logprobs = None  # misaligned: unusable as old log-probs
    return _ChoiceTokens(
        index=int(raw.get("index", 0)),
        token_ids=tuple(int(t) for t in token_ids),
        logprobs=tuple(float(lp) for lp in logprobs) if logprobs is not None else None,
    )


def _parse_call(event: Event, call_index: int) -> _CallTokens | str:
    """The call, or why it is skipped: ``"failed"`` or ``"no_ids"``."""
    data = event.data
    if data.get("error") or not data.get("choices"):
        return "failed"
    parsed = [_parse_choice(c) for c in data["choices"]]
    choices = tuple(sorted((c for c in parsed if c is not None), key=lambda c: c.index))
    if data.get("prompt_token_ids") is None or not choices:
        return "no_ids"
    prompt_ids = tuple(int(t) for t in data["prompt_token_ids"])
    return _CallTokens(event=event, call_index=call_index, prompt_ids=prompt_ids, choices=choices)


def system_calls(events: Sequence[Event]) -> list[Event]:
    """The ``llm_call`` events the system wrote (:data:`~agentbolt.schemas.SYSTEM_SOURCES`), the
    only ones training reads: an agent's post, or a row stored before sources were kept whose
    writer is unknown, could carry token ids the model never produced."""
    return [e for e in events if e.type == EventType.LLM_CALL and e.source in SYSTEM_SOURCES]


def _parse_calls(events: Sequence[Event]) -> tuple[list[_CallTokens], AdapterStats]:
    llm_events = system_calls(events)
    parsed = [_parse_call(e, i) for i, e in enumerate(llm_events)]
    calls = [p for p in parsed if isinstance(p, _CallTokens)]
    stats = AdapterStats(
        calls=len(llm_events),
        skipped_no_ids=parsed.count("no_ids"),
        skipped_failed=parsed.count("failed"),
    )
    return calls, stats


# ---------------------------------------------------------------------------- rewards


def _reward_value(event: Event) -> float | None:
    value = event.data.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def rollout_reward(events: Sequence[Event], reward: float | None = None) -> float | None:
    """The reward every call gets (see the module docstring for the rule)."""
    if reward is not None:
        return reward
    rollout_level = [
        (e.data.get("final") is True, value, e.source)
        for e in events
        if e.type == EventType.REWARD
        and e.data.get("llm_call_id") is None
        and (value := _reward_value(e)) is not None
    ]
    finals = [value for is_final, value, source in rollout_level if is_final and source != EventSource.AGENT]
    if finals:
        return finals[-1]
    return sum(value for _, value, _ in rollout_level) if rollout_level else None


def call_rewards(events: Sequence[Event]) -> dict[int, float]:
    """Per-call rewards: ``llm_call`` event id -> sum of the reward events attached to it."""
    rewards: dict[int, float] = {}
    for e in events:
        call_id, value = _call_id(e.data.get("llm_call_id")), _reward_value(e)
        if e.type == EventType.REWARD and call_id is not None and value is not None:
            rewards[call_id] = rewards.get(call_id, 0.0) + value
    return rewards


STATE_EVENT: str = EventType.STATE
"""Event type of a declared environment state (:func:`agentbolt.emit_state`):
``data = {"key": str, "llm_call_id": int}``."""
MAX_STATE_KEY = 512


def _call_id(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def call_states(events: Sequence[Event]) -> dict[int, str]:
    """Declared states: ``llm_call`` event id -> ``key`` of the last ``state`` event naming it.
    Events without a non-empty string key (up to 512 characters) or a call id are ignored."""
    states: dict[int, str] = {}
    for e in events:
        if e.type != STATE_EVENT:
            continue
        key, call_id = e.data.get("key"), _call_id(e.data.get("llm_call_id"))
        if isinstance(key, str) and 0 < len(key) <= MAX_STATE_KEY and call_id is not None:
            states[call_id] = key
    return states


# ---------------------------------------------------------------------------- transitions


def to_transitions(
    events: Sequence[Event], reward: float | None = None
) -> tuple[list[TransitionRow], AdapterStats]:
    """One row per call and choice; calls without token ids are skipped and counted."""
    rows: list[TransitionRow] = []
    stats = AdapterStats()
    for attempt_events in split_attempts(events):
        calls, attempt_stats = _parse_calls(attempt_events)
        base, overrides = rollout_reward(attempt_events, reward), call_rewards(attempt_events)
        rows += [
            _transition(call, choice, overrides.get(call.event.id, base))
            for call in calls
            for choice in call.choices
        ]
        stats += attempt_stats
    return rows, stats


def _transition(call: _CallTokens, choice: _ChoiceTokens, reward: float | None) -> TransitionRow:
    return TransitionRow(
        rollout_id=call.event.rollout_id,
        attempt_id=call.event.attempt_id,
        event_id=call.event.id,
        call_index=call.call_index,
        choice_index=choice.index,
        prompt_ids=call.prompt_ids,
        completion_ids=choice.token_ids,
        logprobs=choice.logprobs,
        reward=reward,
    )


# ---------------------------------------------------------------------------- trajectories

_Step = tuple[_CallTokens, _ChoiceTokens]


def to_trajectories(
    events: Sequence[Event],
    reward: float | None = None,
    group_id: str | None = None,
    task_id: str | None = None,
) -> tuple[list[TrajectoryRow], AdapterStats]:
    """Merge each attempt's calls into token sequences; one row per unbroken prefix chain.

    ``group_id`` / ``task_id`` are copied onto the rows (events do not carry them; take them
    from the :class:`~agentbolt.schemas.Rollout`)."""
    rows: list[TrajectoryRow] = []
    stats = AdapterStats()
    for attempt_events in split_attempts(events):
        calls, attempt_stats = _parse_calls(attempt_events)
        segments, mismatch_stats = _segments(calls)
        base, overrides = rollout_reward(attempt_events, reward), call_rewards(attempt_events)
        states = call_states(attempt_events)
        for index, steps in enumerate(segments):
            row = _trajectory(steps, index, base, overrides, states)
            rows.append(replace(row, group_id=group_id, task_id=task_id))
        stats += attempt_stats + mismatch_stats
    return rows, stats


def _is_prefix(prefix: Sequence[Any], sequence: Sequence[Any]) -> bool:
    return len(prefix) <= len(sequence) and list(sequence[: len(prefix)]) == list(prefix)


def _followed_choice(call: _CallTokens, next_call: _CallTokens | None) -> _ChoiceTokens:
    """The choice the next prompt continues, else the lowest-index one."""
    next_prompt = next_call.prompt_ids if next_call is not None else ()
    followed = [c for c in call.choices if _is_prefix(call.prompt_ids + c.token_ids, next_prompt)]
    return (followed or list(call.choices))[0]


def _segments(calls: Sequence[_CallTokens]) -> tuple[list[list[_Step]], AdapterStats]:
    """Split calls into chains where each prompt extends the previous prompt + completion."""
    segments: list[list[_Step]] = []
    previous: tuple[int, ...] = ()
    mismatches = end_token = 0
    for i, call in enumerate(calls):
        choice = _followed_choice(call, calls[i + 1] if i + 1 < len(calls) else None)
        if segments and _is_prefix(previous, call.prompt_ids):
            segments[-1].append((call, choice))
        else:
            if segments:
                mismatches += 1
                end_token += _is_prefix(previous[:-1], call.prompt_ids)
            segments.append([(call, choice)])
        previous = call.prompt_ids + choice.token_ids
    return segments, AdapterStats(prefix_mismatches=mismatches, end_token_mismatches=end_token)


def _trajectory(
    steps: Sequence[_Step],
    segment_index: int,
    base: float | None,
    overrides: dict[int, float],
    states: dict[int, str],
) -> TrajectoryRow:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] | None = []
    spans: list[CallSpan] = []
    for call, choice in steps:
        new_context = call.prompt_ids[len(ids) :]
        ids += new_context + choice.token_ids
        mask += [0] * len(new_context) + [1] * len(choice.token_ids)
        if logprobs is not None and choice.logprobs is not None:
            logprobs += [0.0] * len(new_context) + list(choice.logprobs)
        else:
            logprobs = None
        end = len(ids)
        event_id = call.event.id
        spans.append(
            CallSpan(
                event_id,
                choice.index,
                start=end - len(choice.token_ids),
                end=end,
                reward=overrides.get(event_id, base),
                step_reward=overrides.get(event_id),
                state=states.get(event_id),
            )
        )
    first = steps[0][0].event
    return TrajectoryRow(
        rollout_id=first.rollout_id,
        attempt_id=first.attempt_id,
        segment_index=segment_index,
        input_ids=tuple(ids),
        loss_mask=tuple(mask),
        logprobs=tuple(logprobs) if logprobs is not None else None,
        reward=base,
        calls=tuple(spans),
    )


# ---------------------------------------------------------------------------- chat rows

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def _clean_tool_call(raw: dict[str, Any]) -> dict[str, Any]:
    function = raw.get("function") or {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, sort_keys=True)
    call = {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}
    return {"id": raw["id"], **call} if raw.get("id") is not None else call


def _clean_message(raw: dict[str, Any]) -> dict[str, Any]:
    """Only the keys the fine-tuning format knows; ``None`` values dropped."""
    message = {k: raw[k] for k in _MESSAGE_KEYS if raw.get(k) is not None}
    if message.get("tool_calls"):
        message["tool_calls"] = [_clean_tool_call(tc) for tc in message["tool_calls"]]
    else:
        message.pop("tool_calls", None)
    return message


def _chat_row(event: Event, examples: bool = True) -> dict[str, Any] | None:
    data = event.data
    # a Responses call the gateway translated keeps the chat request the model was asked
    request = data.get("chat_request") if data.get("endpoint") == "responses" else data.get("request")
    choices = data.get("choices") or []
    response = choices[0].get("message") if choices else None
    if not request or data.get("error") or not response:
        return None
    messages = request.get("messages", [])
    messages = [
        _clean_message(m)
        for m in (messages if examples else drop_examples(messages, data.get("examples", 0)))
    ]
    row: dict[str, Any] = {"messages": [*messages, _clean_message({"role": "assistant", **response})]}
    if request.get("tools"):
        row["tools"] = request["tools"]
    return row


def _continues(row: dict[str, Any], later: dict[str, Any]) -> bool:
    return row.get("tools") == later.get("tools") and _is_prefix(row["messages"], later["messages"])


def to_chat_rows(events: Sequence[Event], examples: bool = True) -> list[dict[str, Any]]:
    """``{"messages": [...], "tools": [...]?}`` rows: a call's request messages plus its
    response message (choice 0), for every chat call whose conversation no later call continues
    - for a linear agent that is just the last call. Keys are normalized, so identical
    conversations give identical rows; dedupe across rollouts with :func:`chat_row_key`.
    ``examples`` False: without the example turns the gateway put in (:mod:`agentbolt.turns`)."""
    rows = [row for e in system_calls(events) if (row := _chat_row(e, examples)) is not None]
    return [row for i, row in enumerate(rows) if not any(_continues(row, later) for later in rows[i + 1 :])]


def chat_row_key(row: dict[str, Any]) -> str:
    """A canonical string of a chat row: equal rows give equal keys."""
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
