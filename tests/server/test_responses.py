"""POST /v1/responses through the gateway: a real server on 127.0.0.1 and the real openai client;
the upstream is the test double (tests/server/upstream_double.py), standing in for a model server
that speaks chat completions only, so every call is translated; with ``serves_responses`` it
answers ``/v1/responses`` as vLLM 0.34.0 does, and calls are passed through."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import upstream_double_responses

from agentbolt.adapters import to_trajectories, to_transitions
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.server.responses import Untranslatable, to_chat, to_response
from agentbolt.server.responses_ids import LOGPROBS

TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate arithmetic.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    "strict": False,
}


def _openai(claim) -> openai.OpenAI:
    llm = claim.resources.resources["llm"]
    return openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)


def test_text_answer_is_a_response_recorded_with_token_ids(rig, upstream):
    claim = rig.claim()
    answer = _openai(claim).responses.create(
        model="double", input="What is 6 times 7?", instructions="Be brief."
    )
    assert answer.object == "response" and answer.status == "completed" and answer.output_text
    sent = upstream.calls[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 times 7?"},
    ]
    [event] = rig.llm_calls(claim.rollout.id)
    data = event.data
    assert data["endpoint"] == "responses" and data["request"]["input"] == "What is 6 times 7?"
    assert data["chat_request"]["messages"] == sent.body["messages"]
    # the double's byte tokenizer: ids are the prompt's bytes + 3, so they can be checked exactly
    prompt = "<system>Be brief.<user>What is 6 times 7?<assistant>"
    assert data["prompt_token_ids"] == [b + 3 for b in prompt.encode()]
    assert data["token_ids"] is True and data["choices"][0]["token_ids"]
    assert data["choices"][0]["message"]["content"] == answer.output_text
    assert data["response"]["id"] == answer.id
    assert answer.usage is not None and answer.usage.input_tokens == len(data["prompt_token_ids"])
    assert answer.usage.output_tokens == len(data["choices"][0]["token_ids"])


def test_function_call_out_and_its_output_back_in(rig, upstream):
    claim = rig.claim()
    client = _openai(claim)
    first = client.responses.create(model="double", input="What is 6 times 7?", tools=[TOOL])
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and "expression" in json.loads(call.arguments)
    assert upstream.calls[-1].body["tools"][0]["function"]["name"] == "calculator"
    history = [
        {"role": "user", "content": "What is 6 times 7?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
    ]
    second = client.responses.create(model="double", input=history, tools=[TOOL])
    assert "42" in second.output_text
    messages = upstream.calls[-1].body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "42"}
    events = rig.llm_calls(claim.rollout.id)
    assert len(events) == 2 and all(e.data["token_ids"] and e.data["prompt_token_ids"] for e in events)
    assert events[0].data["choices"][0]["message"]["tool_calls"][0]["id"] == call.call_id


def test_stream_gives_the_response_events_as_the_model_streams(rig, upstream):
    claim = rig.claim()
    with _openai(claim).responses.stream(model="double", input="Hello there") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == final.output_text
    assert {d.item_id for d in deltas} == {final.output[0].id} and events[0].response.id == final.id
    assert upstream.calls[-1].body["stream"] is True  # the model streamed too
    [event] = rig.llm_calls(claim.rollout.id)
    assert (
        event.data["stream"] is True and event.data["choices"][0]["message"]["content"] == final.output_text
    )
    assert event.data["token_ids"] is True and event.data["response"]["id"] == final.id


def test_streamed_function_call(rig, upstream):
    claim = rig.claim()
    with _openai(claim).responses.stream(model="double", input="What is 6 times 7?", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and call.name == "calculator"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) == 2 and "".join(pieces) == call.arguments
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["choices"][0]["message"]["tool_calls"][0]["id"] == call.call_id


def test_broken_stream_ends_with_an_error_event_and_is_recorded(rig, upstream):
    claim = rig.claim(model="broken-stream")
    with httpx.stream(
        "POST",
        f"{claim.resources.resources['llm'].base_url}/responses",
        json={"model": "broken-stream", "input": "hi", "stream": True},
        headers={"authorization": f"Bearer {claim.resources.resources['llm'].api_key}"},
        timeout=10,
    ) as answer:
        kinds = [json.loads(line[5:])["type"] for line in answer.iter_lines() if line.startswith("data:")]
    assert kinds[0] == "response.created" and kinds[-1] == "error" and "response.completed" not in kinds
    [event] = rig.llm_calls(claim.rollout.id)
    assert event.data["endpoint"] == "responses"
    assert event.data["error"]["error"]["type"] == "upstream_stream_error"


def test_untranslatable_requests_are_400_naming_the_field(rig, upstream):
    client = _openai(rig.claim())
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="double", input="hi", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="double", input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id" and "resp_123" in info.value.body["message"]
    assert upstream.calls == []


def test_previous_response_id_continues_on_another_replica(rig, upstream):
    """The state behind previous_response_id is the attempt's record in the store: a second
    server on the same database continues the conversation the first one answered."""
    claim = rig.claim()
    first = _openai(claim).responses.create(
        model="double", input="What is 6 times 7?", instructions="Be brief.", tools=[TOOL]
    )
    [call] = first.output
    base = claim.resources.resources["llm"].base_url
    with ServerThread(ServerConfig(db=rig.server.config.db, upstream_timeout=5.0)) as replica:
        other = openai.OpenAI(
            base_url=base.replace(rig.server.url, replica.url),
            api_key=claim.resources.resources["llm"].api_key,
            max_retries=0,
        )
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
        second = other.responses.create(
            model="double",
            input=[output],
            previous_response_id=first.id,
            instructions="Answer.",
            tools=[TOOL],
        )
        with pytest.raises(openai.BadRequestError):  # another attempt's answers are not its history
            rig_other = rig.claim()
            _openai(rig_other).responses.create(model="double", input="x", previous_response_id=first.id)
    assert "42" in second.output_text and second.previous_response_id == first.id
    messages = upstream.calls[-1].body["messages"]
    # the new instructions replace the earlier ones; the earlier turn and its tool call come back
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[0]["content"] == "Answer." and messages[1]["content"] == "What is 6 times 7?"
    assert messages[2]["tool_calls"][0]["id"] == call.call_id
    events = rig.llm_calls(claim.rollout.id)
    assert len(events) == 2 and events[1].data["chat_request"]["messages"] == messages
    assert events[1].data["token_ids"] is True


def test_to_chat_merges_calls_and_maps_roles():
    chat = to_chat(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "rules"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "b", "name": "g", "arguments": '{"x": 1}'},
                {
                    "type": "function_call_output",
                    "call_id": "a",
                    "output": [{"type": "input_text", "text": "1"}],
                },
            ],
            "max_output_tokens": 5,
            "tool_choice": {"type": "function", "name": "f"},
        }
    )
    assert chat["messages"][0] == {"role": "system", "content": "rules"}
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["a", "b"]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert chat["max_tokens"] == 5 and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(Untranslatable):
        to_chat({"input": []})
    for field, value in (("model", 3), ("stream", "yes"), ("tools", {}), ("input", None)):
        with pytest.raises(Untranslatable) as info:
            to_chat({"input": "hi", field: value} if field != "input" else {})
        assert info.value.param == field


def test_a_reply_cut_at_the_agents_limit_is_incomplete():
    chat = {"choices": [{"message": {"role": "assistant", "content": "The"}, "finish_reason": "length"}]}
    capped = to_response(chat, {"input": "hi", "max_output_tokens": 1}, "resp_1")
    assert capped["status"] == "incomplete" and capped["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    # the model server's own length limit has no Responses counterpart: the answer is complete
    assert to_response(chat, {"input": "hi"}, "resp_2")["status"] == "completed"


@pytest.fixture
def hosted(upstream):
    upstream.serves_responses = True
    yield upstream
    upstream.serves_responses = False


def test_a_call_to_a_vllm_responses_upstream_records_token_ids_that_train(rig, hosted):
    """vLLM 0.34.0's /v1/responses (the double) is asked for its token ids and logprobs
    (``enable_response_messages``, ``include``); the record holds them in the chat shape, the
    adapters make training rows of them, and the agent gets none of what it did not ask for."""
    claim = rig.claim()
    client = _openai(claim)
    raw = client.responses.with_raw_response.create(
        model="double", input="Hi", tools=[{"type": "web_search"}]
    )
    answer = raw.parse()
    assert answer.id == "resp_hosted" and answer.output_text == "Hosted answer."
    with client.responses.stream(model="double", input="Hi again", instructions="Be brief.") as stream:
        deltas = [e.logprobs for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert streamed.output_text == "Hosted answer." and deltas == [[], [], []]
    body = json.loads(raw.http_response.text)  # as the agent got it: vLLM's answer without the asks
    assert body["input_messages"] is body["output_messages"] is body["top_logprobs"] is None
    assert body["output"][0]["content"][0]["logprobs"] is None
    assert [c.path for c in hosted.calls] == ["/v1/responses", "/v1/responses"]
    sent = hosted.calls[0].body
    assert sent["tools"] == [{"type": "web_search"}]  # the agent's request, plus the asks
    assert sent["enable_response_messages"] is True and sent["include"] == [LOGPROBS]
    events = rig.llm_calls(claim.rollout.id)
    assert [e.data["stream"] for e in events] == [False, True]
    prompts = [upstream_double_responses.prompt_text(c.body) for c in hosted.calls]
    assert prompts == ["<user>Hi<assistant>", "<system>Be brief.<user>Hi again<assistant>"]
    completion = upstream_double_responses.ids("Hosted answer.")
    for event, prompt in zip(events, prompts, strict=True):
        data = event.data
        assert data["endpoint"] == "responses" and data["token_ids"] is True
        assert data["prompt_token_ids"] == upstream_double_responses.ids(prompt)
        [choice] = data["choices"]
        assert choice["token_ids"] == completion and len(choice["logprobs"]) == len(completion)
        assert choice["message"]["content"] == "Hosted answer."
        assert data["response"]["input_messages"] is None  # the record keeps what the agent got
        assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
    rows, stats = to_transitions(events)
    assert stats.skipped_no_ids == 0 and len(rows) == 2
    assert [r.prompt_ids for r in rows] == [tuple(upstream_double_responses.ids(p)) for p in prompts]
    assert all(r.completion_ids == tuple(completion) and r.logprobs and r.logprobs[0] < 0 for r in rows)
    trajectories, _ = to_trajectories(events)
    assert [t.num_model_tokens for t in trajectories] == [len(completion)] * 2


def test_an_agent_that_asks_for_the_messages_itself_gets_them(rig, hosted):
    claim = rig.claim()
    raw = _openai(claim).responses.with_raw_response.create(
        model="double", input="Hi", extra_body={"enable_response_messages": True}
    )
    body = json.loads(raw.http_response.text)
    assert body["input_messages"][0]["tokens"] == upstream_double_responses.ids("<user>Hi<assistant>")
    assert body["output"][0]["content"][0]["logprobs"] is None  # logprobs it did not ask for
    assert rig.llm_calls(claim.rollout.id)[0].data["token_ids"] is True


def test_an_upstream_that_refuses_the_ask_for_ids_is_recorded_text_only(rig, hosted):
    """A hosted API rejects ``enable_response_messages`` by name: the call goes again without
    it, and the upstream's next calls are sent without it (remembered)."""
    hosted.strict = {"enable_response_messages"}
    claim = rig.claim()
    client = _openai(claim)
    for _ in range(2):
        assert client.responses.create(model="double", input="Hi").output_text == "Hosted answer."
    asked = [c.body.get("enable_response_messages") for c in hosted.calls]
    assert asked == [True, None, None]  # refused once, then never asked again
    assert all(c.body["include"] == [LOGPROBS] for c in hosted.calls)
    events = rig.llm_calls(claim.rollout.id)
    for event in events:
        assert event.data["token_ids"] is False and event.data["prompt_token_ids"] is None
        assert event.data["choices"][0]["message"]["content"] == "Hosted answer."
    rows, stats = to_transitions(events)
    assert not rows and stats.skipped_no_ids == 2


