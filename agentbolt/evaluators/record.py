"""What an evaluator sees of a finished rollout, and the transcript a judge reads.

:func:`record_of` turns a rollout and its events into a :class:`RolloutRecord`: the task, the
final conversation, every model call, the tool calls and the final answer. Only the latest
attempt counts (the retry that finished), as for training.

:func:`transcript` renders a record as plain text within a character limit, cut in a stated
way so that a judge never reads a silently shortened run:

1. the task, the first user message and the final answer are kept whole;
2. whole turns between the first user message and the final answer are dropped, oldest first,
   and ``[... N turns (M characters) cut ...]`` stands where they were;
3. if the text is still too long, the middle of the longest remaining part is cut (marked
   ``[... K characters cut ...]``), then the next longest, until it fits.

The cut is returned with the text (``chars_before``, ``chars_after``, ``turns_cut``,
``chars_cut``) so it can be recorded with the score.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentbolt.adapters import latest_attempt, to_chat_rows
from agentbolt.schemas import Event, EventType, Rollout

__all__ = ["CallRecord", "RolloutRecord", "record_of", "transcript", "usage_tokens"]


@dataclass(frozen=True)
class CallRecord:
    """One model call of the rollout, as the gateway recorded it."""

    messages: list[dict[str, Any]]
    """The request's messages."""
    answer: str | None
    """The first choice's text; None when the call failed or answered no text."""
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class RolloutRecord:
    """A finished rollout as evaluators see it."""

    rollout: Rollout
    task: dict[str, Any]
    """The task's data."""
    messages: list[dict[str, Any]]
    """The final conversation as chat messages (the last call's request plus its answer)."""
    calls: list[CallRecord]
    tool_calls: list[dict[str, Any]]
    """The ``tool_call`` events' data: name, arguments, result, error."""
    output: str | None
    """The final assistant text, or what the agent returned as its final response; None
    when there is neither."""


def record_of(rollout: Rollout, events: Sequence[Event]) -> RolloutRecord:
    """The record of ``rollout`` from its events (any attempts; the latest one is read)."""
    latest = latest_attempt(events)
    rows = to_chat_rows(latest)
    messages = rows[-1]["messages"] if rows else _message_events(latest)
    return RolloutRecord(
        rollout=rollout,
        task=dict(rollout.task.data),
        messages=messages,
        calls=[_call_record(e) for e in latest if e.type == EventType.LLM_CALL],
        tool_calls=[dict(e.data) for e in latest if e.type == EventType.TOOL_CALL],
        output=_output(messages, latest),
    )


def _message_events(events: Sequence[Event]) -> list[dict[str, Any]]:
    """A conversation from ``message`` events, for an agent that made no recorded model call."""
    roles = ("system", "user", "assistant", "tool")
    return [
        {"role": e.data["role"], "content": _text(e.data.get("content"))}
        for e in events
        if e.type == EventType.MESSAGE and e.data.get("role") in roles
    ]


def _call_record(event: Event) -> CallRecord:
    data = event.data
    request = data.get("chat_request") if data.get("endpoint") == "responses" else data.get("request")
    choices = data.get("choices") or []
    first = choices[0] if choices else {}
    message = first.get("message") if isinstance(first, dict) else None
    answer = message.get("content") if isinstance(message, dict) else first.get("text")
    latency = data.get("latency_ms")
    error = data.get("error")
    return CallRecord(
        messages=list((request or {}).get("messages") or []),
        answer=answer if isinstance(answer, str) else None,
        usage=dict(data.get("usage") or {}),
        latency_s=latency / 1000 if isinstance(latency, int | float) else None,
        error=json.dumps(error) if error else None,
    )


def _output(messages: list[dict[str, Any]], events: Sequence[Event]) -> str | None:
    if messages and messages[-1].get("role") == "assistant":
        content = messages[-1].get("content")
        if isinstance(content, str) and content:
            return content
    finals = [e.data.get("final_response") for e in events if e.type == "trajectory"]
    if finals and finals[-1] is not None:
        return _text(finals[-1])
    stdout = [
        e.data.get("content")
        for e in events
        if e.type == EventType.MESSAGE and e.data.get("role") == "stdout"
    ]
    return _text(stdout[-1]) if stdout else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_tokens(usage: dict[str, Any]) -> int | None:
    """Tokens a call used as its model reported them: ``total_tokens``, or prompt + completion;
    None when it reported neither."""
    total = _count(usage.get("total_tokens"))
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    if total is None and prompt is not None and completion is not None:
        total = prompt + completion
    return total


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------- transcript


