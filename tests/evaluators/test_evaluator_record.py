"""A rollout's record from its events, and the stated transcript cut."""

from __future__ import annotations

from agentbolt.evaluators import record_of, transcript
from agentbolt.schemas import Event
from tests.evaluators.conftest import conversation_record, llm_event, make_rollout


def _event(rid: str, event_id: int, type: str, data: dict, attempt: str = "at-1") -> Event:
    return Event(
        id=event_id,
        rollout_id=rid,
        attempt_id=attempt,
        sequence=event_id,
        type=type,
        timestamp=0.0,
        data=data,
    )


def test_record_reads_the_latest_attempt_its_calls_tools_and_final_answer() -> None:
    rollout = make_rollout("ro-1")
    first_try = llm_event("ro-1", [{"role": "user", "content": "old"}], "wrong", event_id=1, attempt="at-1")
    asked = [{"role": "user", "content": "What is 2+2?"}]
    call_1 = llm_event("ro-1", asked, "let me compute", event_id=2, attempt="at-2")
    tool = _event(
        "ro-1", 3, "tool_call", {"name": "calculator", "arguments": {"e": "2+2"}, "result": 4}, "at-2"
    )
    turn_2 = [*asked, {"role": "assistant", "content": "let me compute"}, {"role": "tool", "content": "4"}]
    call_2 = llm_event("ro-1", turn_2, "The answer is 4.", event_id=4, attempt="at-2")
    record = record_of(rollout, [first_try, call_1, tool, call_2])
    assert record.task == {"question": "What is 2+2?"}
    assert [c.answer for c in record.calls] == ["let me compute", "The answer is 4."]
    assert record.calls[0].latency_s == 0.25 and record.calls[0].usage["total_tokens"] == 12
    assert record.tool_calls == [{"name": "calculator", "arguments": {"e": "2+2"}, "result": 4}]
    assert record.messages[-1] == {"role": "assistant", "content": "The answer is 4."}
    assert len(record.messages) == 4
    assert record.output == "The answer is 4."


def test_record_of_an_agent_without_model_calls_uses_its_returned_answer() -> None:
    rollout = make_rollout("ro-2")
    events = [
        _event("ro-2", 1, "message", {"role": "user", "content": "hello"}),
        _event("ro-2", 2, "trajectory", {"final_response": {"answer": 4}}),
    ]
    record = record_of(rollout, events)
    assert record.messages == [{"role": "user", "content": "hello"}]
    assert record.calls == [] and record.output == '{"answer": 4}'
    assert record_of(rollout, []).output is None


def test_a_short_transcript_is_whole_and_not_cut() -> None:
    record = conversation_record(2)
    text, cut = transcript(record, 10_000)
    assert cut is None
    assert text.startswith("TASK:") and "FIRST: what is 2+2?" in text and "turn001" in text
    assert text.rstrip().endswith("FINAL ANSWER:\n[assistant] 4")
    assert "You are a calculator." in text


def test_the_cut_drops_whole_middle_turns_oldest_first_and_says_so() -> None:
    record = conversation_record(10, turn_chars=100)
    full, _ = transcript(record, 100_000)
    text, cut = transcript(record, 700)
    assert cut is not None and len(text) <= 700
    # task, system prompt, first user message and final answer are whole
    assert "FIRST: what is 2+2?" in text and '"question": "What is 2+2?"' in text
    assert text.endswith("FINAL ANSWER:\n[assistant] 4")
    kept = [i for i in range(10) if f"turn{i:03d}" in text]
    assert kept and kept == list(range(10 - len(kept), 10)), "the oldest turns go first, the rest stays whole"
    dropped = 10 - len(kept)
    dropped_turns = [
        part for part in full.split("\n\n") if any(f"turn{i:03d}" in part for i in range(dropped))
    ]
    assert len(dropped_turns) == dropped
    marker = f"[... {dropped} turns ({sum(len(t) for t in dropped_turns)} characters) cut ...]"
    assert marker in text
    # the marker sits where the turns were: after the first user message, before the kept turns
    assert text.index("FIRST:") < text.index(marker) < text.index(f"turn{kept[0]:03d}")
    assert cut == {
        "chars_before": len(full),
        "chars_after": len(text),
        "turns_cut": dropped,
        "chars_cut": sum(len(t) for t in dropped_turns),
    }


def test_when_turns_are_not_enough_the_longest_message_is_cut_in_its_middle() -> None:
    from agentbolt.evaluators.record import RolloutRecord

    base = conversation_record(0)
    long_answer = "A" * 3000 + "MIDDLE" + "Z" * 3000
    record = RolloutRecord(
        rollout=base.rollout,
        task=base.task,
        messages=[*base.messages[:-1], {"role": "assistant", "content": long_answer}],
        calls=base.calls,
        tool_calls=[],
        output=long_answer,
    )
    text, cut = transcript(record, 1000)
    assert cut is not None and len(text) <= 1000
    assert cut["turns_cut"] == 0 and cut["chars_cut"] > 5000
    assert "MIDDLE" not in text and "AAAA" in text and text.endswith("ZZZZ")
    assert "characters cut ...]" in text
    assert "FIRST: what is 2+2?" in text  # the short parts are untouched