def test_upstream_without_responses_is_asked_once_then_translated(rig, upstream):
    claim = rig.claim()
    client = _openai(claim)
    for _ in range(2):
        assert client.responses.create(model="double", input="Hi").output_text
    assert [c.path for c in upstream.calls] == ["/v1/chat/completions"] * 2  # the 404 is not an answer


def test_agents_sdk_default_model_streamed_through_the_gateway(rig, upstream):
    """The OpenAI Agents SDK with its default (Responses) model, streamed: a function tool turn
    and the answer, both recorded with token ids."""
    from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate arithmetic."""
        return "42"

    claim = rig.claim()
    llm = claim.resources.resources["llm"]

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        agent = Agent(name="calc", instructions="Use the tool.", tools=[calculator], model="double")
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
        try:
            result = Runner.run_streamed(agent, "What is 6 times 7?", max_turns=3, run_config=config)
            async for _ in result.stream_events():
                pass
            return str(result.final_output)
        finally:
            await client.close()

    assert "42" in asyncio.run(run())
    events = rig.llm_calls(claim.rollout.id)
    assert len(events) == 2 and all(e.data["endpoint"] == "responses" and e.data["stream"] for e in events)
    assert all(e.data["token_ids"] is True and e.data["prompt_token_ids"] for e in events)
    assert events[0].data["choices"][0]["finish_reason"] == "tool_calls"
    assert [m["role"] for m in events[1].data["chat_request"]["messages"]][-2:] == ["assistant", "tool"]
