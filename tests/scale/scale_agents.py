"""Agents for the scale and chaos tests (loaded by file path, also by runner subprocesses).

``chatty`` emits ``task.data["events"]`` messages (sleeping ``sleep`` seconds after each), then
returns reward 1.0, so every succeeded attempt must hold exactly those messages plus the final
reward event: :func:`expected_events` says what, :func:`check_events` checks it.
"""

from __future__ import annotations

import time
from typing import Any

from agentbolt import Task, current_rollout, emit_message, rollout


@rollout
def chatty(task: Task) -> float:
    for i in range(int(task.data.get("events", 3))):
        emit_message(f"{task.id} step {i}")
        time.sleep(float(task.data.get("sleep", 0.0)))
    return 1.0


@rollout
def llm_caller(task: Task) -> float:
    """Calls the rollout's LLM through the gateway; ``task.data["say"]`` per attempt number
    (a list: attempt 1 says the first item, ...). A failed call raises: the attempt fails."""
    import openai

    ctx = current_rollout()
    llm = next(r for r in (ctx.resources.resources.values() if ctx.resources else []) if r.type == "llm")
    says = task.data["say"]
    say = says[min(ctx.attempt.number, len(says)) - 1]
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=60)
    try:
        answer = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": say}])
    finally:
        client.close()
    emit_message(answer.choices[0].message.content or "")
    return 1.0


def expected_events(task_data: dict[str, Any], task_id: str) -> list[tuple[str, Any]]:
    n = int(task_data.get("events", 3))
    return [("message", f"{task_id} step {i}") for i in range(n)] + [("reward", 1.0)]


def check_events(events: list[Any], task_data: dict[str, Any], task_id: str) -> str | None:
    """None when ``events`` (one succeeded attempt's) are exactly what ``chatty`` emitted."""
    got = sorted(events, key=lambda e: e.sequence if e.sequence is not None else -1)
    seen = [(e.type, e.data.get("content") if e.type == "message" else e.data.get("value")) for e in got]
    want = expected_events(task_data, task_id)
    if seen != want:
        return f"events {seen} != {want}"
    if [e.sequence for e in got] != list(range(len(want))):
        return f"sequences {[e.sequence for e in got]}"
    return None
