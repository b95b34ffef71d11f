"""Agents used by the runner and CLI tests (loaded by file path in subprocesses)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time

from agentbolt import LitAgent, Task, Trajectory, emit_message, emit_reward, emit_tool_call, rollout


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
