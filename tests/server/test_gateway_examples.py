"""An LLM resource's example turns (``LLM.examples``): the gateway puts them into every call after
its leading system messages, the agent's claim never carries them, the record holds the call as
the model got it and says how many were put in. A real server on 127.0.0.1 and the real openai
client; the model server is the test double (tests/server/upstream_double.py)."""

from __future__ import annotations

import httpx
import openai

from agentbolt.adapters import to_chat_rows
from agentbolt.schemas import LLM, ExampleTurn, RolloutCreate, Task

EXAMPLE = [
    ExampleTurn(role="user", content="What is 2 plus 2?"),
    ExampleTurn(role="assistant", content="ANSWER: 4"),
]
SHOWN = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "ANSWER: 4"}]


def _claim_with_examples(rig):
    llm = LLM(base_url=rig.upstream.base_url, model="double", examples=EXAMPLE)
    rig.client.publish_resources({"llm": llm})
    rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    claim = rig.client.dequeue("w1")
    assert claim is not None
    return claim


def _openai(claim) -> openai.OpenAI:
    llm = claim.resources.resources["llm"]
    return openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)


def test_the_gateway_puts_the_turns_after_the_system_message_and_records_them(rig, upstream):
    claim = _claim_with_examples(rig)
    assert claim.resources.resources["llm"].examples == []  # the agent never gets them
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"}]
    reply = _openai(claim).chat.completions.create(model="double", messages=asked)  # type: ignore[arg-type]
    sent = upstream.calls[-1].body["messages"]
    assert sent == [asked[0], *SHOWN, asked[1]]
    with _openai(claim).chat.completions.create(model="double", messages=asked[1:], stream=True) as stream:  # type: ignore[arg-type]
        "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert upstream.calls[-1].body["messages"] == [*SHOWN, asked[1]]  # no system message: first
    events = rig.llm_calls(claim.rollout.id)
    assert [e.data["examples"] for e in events] == [2, 2]
    assert events[0].data["request"]["messages"] == sent  # as the model got it: its ids match
    answer = {"role": "assistant", "content": reply.choices[0].message.content}
    rows = to_chat_rows(events[:1])
    assert rows[0]["messages"] == [*sent, answer]
    assert to_chat_rows(events[:1], examples=False)[0]["messages"] == [*asked, answer]


def test_a_responses_conversation_is_not_shown_the_turns_twice(rig, upstream):
    upstream.serves_responses = True  # a vLLM-like server: the call is translated all the same
    try:
        claim = _claim_with_examples(rig)
        client = _openai(claim)
        first = client.responses.create(model="double", input="What is 3 plus 4?", instructions="Be brief.")
        second = client.responses.create(model="double", input="And 5 plus 6?", previous_response_id=first.id)
    finally:
        upstream.serves_responses = False
    assert second.previous_response_id == first.id
    assert all(call.path == "/v1/chat/completions" for call in upstream.calls[-2:])
    assert upstream.calls[-2].body["messages"] == [
        {"role": "system", "content": "Be brief."},
        *SHOWN,
        {"role": "user", "content": "What is 3 plus 4?"},
    ]
    # the earlier turn comes back once, after the example turns (OpenAI drops old instructions)
    assert upstream.calls[-1].body["messages"] == [
        *SHOWN,
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And 5 plus 6?"},
    ]


def test_turns_that_are_not_user_assistant_or_tool_messages_are_422(rig):
    url = f"{rig.server.url}/api/resources"
    for bad in ([{"role": "system", "content": "x"}], [{"content": "no role"}], [{"role": "user"}] * 65):
        llm = {"type": "llm", "base_url": "http://127.0.0.1:1/v1", "model": "m", "examples": bad}
        answer = httpx.post(url, json={"resources": {"llm": llm}})
        assert answer.status_code == 422, answer.text
        assert "examples" in answer.text
    assert rig.client.latest_resources() is None  # nothing stored
