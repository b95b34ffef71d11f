"""A store with something to show: three resources versions (two prompt edits, one weights
checkpoint), finished, failed, running and queued rollouts, LLM calls in the docs/events.md
shape, tool calls, rewards and an exception with its traceback.

Everything goes through the HTTP API with the admin token, as an algorithm and runners would.
Only the clock is bent afterwards (finish times spread over the last half hour, one runner
last seen long ago) so that the throughput chart and the runner states have something to show.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from agentbolt.client import Client
from agentbolt.schemas import (
    LLM,
    AttemptStatus,
    AwaitedReward,
    EventCreate,
    Mode,
    ModelWeights,
    PromptTemplate,
    RewardScale,
    RewardSource,
    RolloutCreate,
    Task,
)
from agentbolt.store import SqlStore

PROMPT_V1 = """You are a careful assistant that answers arithmetic questions.
Think step by step.
Use the calculator tool for every computation.
Answer with the final number only."""

PROMPT_V2 = """You are a careful assistant that answers arithmetic questions.
Use the calculator tool for every computation.
Check the tool's result before answering.
Answer with the final number only, inside <answer></answer> tags."""

TRACEBACK = """Traceback (most recent call last):
  File "agent.py", line 42, in execute_rollout
    value = parse_answer(text)
  File "agent.py", line 17, in parse_answer
    raise ValueError(f"no <answer> tag in {text[:20]!r}")
