"""A rollout as a rich tree, for ``agentbolt rollouts show ID``.

Attempts are branches; under each, its events in order. An ``llm_call`` shows its messages
(those new since the attempt's previous call; the rest are counted), the answer, prompt and
completion token counts and latency. Rewards, tool calls, messages, spans and exceptions (with
their traceback) each get one line or a small block. Long text is cut to keep the view readable.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from rich.text import Text
from rich.tree import Tree

from agentbolt.schemas import Attempt, Event, EventType, Rollout

__all__ = ["render_rollout"]

MAX_TEXT = 240
MAX_TRACEBACK_LINES = 20
_STATUS_STYLE = {
    "succeeded": "green",
    "failed": "red",
    "running": "yellow",
    "queued": "cyan",
    "cancelled": "dim",
    "timed_out": "red",
    "lease_expired": "red",
    "released": "dim",
}


def _cut(value: Any, limit: int = MAX_TEXT) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clock(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3] if ts else "--:--:--"


def _status(status: str) -> Text:
    return Text(status, style=_STATUS_STYLE.get(status, "white"))


def render_rollout(rollout: Rollout, attempts: Sequence[Attempt], events: Sequence[Event]) -> Tree:
    """The whole rollout: header, task, then one branch per attempt with its events."""
    head = Text.assemble(
        ("rollout ", "bold"),
        (rollout.id, "bold cyan"),
        "  ",
        _status(rollout.status.value),
        f"  mode {rollout.mode.value}  resources v{rollout.resources_version or '-'}",
        f"  reward {_number(rollout.reward)}",
    )
    tree = Tree(head)
    tree.add(Text(f"task {rollout.task.id}: {_cut(rollout.task.data)}", style="dim"))
    if rollout.error:
        tree.add(Text(f"error: {_cut(rollout.error, 1000)}", style="red"))
    by_attempt: dict[str, list[Event]] = {}
    for event in sorted(events, key=lambda e: (e.timestamp, e.id)):
        by_attempt.setdefault(event.attempt_id, []).append(event)
    for attempt in attempts:
        _attempt(tree, attempt, by_attempt.pop(attempt.id, []))
    for attempt_id, orphans in by_attempt.items():  # events of attempts not listed
        _attempt_events(tree.add(Text(f"attempt {attempt_id}", style="bold")), orphans)
    return tree


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _attempt(tree: Tree, attempt: Attempt, events: list[Event]) -> None:
    took = f"  {attempt.ended_at - attempt.started_at:.2f} s" if attempt.ended_at else ""
    label = Text.assemble(
        (f"attempt {attempt.number} ", "bold"),
        (attempt.id, "cyan"),
        "  ",
        _status(attempt.status.value),
        f"  worker {attempt.worker_id}",
        f"  reward {_number(attempt.reward)}{took}",
    )
    branch = tree.add(label)
    if attempt.error:
        branch.add(Text(f"error: {_cut(attempt.error, 1000)}", style="red"))
    _attempt_events(branch, events)


def _attempt_events(branch: Tree, events: list[Event]) -> None:
    previous: list[tuple[Any, Any]] = []  # (role, content) of the conversation so far
    # the attempt's turns: its model calls numbered in order; per-call rewards and states name them
    turns = {e.id: n for n, e in enumerate((e for e in events if e.type == EventType.LLM_CALL), 1)}
    for event in events:
        prefix = f"{_clock(event.timestamp)} "
        if event.type == EventType.LLM_CALL:
            previous = _llm_call(branch, event, prefix, previous, turns.get(event.id))
        elif event.type == EventType.REWARD:
            _reward(branch, event, prefix, turns)
        elif event.type == EventType.STATE:
            _state(branch, event, prefix, turns)
        else:
            _RENDERERS.get(event.type, _other)(branch, event, prefix)


# ---------------------------------------------------------------------------- llm calls


def _token_counts(data: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = data.get("usage") or {}
    prompt = (
        len(data["prompt_token_ids"])
        if data.get("prompt_token_ids") is not None
        else usage.get("prompt_tokens")
    )
    ids = [c.get("token_ids") for c in data.get("choices") or []]
    completion = (
        sum(len(i) for i in ids)
        if ids and all(i is not None for i in ids)
        else usage.get("completion_tokens")
    )
    return prompt, completion


def _llm_call(
    branch: Tree, event: Event, prefix: str, previous: list[tuple[Any, Any]], turn: int | None = None
) -> list[tuple[Any, Any]]:
    data = event.data
    prompt, completion = _token_counts(data)
    error = data.get("error")
    label = Text.assemble(
        prefix,
        ("llm_call", "bold magenta"),
        f" #{event.id}" + (f" turn {turn}" if turn is not None else "") + f" {data.get('endpoint', '')}",
        f"  model {data.get('model')}",
        f" v{data['model_version']}" if data.get("model_version") else "",
        f"  prompt {_count(prompt)} tok  completion {_count(completion)} tok",
        f"  {data.get('latency_ms', 0):.0f} ms",
        "  stream" if data.get("stream") else "",
        (f"  HTTP {data.get('upstream_status')}", "red") if error else "",
    )
    node = branch.add(label)
    request = data.get("request") or {}
    if data.get("endpoint") == "completions":
        node.add(Text(f"prompt: {_cut(request.get('prompt'))}", style="dim"))
        conversation: list[tuple[Any, Any]] = []
    else:
        conversation = _messages(node, request.get("messages") or [], previous)
    for choice in data.get("choices") or []:
        node.add(_answer(choice, len(data["choices"]) > 1))
    if error:
        node.add(
            Text(
                f"error: {_cut(error.get('error', error) if isinstance(error, dict) else error)}", style="red"
            )
        )
    answer = (data.get("choices") or [{}])[0].get("message") or {}
    return conversation + [(answer.get("role"), answer.get("content"))] if answer else conversation


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _messages(
    node: Tree, messages: list[dict[str, Any]], previous: list[tuple[Any, Any]]
) -> list[tuple[Any, Any]]:
    pairs = [(m.get("role"), m.get("content")) for m in messages]
    shared = 0
    while shared < min(len(pairs), len(previous)) and pairs[shared] == previous[shared]:
        shared += 1
    if shared:
        node.add(Text(f"… {shared} earlier message(s)", style="dim"))
    for message in messages[shared:]:
        node.add(_message_line(message))
    return pairs


def _message_line(message: dict[str, Any]) -> Text:
    role = message.get("role", "?")
    parts = [_cut(message["content"])] if message.get("content") else []
    parts += [
        f"{c.get('function', {}).get('name')}({_cut(c.get('function', {}).get('arguments'), 120)})"
        for c in message.get("tool_calls") or []
    ]
    return Text.assemble((f"{role}: ", "bold"), " ".join(parts) or "(empty)")


def _answer(choice: dict[str, Any], numbered: bool) -> Text:
    tag = f"→ [{choice.get('index')}] " if numbered else "→ "
    finish = f"  ({choice.get('finish_reason')})" if choice.get("finish_reason") not in (None, "stop") else ""
    if "text" in choice:
        return Text.assemble((tag, "green"), _cut(choice.get("text")), finish)
    message = choice.get("message") or {}
    return Text.assemble((tag, "green"), _message_line(message), finish)


# ---------------------------------------------------------------------------- other events


def _call_named(data: dict[str, Any], turns: dict[int, int] | None) -> str:
    """``call #N`` (``, turn T`` when it is one of this attempt's calls)."""
    call = data.get("llm_call_id")
    turn = (turns or {}).get(call) if isinstance(call, int) else None
    return f"call #{call}" + (f", turn {turn}" if turn is not None else "")


