"""What a GRPO step trains on and says about it: a rollout whose model call was recorded without
token ids gives no row, and the step prints how many calls it skipped; only the calls of the
policy's own role (its LLM resource) train it."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

from rich.console import Console

from agentbolt.algorithms.base import BatchResult
from agentbolt.algorithms.collapse import CollapseWatch
from agentbolt.algorithms.grpo_config import GRPOConfig
from agentbolt.algorithms.grpo_rows import rows_of
from agentbolt.algorithms.grpo_table import StepRecord, columns
from agentbolt.algorithms.metrics import MetricsLog
from agentbolt.schemas import Event, EventSource, Task
from tests.conftest import finished_rollout

_ids = itertools.count(1)


def llm_call(
    prompt: list[int] | None, completion: list[int] | None, rollout_id: str, resource: str | None = None
) -> Event:
    """A gateway record; ``None`` ids: one recorded text-only (the upstream returned none);
    ``resource``: the LLM resource (role) that served it (None: a record from before roles)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}
    choice.update(token_ids=completion, logprobs=[-0.5] * len(completion) if completion else None)
    data = {
        "endpoint": "chat.completions",
        "prompt_token_ids": prompt,
        "choices": [choice],
        "token_ids": prompt is not None,
        "error": None,
    }
    if resource is not None:
        data["resource"] = resource
    return Event(
        id=next(_ids),
        rollout_id=rollout_id,
        attempt_id=f"at-{rollout_id}",
        sequence=None,
        type="llm_call",
        timestamp=0.0,
        data=data,
        source=EventSource.GATEWAY,
    )


def test_a_step_prints_how_many_calls_it_skipped_for_lack_of_ids(tmp_path: Path) -> None:
    events = {
        "ro-1": [llm_call([1, 2], [5, 6], rollout_id="ro-1")],
        "ro-2": [llm_call([1, 2], [7], rollout_id="ro-2")],
        "ro-3": [llm_call(None, None, rollout_id="ro-3")],
    }
    rollouts = [
        finished_rollout(rid, task=Task(id="t"), reward=reward, group_id="g")
        for rid, reward in (("ro-1", 1.0), ("ro-2", 0.0), ("ro-3", 1.0))
    ]
    step = rows_of(GRPOConfig(), {"g": rollouts}, BatchResult(rollouts, 0), events)
    assert len(step.rows) == 2 and step.data["skipped_no_ids"] == 1

    out = io.StringIO()
    console = Console(file=out, width=200)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    record = StepRecord(console, log, [], columns(agent_only=True), CollapseWatch(0.0, 3))
    record.record({"step": 4, **step.data})
    record.record({"step": 5, **step.data, "skipped_no_ids": 0})
    log.close()
    printed = out.getvalue()
    assert "step 4: 1 llm call skipped for lack of token ids" in printed
    assert "step 5:" not in printed
    assert '"skipped_no_ids": 1' in (tmp_path / "metrics.jsonl").read_text()


def test_only_the_policys_own_role_trains_it(tmp_path: Path) -> None:
    """A system of agents: each rollout called its planner (another model or adapter) and the
    policy's resource ``llm``; only ``llm``'s calls become rows, the others are counted and
    said, in GRPO's step line and in SFT's rows alike."""
    from agentbolt.algorithms.roles import role_calls

    events = {
        rid: [
            llm_call([1, 2], [9, 9, 9], rollout_id=rid, resource="planner"),
            llm_call([3, 4], [5 + n], rollout_id=rid, resource="llm"),
        ]
        for n, rid in enumerate(("ro-1", "ro-2"))
    }
    rollouts = [
        finished_rollout(rid, task=Task(id="t"), reward=reward, group_id="g")
        for rid, reward in (("ro-1", 1.0), ("ro-2", 0.0))
    ]
    step = rows_of(GRPOConfig(), {"g": rollouts}, BatchResult(rollouts, 0), events)
    assert len(step.rows) == 2 and step.data["other_roles_calls"] == 2
    assert all(9 not in row.input_ids for row in step.rows)  # the planner's tokens train nothing here
    planner = rows_of(GRPOConfig(llm_resource="planner"), {"g": rollouts}, BatchResult(rollouts, 0), events)
    assert len(planner.rows) == 2 and all(9 in row.input_ids for row in planner.rows)
    old = [llm_call([1], [2], rollout_id="ro-9")]  # recorded before the gateway named resources
    assert role_calls(old, "llm") == (old, 0)

    out = io.StringIO()
    log = MetricsLog(tmp_path / "metrics.jsonl")
    record = StepRecord(
        Console(file=out, width=200), log, [], columns(agent_only=True), CollapseWatch(0.0, 3)
    )
    record.record({"step": 2, **step.data})
    log.close()
    assert "step 2: 2 model call(s) through other LLM resources than 'llm' left out" in out.getvalue()