ValueError: no <answer> tag in 'The result is 5'"""


@dataclass
class Populated:
    """Ids the tests look for."""

    succeeded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # in the order they finished
    llm_rollout: str = ""  # a succeeded rollout with two LLM calls, a tool call and a reward
    failed_rollout: str = ""  # a failed rollout with an exception event
    versions: list[int] = field(default_factory=list)


def llm_call(question: str, answer: str, tool: bool, version: int, latency_ms: float) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": PROMPT_V1 if version == 1 else PROMPT_V2},
        {"role": "user", "content": question},
    ]
    if tool:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "17 * 23"}'},
                }
            ],
        }
        finish = "tool_calls"
    else:
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "391"})
        message = {"role": "assistant", "content": answer}
        finish = "stop"
    prompt_ids = list(range(100, 100 + 40 + 8 * len(messages)))
    completion_ids = list(range(500, 512 if tool else 506))
    return {
        "endpoint": "chat.completions",
        "request": {"model": "smollm2", "messages": messages, "temperature": 0.7, "max_tokens": 128},
        "response": {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message}],
        },
        "stream": False,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "token_ids": completion_ids,
                "logprobs": [round(-0.05 - 0.1 * i, 3) for i in range(len(completion_ids))],
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids)},
        "latency_ms": latency_ms,
        "upstream_status": 200,
        "model": "smollm2",
        "model_version": str(version),
        "resources_version": version,
        "error": None,
    }


def _events(claim_start: float, version: int, reward: float | None, rng: random.Random) -> list[EventCreate]:
    ok = reward is not None
    t = claim_start
    question = "What is 17 * 23?"
    first = rng.uniform(180, 420)
    second = rng.uniform(120, 300)
    events = [
        EventCreate(
            sequence=0, type="message", timestamp=t + 0.01, data={"role": "user", "content": question}
        ),
        EventCreate(
            sequence=1,
            type="llm_call",
            timestamp=t + 0.02 + first / 1000,
            data=llm_call(question, "", True, version, first),
        ),
        EventCreate(
            sequence=2,
            type="tool_call",
            timestamp=t + 0.06 + first / 1000,
            data={
                "name": "calculator",
                "arguments": {"expression": "17 * 23"},
                "result": 391,
                "error": None,
                "duration_ms": 2.4,
            },
        ),
        EventCreate(
            sequence=3,
            type="llm_call",
            timestamp=t + 0.1 + (first + second) / 1000,
            data=llm_call(
                question, "<answer>391</answer>" if ok else "The result is 5", False, version, second
            ),
        ),
    ]
    end = t + 0.12 + (first + second) / 1000
    if ok:
        events.append(
            EventCreate(sequence=4, type="reward", timestamp=end, data={"value": reward, "name": "correct"})
        )
    else:
        events.append(
            EventCreate(
                sequence=4,
                type="exception",
                timestamp=end,
                data={
                    "type": "ValueError",
                    "message": "no <answer> tag in 'The result is 5'",
                    "traceback": TRACEBACK,
                },
            )
        )
    return events


def _run_batch(
    client: Client, version: int, n_train: int, n_val: int, p_ok: float, rng: random.Random, out: Populated
) -> None:
    items = [
        RolloutCreate(
            task=Task(data={"question": f"{a} * {a + 6}", "answer": a * (a + 6)}),
            mode=Mode.TRAIN,
            resources_version=version,
            max_attempts=1,
        )
        for a in range(10, 10 + n_train)
    ]
    items += [
        RolloutCreate(
            task=Task(data={"question": f"{a} + {a}", "answer": 2 * a}),
            mode=Mode.VAL,
            resources_version=version,
            max_attempts=1,
        )
        for a in range(n_val)
    ]
    client.enqueue(items)
    claims = []
    for i in range(len(items)):
        claim = client.dequeue(f"runner-{'ab'[i % 2]}")
        assert claim is not None
        claims.append(claim)
    for i, claim in enumerate(claims):
        if claim.rollout.mode == Mode.VAL:  # validation: scored right (1) or wrong (0), never fails
            ok, reward = True, float(rng.random() < p_ok)
        else:
            ok = rng.random() < p_ok or i == 0
            reward = round(rng.uniform(0.45, 0.6) + p_ok * 0.4, 3) if ok else None
        worker = claim.attempt.worker_id
        client.add_events(claim.attempt.id, _events(claim.attempt.started_at, version, reward, rng), worker)
        out.finished.append(claim.rollout.id)
        if ok:
            client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, reward=reward, worker_id=worker)
            out.succeeded.append(claim.rollout.id)
            if not out.llm_rollout:
                out.llm_rollout = claim.rollout.id
        else:
            # max_attempts=1: this failed attempt fails the rollout
            client.finish(claim.attempt.id, AttemptStatus.FAILED, error=TRACEBACK, worker_id=worker)
            out.failed.append(claim.rollout.id)
            out.failed_rollout = out.failed_rollout or claim.rollout.id


def populate(url: str, token: str, store: SqlStore) -> Populated:
    rng = random.Random(7)
    out = Populated()
    with Client(url, token=token) as client:
        llm = LLM(
            base_url="http://127.0.0.1:8800/v1", model="smollm2", sampling_parameters={"temperature": 0.7}
        )
        out.versions.append(
            client.publish_resources({"prompt": PromptTemplate(template=PROMPT_V1), "llm": llm}).version
        )
        _run_batch(client, out.versions[-1], 8, 4, 0.55, rng, out)
        weights = ModelWeights(
            path="/runs/grpo/step-1/adapter", base_model="SmolLM2-135M-Instruct", format="lora"
        )
        meta2 = {"step": 1, "metrics": {"loss": 0.84, "kl": 0.012, "val_score": 0.5}, "algorithm": "grpo"}
        out.versions.append(
            client.publish_resources(
                {"prompt": PromptTemplate(template=PROMPT_V2), "llm": llm, "weights": weights}, meta2
            ).version
        )
        _run_batch(client, out.versions[-1], 8, 4, 0.75, rng, out)
        weights3 = ModelWeights(
            path="/runs/grpo/step-2/adapter", base_model="SmolLM2-135M-Instruct", format="lora"
        )
        meta3 = {"step": 2, "metrics": {"loss": 0.61, "kl": 0.018, "val_score": 0.75}, "algorithm": "grpo"}
        out.versions.append(
            client.publish_resources(
                {"prompt": PromptTemplate(template=PROMPT_V2), "llm": llm, "weights": weights3}, meta3
            ).version
        )
        _run_batch(client, out.versions[-1], 8, 4, 0.9, rng, out)
        # still going: one running rollout with an LLM call so far, three waiting in the queue
        running = client.enqueue([RolloutCreate(task=Task(data={"question": "12 * 18"}), max_attempts=2)])[0]
        claim = client.dequeue("runner-a")
        assert claim is not None and claim.rollout.id == running.id
        client.add_events(claim.attempt.id, _events(claim.attempt.started_at, 3, 1.0, rng)[:2], "runner-a")
        out.running.append(running.id)
        queued = client.enqueue(
            [RolloutCreate(task=Task(data={"question": f"{a} - 7"}), mode=Mode.TEST) for a in range(3)]
        )
        out.queued.extend(r.id for r in queued)
    _bend_clock(store, out)
    return out


def _bend_clock(store: SqlStore, out: Populated) -> None:
    """Move each finished rollout (its rows, attempts and events together) back in time so that
    finish times spread over the last 30 minutes, and add a runner last seen hours ago.
    SQLite only (test data)."""
    now = time.time()
    finished = out.finished
    with store.db.transaction() as tx:
        for i, rid in enumerate(finished):
            # the finish call came milliseconds after the claim; the events say the run took longer
            last = "(SELECT MAX(timestamp) + 0.05 FROM events WHERE rollout_id = ?)"
            tx.run(f"UPDATE rollouts SET ended_at = MAX(ended_at, {last}) WHERE id = ?", (rid, rid))
            tx.run(f"UPDATE attempts SET ended_at = MAX(ended_at, {last}) WHERE rollout_id = ?", (rid, rid))
            ended = tx.one("SELECT ended_at FROM rollouts WHERE id = ?", (rid,))[0]
            shift = now - 30 * 60 + (i + 1) * (30 * 60 - 90) / len(finished) - ended
            tx.run(
                "UPDATE rollouts SET created_at = created_at + ?, updated_at = updated_at + ?, "
                "started_at = started_at + ?, ended_at = ended_at + ? WHERE id = ?",
                (shift,) * 4 + (rid,),
            )
            tx.run(
                "UPDATE attempts SET started_at = started_at + ?, heartbeat_at = heartbeat_at + ?, "
                "lease_expires_at = lease_expires_at + ?, ended_at = ended_at + ? WHERE rollout_id = ?",
                (shift,) * 4 + (rid,),
            )
            tx.run("UPDATE events SET timestamp = timestamp + ? WHERE rollout_id = ?", (shift, rid))
        tx.run(
            "INSERT INTO workers (id, last_seen, claims) VALUES (?, ?, ?)", ("runner-old", now - 3 * 3600, 12)
        )
        tx.run(  # seen a moment ago, then revoked by an admin
            "INSERT INTO workers (id, last_seen, claims, revoked_at) VALUES (?, ?, ?, ?)",
            ("runner-cut", now - 5, 3, now - 2),
        )


HUMAN_SCALE = RewardScale(low=1, high=5, step=1)


def awaiting_review(
    url: str,
    token: str,
    answers: list[str],
    *,
    name: str = "human",
    scale: RewardScale = HUMAN_SCALE,
    extra: list[AwaitedReward] | None = None,
    runner_token: str = "runnertok",
) -> list[str]:
    """Succeeded rollouts (one per answer, in queue order) that await a reviewer's ``name``
    score on ``scale``: enqueued with ``await_rewards`` (``token``), run by a runner
    (``runner_token``: what reads a run's model calls reads only those the system wrote) that
    records one model call answering the question, finished with no reward of the agent's own."""
    awaited = [AwaitedReward(name=name, source=RewardSource.REVIEWER, scale=scale), *(extra or [])]
    ids = []
    with Client(url, token=token) as client, Client(url, token=runner_token) as runner:
        for i, answer in enumerate(answers):
            question = f"What is {17 + i} * 23?"
            [ro] = client.enqueue(
                [RolloutCreate(task=Task(data={"question": question}), await_rewards=awaited)]
            )
            claim = runner.dequeue("review-runner")
            assert claim is not None and claim.rollout.id == ro.id
            call = llm_call(question, answer, tool=False, version=1, latency_ms=120.0)
            events = [EventCreate(sequence=0, type="llm_call", data=call)]
            runner.add_events(claim.attempt.id, events, worker_id="review-runner")
            runner.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, worker_id="review-runner")
            ids.append(ro.id)
    return ids
