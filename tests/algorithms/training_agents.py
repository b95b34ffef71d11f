"""Agents the training tests hand to runner processes. A runner process imports the module that
defines its agent (the agent travels by name), so they live here, in a module that imports
no torch, rather than in the test modules that train (each of those costs a runner process
seconds of CPU to import)."""

from __future__ import annotations

import asyncio
import os
import random
import time
import zlib
from pathlib import Path
from typing import Any

import openai

from agentbolt import LitAgent, Task, emit_reward, emit_state, rollout
from agentbolt.evaluators import RolloutRecord
from agentbolt.runner.agent import emit_event
from agentbolt.runner.llm import async_openai
from agentbolt.schemas import LLM


class VowelAgent(LitAgent):
    """One chat call; the reward is the share of 'a' among the reply's letters (a spread
    a random model shows from the first step)."""

    async def execute_rollout(self, task: Task) -> float:
        import openai

        llm: LLM = self.get_resource("llm")
        async with openai.AsyncOpenAI(
            base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0
        ) as client:
            response = await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": task.data["q"]}],
                max_tokens=8,
                temperature=1.0,
            )
        text = response.choices[0].message.content or ""
        letters = [c for c in text.lower() if c.isalpha()]
        return letters.count("a") / len(letters) if letters else 0.0


class LengthAgent(VowelAgent):
    """Reward: the reply's length (a random model's replies all but never tie within a group)."""

    async def execute_rollout(self, task: Task) -> float:
        llm: LLM = self.get_resource("llm")
        response = await async_openai(llm).chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task.data["q"]}],
            max_tokens=8,
            temperature=1.0,
        )
        return len(response.choices[0].message.content or "") / 40


class VictimAgent(VowelAgent):
    """VowelAgent, except that the first rollout of the run (whichever runner process claims it)
    makes its model call, writes its process id to ``victim.pid`` and waits to be killed."""

    async def execute_rollout(self, task: Task) -> float:
        reward = await super().execute_rollout(task)
        marker = Path(task.data["dir"]) / "victim.claimed"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return reward
        pid_file = Path(task.data["dir"]) / "victim.pid"
        pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
        pid_file.with_suffix(".tmp").rename(pid_file)
        await asyncio.sleep(60)  # the test SIGKILLs this process long before
        return reward


class SamplingAgent(LitAgent):
    """One chat call with the LLM resource's own sampling parameters (so a greedy resources
    version decodes greedily). Reward: the reply's length (a random model's replies all but never
    tie within a group), or with ``task.data["reward"] == "crc"`` a checksum of the reply, a
    deterministic function of the text. ``task.data`` can also make chosen rollouts stall
    (``stall``: the first claimed copy of the task sleeps until cancelled) or fail (``ok``: only
    that many copies of the task succeed, the rest raise)."""

    async def execute_rollout(self, task: Task) -> float:
        folder = Path(task.data.get("dir", "."))
        if task.data.get("stall") and _first(folder / f"{task.id}.stalled"):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                (folder / f"{task.id}.cancelled").write_text(str(time.time()))
                raise
        if "ok" in task.data and not any(_first(folder / f"{task.id}.ok{i}") for i in range(task.data["ok"])):
            raise RuntimeError("this copy fails on purpose")
        llm: LLM = self.get_resource("llm")
        response = await async_openai(llm).chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task.data["q"]}],
            **{"max_tokens": 8, "temperature": 1.0, **llm.sampling_parameters},
        )
        text = response.choices[0].message.content or ""
        if task.data.get("reward") == "crc":
            return zlib.crc32(text.encode()) / 2**32
        return len(text) / 40


def _first(marker: Path) -> bool:
    """True for exactly one caller across processes: the one that creates ``marker``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class SleepyAgent(LitAgent):
    """One chat call, then a sleep of ``task.data["sleep"]`` seconds (a slow tool). Reward: the
    reply's length plus a little noise, so every group has a spread."""

    async def execute_rollout(self, task: Task) -> float:
        llm: LLM = self.get_resource("llm")
        response = await async_openai(llm).chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task.data["q"]}],
            max_tokens=8,
            temperature=1.0,
        )
        await asyncio.sleep(task.data.get("sleep", 0.0))
        return len(response.choices[0].message.content or "") / 40 + random.random() * 1e-3


TURNS = 3


class ThreeTurnAgent(LitAgent):
    """Three calls in one conversation (a user turn between them). Each call earns a step
    reward (the share of 'a' among its letters) and is declared in state ``<task>:<turn>``; the
    rollout's reward is the last reply's length."""

    async def execute_rollout(self, task: Task) -> float:
        llm: LLM = self.get_resource("llm")
        messages = [{"role": "user", "content": task.data["q"]}]
        text = ""
        async with openai.AsyncOpenAI(
            base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0
        ) as client:
            for turn in range(TURNS):
                response = await client.chat.completions.create(
                    model=llm.model,
                    messages=messages,
                    max_tokens=6,
                    temperature=1.0,  # type: ignore[arg-type]
                )
                text = response.choices[0].message.content or ""
                letters = [c for c in text.lower() if c.isalpha()]
                emit_reward(letters.count("a") / len(letters) if letters else 0.0, call=response)
                emit_state(f"{task.id}:{turn}", call=response)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        return len(text) / 40


class SilentVowelAgent(LitAgent):
    """One chat call and no reward at all: what it is worth is for an evaluator to say."""

    async def execute_rollout(self, task: Task) -> None:
        import openai

        llm: LLM = self.get_resource("llm")
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0) as c:
            await c.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": task.data["q"]}],
                max_tokens=8,
                temperature=1.0,
            )


def vowel_share(record: RolloutRecord) -> float:
    letters = [c for c in (record.output or "").lower() if c.isalpha()]
    return letters.count("a") / len(letters) if letters else 0.0


@rollout
def scripted(task: Task) -> float:
    """Pretends to be an agent whose model calls went through the gateway: records the call the
    task describes and returns the task's reward."""
    prompt, completion = task.data["prompt"], task.data["completion"]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "c"},
        "token_ids": completion,
        "logprobs": [-1.0] * len(completion),
    }
    emit_event(
        "llm_call",
        {
            "endpoint": "chat.completions",
            "request": {"messages": []},
            "prompt_token_ids": prompt,
            "choices": [choice],
        },
    )
    return float(task.data["reward"])


@rollout
def chat_agent(task: Task, llm: LLM) -> float:
    """Two chat turns through the gateway; the reward prefers even-length answers."""
    from openai import OpenAI

    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0, timeout=60)
    messages: list[Any] = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": task.data["q"]},
    ]
    first = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "The calculator says 42."},
    ]
    second = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
    return 1.0 if len(second.choices[0].message.content or "") % 2 == 0 else 0.0
