"""``render_rollout``: what ``agentbolt rollouts show`` prints."""

from __future__ import annotations

from rich.console import Console

from agentbolt.cli.render import render_rollout
from agentbolt.schemas import Attempt, AttemptStatus, Event, Mode, Rollout, RolloutStatus, Task

T0 = 1_700_000_000.0


def _event(i: int, attempt: str, type: str, data: dict) -> Event:
    return Event(
        id=i, rollout_id="ro-1", attempt_id=attempt, sequence=None, type=type, timestamp=T0 + i, data=data
    )


def _call(i: int, attempt: str, messages: list, answer: dict, **extra) -> Event:
    data = {
        "endpoint": "chat.completions",
        "request": {"model": "m", "messages": messages},
        "stream": False,
        "prompt_token_ids": list(range(17)),
        "choices": [
            {
                "index": 0,
                "message": answer,
                "finish_reason": "stop",
                "token_ids": [1, 2, 3],
                "logprobs": [-0.1] * 3,
            }
        ],
        "usage": {"prompt_tokens": 17, "completion_tokens": 3},
        "latency_ms": 123.4,
        "upstream_status": 200,
        "model": "m",
        "model_version": "7",
        "resources_version": 2,
        "error": None,
    } | extra
    return _event(i, attempt, "llm_call", data)


def _render(**overrides) -> str:
    rollout = Rollout(
        id="ro-1",
        task=Task(id="t-1", data={"question": "What is 12+30?"}),
        mode=Mode.TRAIN,
        status=RolloutStatus.SUCCEEDED,
        resources_version=2,
        timeout_seconds=None,
        max_attempts=3,
        attempts=2,
        reward=1.0,
        created_at=T0,
        updated_at=T0,
    )
    attempts = [
        Attempt(
            id="at-1",
            rollout_id="ro-1",
            number=1,
            worker_id="w1",
            status=AttemptStatus.FAILED,
            started_at=T0,
            heartbeat_at=T0,
            lease_expires_at=T0,
            ended_at=T0 + 5,
            error="ValueError: bad",
        ),
        Attempt(
            id="at-2",
            rollout_id="ro-1",
            number=2,
            worker_id="w2",
            status=AttemptStatus.SUCCEEDED,
            started_at=T0 + 6,
            heartbeat_at=T0,
            lease_expires_at=T0,
            ended_at=T0 + 9,
            reward=1.0,
        ),
    ]
    system = {"role": "system", "content": "Use the calculator."}
    user = {"role": "user", "content": "What is 12+30? " + "padding " * 100}
    tool_answer = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "12+30"}'},
            }
        ],
    }
    tb = 'Traceback (most recent call last):\n  File "agent.py", line 3, in run\nValueError: bad'
    events = [
        _event(1, "at-1", "exception", {"type": "ValueError", "message": "bad", "traceback": tb}),
        _call(7, "at-2", [system, user], tool_answer),
        _event(
            8,
            "at-2",
            "tool_call",
            {
                "name": "calculator",
                "arguments": {"expression": "12+30"},
                "result": "42",
                "error": None,
                "duration_ms": 0.5,
            },
        ),
        _call(
            9,
            "at-2",
            [system, user, tool_answer, {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            {"role": "assistant", "content": "The answer is 42."},
        ),
        _event(10, "at-2", "reward", {"value": 1.0, "final": True}),
        _event(
            11,
            "at-2",
            "span",
            {
                "name": "retrieve",
                "start_time": T0,
                "end_time": T0 + 0.25,
                "attributes": {"k": 1},
                "status": {"code": "ok"},
            },
        ),
        _call(
            12,
            "at-2",
            [user],
            None,
            choices=[],
            error={"error": {"message": "upstream down", "type": "x"}},
            upstream_status=502,
            prompt_token_ids=None,
            usage=None,
        ),
    ]
    console = Console(record=True, width=200, color_system=None)
    console.print(render_rollout(rollout, attempts, events))
    return console.export_text()


def test_render_shows_attempts_calls_tokens_latency_rewards_and_tracebacks():
    out = _render()
    assert "rollout ro-1" in out and "succeeded" in out and "reward 1" in out
    assert out.index("attempt 1") < out.index("exception ValueError: bad") < out.index("attempt 2")
    assert 'File "agent.py", line 3' in out  # the traceback
    assert out.count("llm_call #") == 3
    assert "prompt 17 tok  completion 3 tok  123 ms" in out and "model m v7" in out
    assert "system: Use the calculator." in out and "user: What is 12+30?" in out
    assert "…" in out and "padding " * 100 not in out  # long messages are cut
    assert 'calculator({"expression": "12+30"})' in out
    assert "… 3 earlier message(s)" in out and "tool: 42" in out  # only what is new in the second call
    assert "→ assistant: The answer is 42." in out
    assert "tool_call calculator" in out and "→ 42" in out
    assert "reward 1  (final)" in out
    assert "span retrieve  250.0 ms" in out
    assert "prompt ? tok  completion ? tok" in out and "HTTP 502" in out and "upstream down" in out
