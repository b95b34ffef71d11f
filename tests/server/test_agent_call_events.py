"""Program agents reward and label their model calls through the events URL: the reward
shorthand takes ``call`` (the gateway's call id), and ``{"type": "state", "data": {"key",
"llm_call_id"}}`` declares a turn's state. Real HTTP posts to a real server on 127.0.0.1; the
calls go through the gateway to the upstream double."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]


def _post(claim, body) -> httpx.Response:
    url = claim.resources.resources["llm"].base_url.split("/gateway/")[0]
    events_url = f"{url}/agent/{claim.rollout.id}/{claim.attempt.id}/events"
    headers = {"authorization": f"Bearer {claim.agent_key}", "content-type": "application/json"}
    if isinstance(body, str):
        return httpx.post(events_url, content=body.encode(), headers=headers, timeout=10)
    return httpx.post(events_url, json=body, headers=headers, timeout=10)


def _call(claim) -> int:
    llm = claim.resources.resources["llm"]
    answer = httpx.post(
        f"{llm.base_url}/chat/completions",
        json={"model": "double", "messages": MESSAGES},
        headers={"authorization": f"Bearer {llm.api_key}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    return int(answer.headers["x-agentbolt-call-id"])


def test_a_program_agent_rewards_and_labels_its_calls(rig):
    claim = rig.claim()
    first, second = _call(claim), _call(claim)
    body = [
        {"type": "state", "data": {"key": "guess 1: range 1-100", "llm_call_id": first}},
        {"type": "state", "data": {"key": "guess 2: range 51-100", "llm_call_id": second}},
        {"reward": 0.1, "call": first},
        {"reward": -0.2, "name": "too far", "call": second},
        {"reward": 1},
    ]
    r = _post(claim, body)
    assert r.status_code == 200 and r.json() == {"added": 5}, r.text
    events = rig.client.all_events(claim.rollout.id)
    assert [e.id for e in events if e.type == "llm_call"] == [first, second]
    assert [e.data for e in events if e.type == "state"] == [
        {"key": "guess 1: range 1-100", "llm_call_id": first},
        {"key": "guess 2: range 51-100", "llm_call_id": second},
    ]
    assert [e.data for e in events if e.type == "reward"] == [
        {"value": 0.1, "llm_call_id": first},
        {"value": -0.2, "name": "too far", "llm_call_id": second},
        {"value": 1.0},
    ]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ('{"type": "state", "data": {"llm_call_id": 3}}', "data.key: Field required"),
        ('{"type": "state", "data": {"key": "a"}}', "data.llm_call_id: Field required"),
        ('{"type": "state", "data": {"key": 5, "llm_call_id": 3}}', "data.key"),
        ('{"type": "state", "data": {"key": "", "llm_call_id": 3}}', "at least 1 character"),
        ('{"type": "state", "data": {"key": "a", "llm_call_id": "3"}}', "llm_call_id"),
        ('{"type": "state", "data": {"key": "a", "llm_call_id": true}}', "llm_call_id"),
        ('{"type": "state", "data": {"key": "a", "llm_call_id": -1}}', "greater than or equal to 0"),
        ('{"type": "state", "data": {"key": "a", "llm_call_id": 1.5}}', "llm_call_id"),
        ('{"type": "state"}', "data: Field required"),
        ('{"type": "state", "data": {"key": "a", "llm_call_id": 3, "x": 1}}', "Extra inputs"),
        ('{"reward": 1, "call": -4}', "call: Input should be greater than or equal to 0"),
        ('{"reward": 1, "call": "12"}', "call"),
        ('{"reward": 1, "call": 9007199254740992}', "call: Input should be less than or equal to"),
    ],
)
def test_a_malformed_call_event_is_a_422_with_a_message_and_stores_nothing(rig, raw, says):
    claim = rig.claim()
    r = _post(claim, raw)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "validation_error" and says in error["message"], error["message"]
    assert rig.client.all_events(claim.rollout.id) == []


def test_a_state_key_of_512_characters_is_taken_and_513_refused(rig):
    claim = rig.claim()
    call = _call(claim)
    assert _post(claim, {"type": "state", "data": {"key": "k" * 512, "llm_call_id": call}}).status_code == 200
    r = _post(claim, {"type": "state", "data": {"key": "k" * 513, "llm_call_id": call}})
    assert r.status_code == 422 and "at most 512 characters" in r.json()["error"]["message"]


def test_the_openapi_document_states_both_shapes(rig):
    doc = httpx.get(f"{rig.server.url}/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    shapes = {ref["$ref"].rsplit("/", 1)[1] for ref in schemas["AgentEvents"]["items"]["oneOf"]}
    assert shapes == {"AgentTypedEvent", "AgentReward", "AgentStateEvent"}
    assert schemas["AgentReward"]["properties"]["call"]["anyOf"][0] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 2**53 - 1,
    }
    state = schemas["StateData"]
    assert set(state["required"]) == {"key", "llm_call_id"}
    assert state["properties"]["key"]["maxLength"] == 512
    assert schemas["AgentTypedEvent"]["properties"]["type"]["not"] == {"const": "state"}