def _render_message(message: dict[str, Any]) -> str:
    role = message.get("role", "?")
    if role == "tool" and message.get("name"):
        role = f"tool {message['name']}"
    content = message.get("content")
    text = "" if content is None else _text(content)
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        text += f"\n(calls {function.get('name')}({function.get('arguments', '')}))"
    return f"[{role}] {text.strip()}"


@dataclass
class _Parts:
    """The transcript as parts: a head kept whole (the task, messages before the first user
    message), the first user message, the middle turns (dropped oldest first), the final
    answer; and what was dropped, which a marker stands for."""

    head: list[str]
    first_user: str | None
    middle: list[str]
    final: list[str]
    turns_cut: int = 0
    chars_dropped: int = 0

    def pieces(self) -> list[str]:
        marker = [f"[... {self.turns_cut} turns ({self.chars_dropped} characters) cut ...]"]
        first = [self.first_user] if self.first_user is not None else []
        return [*self.head, *first, *(marker if self.turns_cut else []), *self.middle, *self.final]


def _parts(record: RolloutRecord, task: bool) -> _Parts:
    head = [f"TASK:\n{json.dumps(record.task, ensure_ascii=False, indent=1)}"] if task else []
    messages = list(record.messages)
    final_message = None
    if messages and messages[-1].get("role") == "assistant" and record.output == messages[-1].get("content"):
        final_message = messages.pop()
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        head += [_render_message(m) for m in messages]
        return _Parts(head, None, [], _final(record, final_message))
    head += [_render_message(m) for m in messages[:first_user]]
    middle = [_render_message(m) for m in messages[first_user + 1 :]]
    return _Parts(head, _render_message(messages[first_user]), middle, _final(record, final_message))


def _final(record: RolloutRecord, final_message: dict[str, Any] | None) -> list[str]:
    if final_message is not None:
        return [f"FINAL ANSWER:\n{_render_message(final_message)}"]
    return [f"FINAL ANSWER:\n{record.output}" if record.output is not None else "FINAL ANSWER: (none)"]


_SEP = "\n\n"


def _join(pieces: list[str]) -> str:
    return _SEP.join(pieces)


def _cut_middle(text: str, remove: int) -> tuple[str, int]:
    """``text`` with about ``remove`` characters cut from its middle (more, for the marker);
    returns the new text and the characters cut. A text too short to gain is left as is."""
    marker_room = 40
    cut = min(len(text), remove + marker_room)
    if cut <= marker_room:
        return text, 0
    keep = len(text) - cut
    head, tail = text[: (keep + 1) // 2], text[len(text) - keep // 2 :]
    return f"{head}[... {cut} characters cut ...]{tail}", cut


def transcript(
    record: RolloutRecord, max_chars: int, *, task: bool = True
) -> tuple[str, dict[str, int] | None]:
    """The record as text of at most ``max_chars`` characters (``task=False`` leaves the task
    out: a group judge shows it once), and the cut made, or None when nothing was cut."""
    parts = _parts(record, task)
    full = _join(parts.pieces())
    if len(full) <= max_chars:
        return full, None
    while parts.middle and len(_join(parts.pieces())) > max_chars:
        dropped = parts.middle.pop(0)
        parts.turns_cut += 1
        parts.chars_dropped += len(dropped)
    pieces = parts.pieces()
    chars_cut = 0
    tried: set[int] = set()
    while len(_join(pieces)) > max_chars and len(tried) < len(pieces):
        longest = max((i for i in range(len(pieces)) if i not in tried), key=lambda i: len(pieces[i]))
        tried.add(longest)
        pieces[longest], removed = _cut_middle(pieces[longest], len(_join(pieces)) - max_chars)
        chars_cut += removed
    text = _join(pieces)
    cut = {
        "chars_before": len(full),
        "chars_after": len(text),
        "turns_cut": parts.turns_cut,
        "chars_cut": parts.chars_dropped + chars_cut,
    }
    return text, cut
