"""The gateway hands the agent the id of each call's record (its ``llm_call`` event): header
``X-Agentbolt-Call-Id`` and body field ``agentbolt.call_id``; on streams the last chunk (or the
Responses API's final event) carries it. A real server on 127.0.0.1, the real openai client and
the upstream double (tests/server/upstream_double.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

import agentbolt
from agentbolt.schemas import Event

MESSAGES = [{"role": "user", "content": "What is 6 times 7?"}]


def _openai(claim) -> openai.OpenAI:
    llm = claim.resources.resources["llm"]
    return openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)


def _extra_id(obj) -> int:
    extra = obj.model_extra or {}
    assert set(extra.get("agentbolt") or {}) == {"call_id"}, extra
    return extra["agentbolt"]["call_id"]


def _ids(rig, claim) -> list[int]:
    return [e.id for e in rig.llm_calls(claim.rollout.id)]


def test_chat_answer_names_its_record_in_header_and_body(rig):
    claim = rig.claim()
    client = _openai(claim)
    raw = client.chat.completions.with_raw_response.create(model="double", messages=MESSAGES)
    first = raw.parse()
    second = client.chat.completions.create(model="double", messages=MESSAGES)
    events = rig.llm_calls(claim.rollout.id)
    assert [e.id for e in events] == [_extra_id(first), _extra_id(second)]
    assert events[0].id != events[1].id
    assert raw.headers["x-agentbolt-call-id"] == str(events[0].id)
    assert agentbolt.call_id_of(second) == events[1].id
    # the record keeps the answer as the upstream gave it, without the id added on the way out
    assert "agentbolt" not in events[0].data["response"]


def test_chat_stream_carries_the_id_on_its_last_chunk(rig):
    claim = rig.claim()
    client = _openai(claim)
    chunks = list(client.chat.completions.create(model="double", messages=MESSAGES, stream=True))
    [event] = rig.llm_calls(claim.rollout.id)
    assert _extra_id(chunks[-1]) == event.id
    assert [c for c in chunks[:-1] if "agentbolt" in (c.model_extra or {})] == []
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == "stop"  # no extra chunk
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert text == event.data["choices"][0]["message"]["content"]


def test_chat_stream_with_usage_keeps_usage_last_and_the_id_on_it(rig):
    claim = rig.claim()
    chunks = list(
        _openai(claim).chat.completions.create(
            model="double", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    [event] = rig.llm_calls(claim.rollout.id)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert _extra_id(chunks[-1]) == event.id


def test_the_stream_helper_of_the_sdk_reads_the_id(rig):
    claim = rig.claim()
    with _openai(claim).chat.completions.stream(model="double", messages=MESSAGES) as stream:
        last = None
        for item in stream:
            if item.type == "chunk":
                last = item.chunk
        final = stream.get_final_completion()
    [event] = rig.llm_calls(claim.rollout.id)
    assert last is not None and agentbolt.call_id_of(last) == event.id
    assert final.choices[0].message.content == event.data["choices"][0]["message"]["content"]


def test_completions_endpoint_plain_and_streamed(rig):
    claim = rig.claim()
    client = _openai(claim)
    plain = client.completions.create(model="double", prompt="Say hi")
    chunks = list(client.completions.create(model="double", prompt="Say hi", stream=True))
    events = rig.llm_calls(claim.rollout.id)
    assert [_extra_id(plain), _extra_id(chunks[-1])] == [e.id for e in events]


def test_responses_translated_plain_and_streamed(rig, upstream):
    claim = rig.claim()
    client = _openai(claim)
    raw = client.responses.with_raw_response.create(model="double", input="Hi")
    plain = raw.parse()
    with client.responses.stream(model="double", input="Hi again") as stream:
        streamed = stream.get_final_response()
    events = rig.llm_calls(claim.rollout.id)
    assert all(e.data["endpoint"] == "responses" for e in events)
    assert [agentbolt.call_id_of(plain), agentbolt.call_id_of(streamed)] == [e.id for e in events]
    assert raw.headers["x-agentbolt-call-id"] == str(events[0].id)
    assert [c.path for c in upstream.calls if c.path.endswith("chat/completions")] != []


@pytest.fixture
def hosted(upstream):
    upstream.serves_responses = True
    yield upstream
    upstream.serves_responses = False


def test_responses_passed_through_plain_and_streamed(rig, hosted):
    claim = rig.claim()
    client = _openai(claim)
    raw = client.responses.with_raw_response.create(model="double", input="Hi")
    plain = raw.parse()
    with client.responses.stream(model="double", input="Hi again") as stream:
        streamed = stream.get_final_response()
    assert [c.path for c in hosted.calls] == ["/v1/responses", "/v1/responses"]
    events = rig.llm_calls(claim.rollout.id)
    assert [agentbolt.call_id_of(plain), agentbolt.call_id_of(streamed)] == [e.id for e in events]
    assert raw.headers["x-agentbolt-call-id"] == str(events[0].id)
    assert plain.output_text == streamed.output_text == "Hosted answer."


def test_a_retried_call_gets_the_id_of_the_record_it_joined(rig):
    claim = rig.claim()
    llm = claim.resources.resources["llm"]
    url, auth = f"{llm.base_url}/chat/completions", {"authorization": f"Bearer {llm.api_key}"}
    body = {"model": "double", "messages": MESSAGES}
    tries = [
        httpx.post(url, json=body, headers={**auth, "idempotency-key": "turn-1"}, timeout=10)
        for _ in range(2)
    ]
    other = httpx.post(url, json=body, headers=auth, timeout=10)
    [joined, separate] = rig.llm_calls(claim.rollout.id)
    assert joined.data["retries"] == 1
    assert [t.json()["agentbolt"]["call_id"] for t in tries] == [joined.id, joined.id]
    assert [t.headers["x-agentbolt-call-id"] for t in tries] == [str(joined.id)] * 2
    assert other.json()["agentbolt"]["call_id"] == separate.id != joined.id


def test_an_upstream_error_is_recorded_and_named_too(rig, upstream):
    claim = rig.claim()
    upstream.fail_next.append(400)
    with pytest.raises(openai.BadRequestError) as caught:
        _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["error"] is not None
    assert caught.value.response.headers["x-agentbolt-call-id"] == str(event.id)
    assert caught.value.response.json()["agentbolt"] == {"call_id": event.id}


def test_a_call_whose_record_failed_is_answered_without_an_id(rig, monkeypatch):
    claim = rig.claim()
    store = rig.server.app.state.store

    def broken(*args, **kwargs) -> None:
        raise RuntimeError("the store is down")

    monkeypatch.setattr(store, "record_call", broken)
    client = _openai(claim)
    raw = client.chat.completions.with_raw_response.create(model="double", messages=MESSAGES)
    answer = raw.parse()
    chunks = list(client.chat.completions.create(model="double", messages=MESSAGES, stream=True))
    assert answer.choices[0].message.content  # the agent got its answer
    assert "x-agentbolt-call-id" not in raw.headers
    assert "agentbolt" not in (answer.model_extra or {})
    assert all("agentbolt" not in (c.model_extra or {}) for c in chunks)
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert agentbolt.call_id_of(answer) is None
    monkeypatch.undo()
    assert rig.llm_calls(claim.rollout.id) == []


def test_ids_name_events_of_the_right_attempt(rig):
    claim = rig.claim()
    answer = _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    events: list[Event] = rig.client.all_events(claim.rollout.id)
    [event] = [e for e in events if e.id == agentbolt.call_id_of(answer)]
    assert event.type == "llm_call" and event.attempt_id == claim.attempt.id


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    from agentbolt.engine import EngineServer, ModelEngine, tiny_model_dir

    path = tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    engine = ModelEngine.from_pretrained(path, device="cpu", dtype="float32", name="tiny", max_batch=8)
    with EngineServer(engine) as server:
        yield server
    engine.close()


def test_the_embedded_engine_as_upstream_gives_ids_too(rig, engine_server):
    """The upstream training uses: plain, streamed (with and without usage) and Responses calls."""
    claim = rig.claim(model="tiny", base_url=engine_server.base_url)
    client = _openai(claim)
    greedy = {"max_tokens": 6, "temperature": 0.0}
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **greedy)
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **greedy))
    with_usage = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=6, temperature=0.0)
    events = rig.llm_calls(claim.rollout.id)
    assert all(e.data["token_ids"] for e in events)
    got = list(map(agentbolt.call_id_of, [plain, streamed[-1], with_usage[-1], response]))
    assert got == [e.id for e in events]
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 6
    text = "".join(c.delta.content or "" for chunk in streamed for c in chunk.choices)
    assert text == plain.choices[0].message.content == events[1].data["choices"][0]["message"]["content"]
