"""Agents for tests/scale/test_ray_runners.py, imported by the Ray actors (by name or by file
path), so they live in a module of their own.

``counted`` is :func:`scale_agents.chatty` with a side effect: when it is about to return, it
appends ``rollout_id attempt_id pid`` to the file ``task.data["log"]`` (one short ``O_APPEND``
write: whole lines, even from several processes), so a test can count completions."""

from __future__ import annotations

import os
import time

from agentbolt import Task, current_rollout, emit_message, rollout


@rollout
def counted(task: Task) -> float:
    for i in range(int(task.data.get("events", 3))):
        emit_message(f"{task.id} step {i}")
        time.sleep(float(task.data.get("sleep", 0.0)))
    ctx = current_rollout()
    line = f"{ctx.rollout.id} {ctx.attempt.id} {os.getpid()}\n".encode()
    fd = os.open(task.data["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return 1.0
