"""The agent API: resource injection by name and type, emit_* from threads and tasks."""

from __future__ import annotations

import math
import threading

import pytest

from agentbolt.errors import ConfigError
from agentbolt.runner.agent import (
    LitAgent,
    RolloutContext,
    as_agent,
    current_rollout,
    emit_message,
    emit_reward,
    rollout,
    rollout_thread,
)
from agentbolt.runner.outcome import reward_of
from agentbolt.schemas import (
    LLM,
    Attempt,
    AttemptStatus,
    PromptTemplate,
    Resources,
    Rollout,
    RolloutStatus,
    Task,
)


def _ctx(resources: dict) -> RolloutContext:
    task = Task(id="t1", data={"q": "2+2"})
    ro = Rollout(
        id="r1",
        task=task,
        mode="train",
        status=RolloutStatus.RUNNING,
        resources_version=1,
        timeout_seconds=None,
        max_attempts=1,
        attempts=1,
        created_at=0,
        updated_at=0,
    )
    at = Attempt(
        id="a1",
        rollout_id="r1",
        number=1,
        worker_id="w",
        status=AttemptStatus.RUNNING,
        started_at=0,
        heartbeat_at=0,
        lease_expires_at=1,
    )
    return RolloutContext(ro, at, Resources(version=1, resources=resources, created_at=0))


def _run(agent, ctx):
    token = ctx.activate()
    try:
        return as_agent(agent).execute_rollout(ctx.task)
    finally:
        token.var.reset(token)


def test_rollout_injects_by_name_and_by_type():
    llm = LLM(base_url="http://x/v1", model="m")
    ctx = _ctx({"system_prompt": PromptTemplate(template="Be brief."), "policy": llm})

    @rollout
    def agent(task: Task, system_prompt: str, model: LLM, prompt_obj: PromptTemplate):
        return (task.id, system_prompt, model.model, prompt_obj.template)

    assert _run(agent, ctx) == ("t1", "Be brief.", "m", "Be brief.")


def test_missing_resource_is_a_clear_error():
    @rollout
    def agent(task, missing_thing):
        return 1

    with pytest.raises(ConfigError, match="missing_thing"):
        _run(agent, _ctx({}))

    @rollout
    def wants_llm(task, llm_param: LLM):
        return 1

    with pytest.raises(ConfigError, match="LLM"):
        _run(wants_llm, _ctx({}))


def test_emit_outside_a_rollout_is_harmless_and_current_rollout_raises():
    emit_reward(1.0)  # no rollout: nothing to record, no crash
    with pytest.raises(RuntimeError, match="not inside a rollout"):
        current_rollout()


def test_events_get_increasing_sequence_numbers():
    ctx = _ctx({})
    token = ctx.activate()
    try:
        for i in range(5):
            emit_reward(i)
    finally:
        token.var.reset(token)
    events = ctx.take_pending()
    assert [e.sequence for e in events] == [0, 1, 2, 3, 4]
    assert ctx.rewards == [0, 1, 2, 3, 4]
    assert ctx.take_pending() == []


def test_as_agent_rejects_non_agents():
    with pytest.raises(ConfigError):
        as_agent(42)


def _emit_from_plain_thread(message: str) -> list[BaseException]:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            emit_message(message)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    return errors


def test_a_plain_thread_reaches_the_only_running_rollout():
    ctx = _ctx({})
    with ctx.running():
        assert _emit_from_plain_thread("hello") == []
    assert [e.data["content"] for e in ctx.take_pending()] == ["hello"]
    assert _emit_from_plain_thread("after the rollout") == []  # none runs: harmless, as outside one
    assert ctx.take_pending() == []


def test_a_plain_thread_among_several_rollouts_raises_and_rollout_thread_carries_its_own():
    first, second = _ctx({}), _ctx({})
    with first.running(), second.running():
        [error] = _emit_from_plain_thread("whose?")
        assert "rollout_thread" in str(error) and "copy_context" in str(error)
        token = second.activate()
        try:
            thread = rollout_thread(emit_message, "mine", role="tool")
        finally:
            token.var.reset(token)
        thread.start()
        thread.join(10)
    assert first.take_pending() == []
    assert [(e.data["role"], e.data["content"]) for e in second.take_pending()] == [("tool", "mine")]


def test_a_class_that_needs_constructor_arguments_is_a_clear_config_error():
    class Needy(LitAgent):
        def __init__(self, model: str, *extra: str, temperature: float = 0.5, **options: str) -> None:
            super().__init__()

    with pytest.raises(ConfigError, match=r"Needy needs constructor arguments \(model\)"):
        as_agent(Needy)


def test_an_int_reward_beyond_any_float_is_infinite_not_an_overflow():
    ctx = _ctx({})
    assert reward_of(10**400, ctx) == math.inf and reward_of(-(10**400), ctx) == -math.inf
    assert reward_of(True, ctx) == 1.0 and reward_of(3, ctx) == 3.0