def _reward(branch: Tree, event: Event, prefix: str, turns: dict[int, int] | None = None) -> None:
    data = event.data
    extras = [f"name {data['name']}"] if data.get("name") else []
    extras += [_call_named(data, turns)] if data.get("llm_call_id") is not None else []
    extras += ["final"] if data.get("final") else []
    branch.add(
        Text.assemble(
            prefix,
            ("reward ", "bold green"),
            _number(data.get("value")),
            f"  ({', '.join(extras)})" if extras else "",
        )
    )


def _state(branch: Tree, event: Event, prefix: str, turns: dict[int, int] | None = None) -> None:
    data = event.data
    branch.add(
        Text.assemble(
            prefix,
            ("state ", "bold cyan"),
            _cut(data.get("key"), 160),
            f"  ({_call_named(data, turns)})" if data.get("llm_call_id") is not None else "",
        )
    )


def _tool_call(branch: Tree, event: Event, prefix: str) -> None:
    data = event.data
    took = f"  {data['duration_ms']:.1f} ms" if data.get("duration_ms") is not None else ""
    outcome = (
        (f" ✗ {_cut(data['error'], 160)}", "red")
        if data.get("error")
        else f" → {_cut(data.get('result'), 160)}"
    )
    branch.add(
        Text.assemble(
            prefix,
            ("tool_call ", "bold blue"),
            f"{data.get('name')}({_cut(data.get('arguments'), 120)})",
            outcome,
            took,
        )
    )


def _message(branch: Tree, event: Event, prefix: str) -> None:
    data = event.data
    branch.add(
        Text.assemble(prefix, ("message ", "bold"), f"[{data.get('role')}] ", _cut(data.get("content")))
    )


def _exception(branch: Tree, event: Event, prefix: str) -> None:
    data = event.data
    node = branch.add(
        Text.assemble(prefix, ("exception ", "bold red"), f"{data.get('type')}: {_cut(data.get('message'))}")
    )
    lines = (data.get("traceback") or "").rstrip().splitlines()
    if len(lines) > MAX_TRACEBACK_LINES:
        lines = ["…", *lines[-MAX_TRACEBACK_LINES:]]
    if lines:
        node.add(Text("\n".join(lines), style="dim red"))


def _span(branch: Tree, event: Event, prefix: str) -> None:
    data = event.data
    start, end = data.get("start_time"), data.get("end_time")
    took = f"  {(end - start) * 1000:.1f} ms" if start is not None and end is not None else ""
    failed = (data.get("status") or {}).get("code") == "error"
    attrs = {k: v for k, v in (data.get("attributes") or {}).items() if not k.startswith("agentbolt.")}
    branch.add(
        Text.assemble(
            prefix,
            ("span ", "bold yellow"),
            str(data.get("name")),
            took,
            ("  error", "red") if failed else "",
            f"  {_cut(attrs, 160)}" if attrs else "",
        )
    )


def _other(branch: Tree, event: Event, prefix: str) -> None:
    branch.add(Text.assemble(prefix, (f"{event.type} ", "bold"), _cut(event.data)))


_RENDERERS: dict[str, Callable[[Tree, Event, str], None]] = {
    EventType.REWARD: _reward,
    EventType.TOOL_CALL: _tool_call,
    EventType.MESSAGE: _message,
    EventType.EXCEPTION: _exception,
    EventType.SPAN: _span,
}
