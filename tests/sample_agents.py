"""Agents used by the runner and CLI tests (loaded by file path in subprocesses)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time

from agentbolt import LitAgent, Task, Trajectory, emit_message, emit_reward, emit_tool_call, rollout
from agentbolt.runner.agent import emit_event, rollout_thread


@rollout
def echo(task: Task, system_prompt: str = "") -> float:
    emit_message(f"{system_prompt}{task.data.get('q', '')}")
    if task.data.get("fail"):
        raise ValueError(f"task {task.id} asked to fail")
    return float(task.data.get("reward", 1.0))


@rollout
def slow(task: Task) -> float:
    delay = float(task.data.get("sleep", os.environ.get("AGENT_SLEEP", "1.0")))
    emit_message(f"start pid={os.getpid()}")
    time.sleep(delay)
    emit_message("end")
    return 1.0


class AsyncToolAgent(LitAgent):
    async def execute_rollout(self, task: Task) -> Trajectory:
        await asyncio.sleep(0.01)

        def in_thread() -> None:
            emit_tool_call("adder", {"a": 1, "b": 2}, result=3)

        await asyncio.to_thread(in_thread)  # to_thread carries the rollout context along
        # a thread started by hand needs the context handed over explicitly
        worker = threading.Thread(target=contextvars.copy_context().run, args=(in_thread,))
        worker.start()
        worker.join()
        await asyncio.gather(*(self._sub(i) for i in range(3)))
        return Trajectory(task_id=task.id, final_response="done", total_reward=0.5, trace=[{"step": 1}])

    async def _sub(self, i: int) -> None:
        await asyncio.sleep(0.001)
        emit_reward(0.1 * i, name=f"part{i}")


@rollout
def emits_only(task: Task) -> None:
    emit_reward(0.25)
    emit_reward(0.5)


class AsyncSleeper(LitAgent):
    """Sleeps ``task.data["sleep"]`` seconds; a cancellation is written to ``task.data["log"]``
    (a file: the test may run this agent in another process)."""

    async def execute_rollout(self, task: Task) -> float:
        emit_message("started")
        try:
            await asyncio.sleep(float(task.data.get("sleep", 60)))
        except asyncio.CancelledError:
            if "log" in task.data:
                with open(task.data["log"], "a") as log:
                    log.write(f"cancelled {task.id} {time.time()}\n")
            raise
        return 1.0


@rollout
def big_events(task: Task) -> float:
    """Emits what the server refuses (an int over 64 bits, a message of ``big`` characters) or
    what JSON cannot carry, between two events it takes."""
    emit_message("before")
    if task.data.get("huge_int"):
        emit_event("counter", {"n": 2**70})
    if task.data.get("big"):
        emit_message("x" * int(task.data["big"]))
    if task.data.get("unencodable"):
        emit_event("handle", {"socket": object()})
    emit_message("after")
    return 1.0


class NeedsArgs(LitAgent):
    def __init__(self, model: str, temperature: float = 0.7) -> None:
        super().__init__()
        self.model, self.temperature = model, temperature

    def execute_rollout(self, task: Task) -> float:
        return 1.0


pair = threading.Barrier(2, timeout=30)
"""Holds the agents below until two rollouts run at once (tasks with ``"pair": true``)."""


def _from_a_thread(task: Task, start_thread) -> float:
    """Emit from a thread the agent starts; an error there fails the rollout."""
    if task.data.get("pair"):
        pair.wait()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            emit_message(f"from a thread of {task.id}")
        except RuntimeError as exc:
            errors.append(exc)

    thread = start_thread(work)
    thread.start()
    thread.join()
    if task.data.get("pair"):
        pair.wait()  # neither rollout ends before both threads emitted
    if errors:
        raise errors[0]
    return 1.0


@rollout
def plain_thread(task: Task) -> float:
    return _from_a_thread(task, lambda target: threading.Thread(target=target))


@rollout
def carried_thread(task: Task) -> float:
    return _from_a_thread(task, rollout_thread)
