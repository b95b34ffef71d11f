"""The gateway against a real server and the upstream double, both on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest

from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, Task
from agentbolt.server import Role, ServerConfig, ServerThread
from agentbolt.server.run import free_port

MESSAGES = [{"role": "user", "content": "What is 6 times 7?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _openai(claim) -> openai.OpenAI:
    llm = claim.resources.resources["llm"]
    return openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)


def _direct(upstream, path: str, body: dict) -> dict:
    """What the upstream answers when asked for the extras directly (the ground truth)."""
    return httpx.post(f"{upstream.base_url}/{path}", json=body, timeout=10).json()


def test_claim_points_llm_at_gateway_and_hides_the_key(rig):
    claim = rig.claim(api_key="sk-upstream-secret")
    llm = claim.resources.resources["llm"]
    assert llm.base_url == f"{rig.server.url}/gateway/{claim.rollout.id}/{claim.attempt.id}/v1"
    assert llm.api_key == claim.agent_key and llm.api_key.startswith("ak_")  # the attempt's own key
    assert llm.model == "double"


def test_chat_recorded_exactly(rig, upstream):
    claim = rig.claim()
    answer = _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    truth = _direct(
        upstream,
        "chat/completions",
        {"model": "double", "messages": MESSAGES, "return_token_ids": True, "logprobs": True},
    )
    sent = upstream.calls[-2].body  # what the gateway asked for
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    # the agent gets no extras it did not ask for
    raw = answer.model_dump()
    assert answer.choices[0].logprobs is None and "prompt_token_ids" not in (answer.model_extra or {})
    assert "token_ids" not in json.dumps(raw)
    [event] = rig.llm_calls(claim.rollout.id)
    data = event.data
    assert event.sequence is None and event.attempt_id == claim.attempt.id
    assert data["endpoint"] == "chat.completions" and data["stream"] is False
    assert data["request"] == {"model": "double", "messages": MESSAGES}
    assert data["prompt_token_ids"] == truth["prompt_token_ids"]
    [choice] = data["choices"]
    assert choice["token_ids"] == truth["choices"][0]["token_ids"]
    assert choice["logprobs"] == [t["logprob"] for t in truth["choices"][0]["logprobs"]["content"]]
    assert choice["message"] == {"role": "assistant", "content": answer.choices[0].message.content}
    assert data["usage"] == truth["usage"]
    assert data["upstream_status"] == 200 and data["error"] is None
    assert data["model_version"] == "7" and data["resources_version"] == 1 and data["resource"] == "llm"
    assert data["latency_ms"] > 0
    assert data["response"]["choices"][0]["logprobs"] is None  # the response as the agent got it


def test_stream_records_the_same_event_as_no_stream(rig):
    claim = rig.claim()
    client = _openai(claim)
    plain = client.chat.completions.create(model="double", messages=MESSAGES, n=2)
    chunks = list(client.chat.completions.create(model="double", messages=MESSAGES, n=2, stream=True))
    streamed = {}
    for chunk in chunks:
        assert chunk.usage is None  # the usage chunk the gateway asked for is not passed on
        for c in chunk.choices:
            assert c.logprobs is None and "token_ids" not in (c.model_extra or {})
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in plain.choices}
    first, second = (e.data for e in rig.llm_calls(claim.rollout.id))
    assert (first["stream"], second["stream"]) == (False, True)
    volatile = ("request", "stream", "latency_ms", "time_to_first_token_ms")
    assert {k: v for k, v in first.items() if k not in volatile} == {
        k: v for k, v in second.items() if k not in volatile
    }
    assert second["time_to_first_token_ms"] > 0


def test_stream_keeps_usage_when_the_agent_asks(rig):
    claim = rig.claim()
    chunks = list(
        _openai(claim).chat.completions.create(
            model="double", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_extras_pass_through_when_the_agent_asks(rig, upstream):
    claim = rig.claim()
    answer = _openai(claim).chat.completions.create(
        model="double", messages=MESSAGES, logprobs=True, extra_body={"return_token_ids": True}
    )
    [event] = rig.llm_calls(claim.rollout.id)
    assert answer.model_extra["prompt_token_ids"] == event.data["prompt_token_ids"]
    assert answer.choices[0].model_extra["token_ids"] == event.data["choices"][0]["token_ids"]
    assert [t.logprob for t in answer.choices[0].logprobs.content] == event.data["choices"][0]["logprobs"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip(rig, stream):
    claim = rig.claim()
    client = _openai(claim)
    first = client.chat.completions.create(model="double", messages=MESSAGES, tools=TOOLS, stream=stream)
    if stream:
        calls: dict[int, dict] = {}
        for chunk in first:
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        call = calls[0]
    else:
        tc = first.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["name"] == "calculator" and "expression" in json.loads(call["arguments"])
    followup = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "calculator", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    final = client.chat.completions.create(model="double", messages=followup, tools=TOOLS)
    assert "42" in final.choices[0].message.content
    one, two = (e.data for e in rig.llm_calls(claim.rollout.id))
    [recorded] = one["choices"][0]["message"]["tool_calls"]
    assert recorded == {
        "id": call["id"],
        "type": "function",
        "function": {"name": "calculator", "arguments": call["arguments"]},
    }
    assert one["choices"][0]["finish_reason"] == "tool_calls" and one["request"]["tools"] == TOOLS
    assert len(one["choices"][0]["token_ids"]) == len(one["choices"][0]["logprobs"]) == 2
    assert two["request"]["messages"][-1] == {"role": "tool", "tool_call_id": call["id"], "content": "42"}


def test_n_choices_each_with_ids(rig, upstream):
    claim = rig.claim()
    answer = _openai(claim).chat.completions.create(model="double", messages=MESSAGES, n=3)
    truth = _direct(
        upstream,
        "chat/completions",
        {"model": "double", "messages": MESSAGES, "n": 3, "return_token_ids": True, "logprobs": True},
    )
    [event] = rig.llm_calls(claim.rollout.id)
    assert len(answer.choices) == 3
    assert [c["index"] for c in event.data["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in event.data["choices"]] == [c["token_ids"] for c in truth["choices"]]
    assert all(len(c["token_ids"]) == len(c["logprobs"]) for c in event.data["choices"])


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_completions(rig, upstream, stream):
    claim = rig.claim()
    result = _openai(claim).completions.create(model="double", prompt="Once upon", n=2, stream=stream)
    text = {}
    for part in result if stream else [result]:
        for c in part.choices:
            assert c.logprobs is None
            text[c.index] = text.get(c.index, "") + c.text
    truth = _direct(
        upstream,
        "completions",
        {"model": "double", "prompt": "Once upon", "n": 2, "return_token_ids": True, "logprobs": 1},
    )
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["endpoint"] == "completions"
    assert event.data["prompt_token_ids"] == truth["choices"][0]["prompt_token_ids"]
    for rec, ref in zip(event.data["choices"], truth["choices"], strict=True):
        assert rec["text"] == ref["text"] == text[rec["index"]]
        assert rec["token_ids"] == ref["token_ids"]
        assert rec["logprobs"] == ref["logprobs"]["token_logprobs"]


def test_models_lists_the_upstream(rig):
    claim = rig.claim()
    assert [m.id for m in _openai(claim).models.list()] == ["double"]


def test_unknown_attempt_404_and_finished_attempt_409(rig):
    claim = rig.claim()
    base = f"{rig.server.url}/gateway/{claim.rollout.id}"
    body = {"model": "double", "messages": MESSAGES}
    missing = httpx.post(f"{base}/at-nope/v1/chat/completions", json=body)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_rollout = httpx.post(
        f"{rig.server.url}/gateway/ro-other/{claim.attempt.id}/v1/chat/completions", json=body
    )
    assert wrong_rollout.status_code == 404
    rig.client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 1.0)
    with pytest.raises(openai.ConflictError) as info:
        _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    assert f"attempt {claim.attempt.id!r} is succeeded, not running" in info.value.body["message"]
    assert info.value.body["type"] == "AttemptEnded"
    assert rig.llm_calls(claim.rollout.id) == []


def test_a_cancelled_attempt_takes_no_more_calls(rig, upstream):
    claim = rig.claim()
    _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    rig.client.cancel(claim.rollout.id)
    for call in (
        lambda: _openai(claim).chat.completions.create(model="double", messages=MESSAGES),
        lambda: _openai(claim).completions.create(model="double", prompt="hi"),
    ):
        with pytest.raises(openai.ConflictError) as info:
            call()
        assert info.value.status_code == 409 and info.value.body["type"] == "AttemptEnded"
        assert "is cancelled, not running" in info.value.body["message"]
    assert len(upstream.calls) == 1  # nothing more was forwarded
    assert len(rig.llm_calls(claim.rollout.id)) == 1


def test_a_call_the_openai_client_retried_after_an_error_is_one_llm_call(rig, upstream):
    claim = rig.claim()
    upstream.fail_next = [500]  # not one the gateway retries itself: the agent's client does
    llm = claim.resources.resources["llm"]
    agent = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=1)
    answer = agent.chat.completions.create(model="double", messages=MESSAGES)
    assert len(upstream.calls) == 2
    [event] = rig.llm_calls(claim.rollout.id)
    data = event.data
    assert (data["retries"], data["tries"]) == (1, [0, 1])
    assert data["error"] is None and data["upstream_status"] == 200  # the answer the agent got
    assert data["response"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
    # the same body again, not a retry: a call of its own
    agent.chat.completions.create(model="double", messages=MESSAGES)
    assert [e.data["retries"] for e in rig.llm_calls(claim.rollout.id)] == [1, 0]


def test_a_call_the_openai_client_retried_after_a_timeout_is_one_llm_call(rig, upstream):
    claim = rig.claim()
    upstream.delay_next = [2.5]  # the first try outlasts the client's timeout, then answers anyway
    llm = claim.resources.resources["llm"]
    agent = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=1, timeout=1.0)
    answer = agent.chat.completions.create(model="double", messages=MESSAGES)
    [event] = rig.llm_calls(claim.rollout.id)  # the retry's record is there when it returns
    assert event.data["tries"] == [1]
    deadline = time.monotonic() + 10
    while event.data["tries"] != [0, 1]:  # the timed-out try is recorded when it ends
        assert time.monotonic() < deadline, "the first try was never recorded"
        time.sleep(0.05)
        [event] = rig.llm_calls(claim.rollout.id)
    assert len(upstream.calls) == 2 and event.data["retries"] == 1
    assert event.data["latency_ms"] < 2000  # the retry's record, not the late one's
    assert event.data["response"]["choices"][0]["message"]["content"] == answer.choices[0].message.content


def test_tries_with_one_idempotency_key_are_one_llm_call(rig, upstream):
    claim = rig.claim()
    url = claim.resources.resources["llm"].base_url
    before = len(upstream.calls)
    body = {"model": "double", "messages": [{"role": "user", "content": "try"}]}
    ids = set()
    for _ in range(3):
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"idempotency-key": "call-1"})
        assert r.status_code == 200
        ids.add(r.headers["x-agentbolt-call-id"])
    [event] = rig.llm_calls(claim.rollout.id)
    assert (event.data["retries"], event.data["tries"]) == (2, [0, 1, 2]) and ids == {str(event.id)}
    assert len(upstream.calls) - before == 3  # each try is forwarded
    # the key with another body is another call under a reused key: refused, never forwarded
    other = {"model": "double", "messages": [{"role": "user", "content": "another"}]}
    r = httpx.post(f"{url}/chat/completions", json=other, headers={"idempotency-key": "call-1"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "IdempotencyKeyReused"
    assert len(upstream.calls) - before == 3 and len(rig.llm_calls(claim.rollout.id)) == 1


def test_upstream_error_is_returned_openai_style_and_recorded(rig, upstream, caplog):
    claim = rig.claim(model="error-500", api_key="sk-very-secret-key")
    with caplog.at_level(logging.DEBUG), pytest.raises(openai.InternalServerError) as info:
        _openai(claim).chat.completions.create(model="error-500", messages=MESSAGES)
    assert upstream.calls[-1].headers["authorization"] == "Bearer sk-very-secret-key"
    assert info.value.status_code == 500 and "***" in info.value.body["message"]
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["upstream_status"] == 500 and event.data["choices"] == []
    assert event.data["error"]["error"]["type"] == "server_error"
    assert "sk-very-secret-key" not in json.dumps(event.data) + info.value.response.text + caplog.text


def test_retryable_statuses_are_retried(rig, upstream):
    claim = rig.claim()
    upstream.fail_next[:] = [503, 429]
    answer = _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    assert answer.choices[0].message.content and len(upstream.calls) == 3
    [event] = rig.llm_calls(claim.rollout.id)  # one call, one record
    assert event.data["upstream_status"] == 200 and event.data["prompt_token_ids"]


def test_unreachable_upstream_is_a_502(rig):
    claim = rig.claim(base_url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(openai.APIStatusError) as info:
        _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    assert info.value.status_code == 502 and info.value.body["type"] == "upstream_unavailable"
    [event] = rig.llm_calls(claim.rollout.id)
    assert (
        event.data["upstream_status"] is None
        and event.data["error"]["error"]["type"] == "upstream_unavailable"
    )


def test_upstream_timeout_is_a_504(tmp_path, upstream):
    upstream.delay = 1.0
    config = ServerConfig(db=":memory:", upstream_timeout=0.3)
    with ServerThread(config) as server:
        from agentbolt.client import Client

        with Client(server.url) as client:
            client.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
            client.enqueue([RolloutCreate(task=Task())])
            claim = client.dequeue("w")
            with pytest.raises(openai.APIStatusError) as info:
                _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
            assert info.value.status_code == 504
            [event] = [e for e in client.all_events(claim.rollout.id) if e.type == "llm_call"]
            assert event.data["error"]["error"]["type"] == "upstream_timeout"


def test_broken_stream_ends_with_an_error_and_is_recorded(rig):
    claim = rig.claim(model="broken-stream")
    with pytest.raises(openai.APIError):
        list(_openai(claim).chat.completions.create(model="broken-stream", messages=MESSAGES, stream=True))
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["error"]["error"]["type"] == "upstream_stream_error"


def test_upstream_without_token_ids_is_asked_again_and_remembered(rig, upstream):
    upstream.strict = True
    claim = rig.claim()
    client = _openai(claim)
    for _ in range(2):
        assert client.chat.completions.create(model="double", messages=MESSAGES).choices[0].message.content
    sent = [c.body for c in upstream.calls]
    assert ["return_token_ids" in b for b in sent] == [True, False, False]
    events = rig.llm_calls(claim.rollout.id)
    assert len(events) == 2 and all(e.data["prompt_token_ids"] is None for e in events)
    assert all(e.data["choices"][0]["token_ids"] is None and e.data["choices"][0]["logprobs"] for e in events)
    assert all(e.data["token_ids"] is False for e in events)


def test_upstream_rejecting_logprobs_loses_only_logprobs(rig, upstream):
    upstream.strict = {"logprobs"}
    claim = rig.claim()
    client = _openai(claim)
    for _ in range(2):
        assert client.chat.completions.create(model="double", messages=MESSAGES).choices[0].message.content
    sent = [c.body for c in upstream.calls]
    assert [("logprobs" in b, "return_token_ids" in b) for b in sent] == [
        (True, True),
        (False, True),
        (False, True),
    ]
    events = rig.llm_calls(claim.rollout.id)
    assert len(events) == 2
    for event in events:
        assert event.data["token_ids"] is True and event.data["prompt_token_ids"]
        assert event.data["choices"][0]["token_ids"] and event.data["choices"][0]["logprobs"] is None


def test_upstream_rejecting_both_extras_drops_each_once(rig, upstream):
    upstream.strict = {"logprobs", "return_token_ids"}
    claim = rig.claim()
    client = _openai(claim)
    for _ in range(2):
        assert client.chat.completions.create(model="double", messages=MESSAGES).choices[0].message.content
    sent = [sorted(k for k in ("logprobs", "return_token_ids") if k in c.body) for c in upstream.calls]
    assert sent == [["logprobs", "return_token_ids"], ["return_token_ids"], [], []]
    events = rig.llm_calls(claim.rollout.id)
    assert [e.data["token_ids"] for e in events] == [False, False]
    assert all(e.data["error"] is None and e.data["choices"][0]["message"]["content"] for e in events)


def test_text_only_calls_are_counted_skipped_by_token_trainers_and_kept_for_text(rig, upstream):
    from agentbolt.adapters import to_chat_rows, to_transitions

    upstream.strict = True
    claim = rig.claim()
    _openai(claim).chat.completions.create(model="double", messages=MESSAGES)
    events = rig.client.all_events(claim.rollout.id)
    rows, stats = to_transitions(events)
    assert rows == [] and stats.calls == 1 and stats.skipped_no_ids == 1
    [row] = to_chat_rows(events)  # SFT from text still has the conversation
    assert row["messages"][0]["content"] == MESSAGES[0]["content"] and row["messages"][-1]["content"]


def test_agents_own_rejected_logprobs_is_never_retried_altered(rig, upstream):
    upstream.strict = {"logprobs"}
    claim = rig.claim()
    with pytest.raises(openai.BadRequestError) as info:
        _openai(claim).chat.completions.create(model="double", messages=MESSAGES, logprobs=True)
    assert "logprobs" in str(info.value)
    assert len(upstream.calls) == 1 and upstream.calls[0].body["logprobs"] is True
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["upstream_status"] == 400
    # a later call that leaves logprobs to the gateway still gets the fallback
    assert _openai(claim).chat.completions.create(model="double", messages=MESSAGES).choices
    assert "logprobs" not in upstream.calls[-1].body


def test_keys_from_config_and_redaction_everywhere(tmp_path, upstream, caplog):
    admin, runner_token = "admin-token", "runner-token"
    config = ServerConfig(
        db=str(tmp_path / "s.db"),
        tokens={admin: Role.ADMIN, runner_token: Role.RUNNER},
        upstream_api_keys={"*": "sk-config-secret"},
    )
    secrets = ("sk-resource-secret", "sk-config-secret", runner_token)
    with caplog.at_level(logging.DEBUG), ServerThread(config) as server:
        from agentbolt.client import Client

        with Client(server.url, admin) as admin_client, Client(server.url, runner_token) as runner:
            admin_client.publish_resources(
                {
                    "llm": LLM(base_url=upstream.base_url, model="double", api_key="sk-resource-secret"),
                    "judge": LLM(base_url=upstream.base_url, model="judge"),
                }
            )
            admin_client.enqueue([RolloutCreate(task=Task())])
            claim = runner.dequeue("w")
            llm = claim.resources.resources["llm"]
            assert llm.api_key == claim.agent_key != runner_token  # the attempt's key, never the runner's
            client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
            client.chat.completions.create(model="double", messages=MESSAGES)
            assert upstream.calls[-1].headers["authorization"] == "Bearer sk-resource-secret"
            client.chat.completions.create(model="judge", messages=MESSAGES)
            assert upstream.calls[-1].headers["authorization"] == "Bearer sk-config-secret"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=llm.base_url, api_key="wrong", max_retries=0).chat.completions.create(
                    model="double", messages=MESSAGES
                )
            served = [
                httpx.get(f"{server.url}{path}", headers={"authorization": f"Bearer {admin}"}).text
                for path in (
                    "/api/resources",
                    "/api/resources/latest",
                    "/api/resources/1",
                    f"/api/rollouts/{claim.rollout.id}/events",
                )
            ]
            events = json.dumps([e.data for e in admin_client.all_events(claim.rollout.id)])
            assert "<redacted>" in served[1]
            # a resource re-published from a redacted read still reaches its upstream with its key
            latest = admin_client.latest_resources()
            admin_client.publish_resources(latest.resources)
            admin_client.enqueue([RolloutCreate(task=Task())])
            claim2 = runner.dequeue("w")
            llm2 = claim2.resources.resources["llm"]
            openai.OpenAI(
                base_url=llm2.base_url, api_key=llm2.api_key, max_retries=0
            ).chat.completions.create(model="double", messages=MESSAGES)
            assert upstream.calls[-1].headers["authorization"] == "Bearer sk-resource-secret"
    for secret in secrets[:2]:
        assert all(secret not in text for text in served), secret
        assert secret not in events and secret not in caplog.text
    for call in upstream.calls:  # the runner's token never travels upstream
        assert runner_token not in json.dumps(call.headers)


def test_each_call_is_recorded_as_its_roles_and_an_unknown_role_is_a_404_naming_them(rig, upstream):
    """Two LLM resources (roles) in one rollout: a call goes to, and is recorded as, the one
    whose model it names; any other model is refused, never recorded as some role's call."""
    planner = LLM(base_url=upstream.base_url, model="double")
    solver = LLM(base_url=upstream.base_url, model="double-solver")
    rig.client.publish_resources({"planner": planner, "solver": solver})
    rig.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
    claim = rig.client.dequeue("w1")
    assert claim is not None
    roles = claim.resources.resources
    for role, model in (("planner", "double"), ("solver", "double-solver"), ("planner", "double-solver")):
        client = openai.OpenAI(base_url=roles[role].base_url, api_key=roles[role].api_key, max_retries=0)
        client.chat.completions.create(model=model, messages=MESSAGES)
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="critic", messages=MESSAGES)
    message = refused.value.body["message"]  # type: ignore[index]
    assert (
        "'critic'" in message
        and "planner (model 'double')" in message
        and "solver (model 'double-solver')" in message
    )
    calls = rig.llm_calls(claim.rollout.id)
    # by the model asked for, whichever role's client asked
    assert [c.data["resource"] for c in calls] == ["planner", "solver", "solver"]
