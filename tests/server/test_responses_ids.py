"""What the gateway asks of an upstream's own /responses, what it records, and what it takes out
of the answer again (:mod:`agentbolt.server.responses_ids`), on vLLM 0.34.0's shapes."""

from __future__ import annotations

from typing import Any

from agentbolt.server.responses_ids import LOGPROBS, prepare, recorded_ids, strip, strip_event


def _raw(tokens: list[int]) -> dict[str, Any]:
    return {"message": "x", "tokens": tokens, "type": "raw_message_tokens"}


def _answer(logprobs: list[float] | None, **fields: Any) -> dict[str, Any]:
    part = {"type": "output_text", "text": "ab", "annotations": [], "logprobs": None}
    if logprobs is not None:
        part["logprobs"] = [
            {"token": "a", "logprob": lp, "bytes": [97], "top_logprobs": []} for lp in logprobs
        ]
    message = {"type": "message", "id": "m", "role": "assistant", "status": "completed", "content": [part]}
    return {"id": "r", "output": [message], "top_logprobs": 0, **fields}


def test_the_asks_join_what_the_agent_sent_and_never_replace_it():
    upstream, wants = prepare({"input": "hi", "include": ["reasoning.encrypted_content"]}, True, True)
    assert upstream["enable_response_messages"] is True
    assert upstream["include"] == ["reasoning.encrypted_content", LOGPROBS]
    assert not wants.token_ids and not wants.logprobs
    own = {"input": "hi", "enable_response_messages": True, "include": [LOGPROBS]}
    assert prepare(own, True, True) == (own, prepare(own, False, False)[1])
    assert prepare(own, True, True)[1].token_ids and prepare(own, True, True)[1].logprobs
    refused, _ = prepare({"input": "hi"}, ask_token_ids=False, ask_logprobs=False)
    assert refused == {"input": "hi"}


def test_ids_are_recorded_only_from_one_input_and_one_output_message_with_tokens():
    one = _answer([-0.1, -0.2], input_messages=[_raw([1, 2])], output_messages=[_raw([7, 8])])
    assert recorded_ids(one) == ([1, 2], [7, 8], [-0.1, -0.2])
    # logprobs that do not line up with the completion's tokens are none
    assert recorded_ids({**one, "output": _answer([-0.1])["output"]}) == ([1, 2], [7, 8], None)
    # built-in tools that ran two model turns: one output message per turn and prompt
    turns = {**one, "output_messages": [_raw([7]), _raw([1, 2, 7, 3]), _raw([8])]}
    assert recorded_ids(turns)[1] is None
    # a Harmony (gpt-oss) model: its messages carry no tokens
    harmony = [{"author": {"role": "user"}, "content": [{"type": "text", "text": "hi"}]}]
    assert recorded_ids({**one, "input_messages": harmony})[0] is None
    assert recorded_ids(_answer(None)) == (None, None, None)


def test_what_the_agent_did_not_ask_for_is_taken_out_as_vllm_leaves_it_out():
    asked = {"input": "hi"}
    _, wants = prepare(asked, True, True)
    body = _answer([-0.1, -0.2], input_messages=[_raw([1])], output_messages=[_raw([7, 8])])
    out = strip(body, wants)
    assert out["input_messages"] is out["output_messages"] is out["top_logprobs"] is None
    assert out["output"][0]["content"][0]["logprobs"] is None
    delta = {
        "type": "response.output_text.delta",
        "delta": "a",
        "logprobs": [{"token": "a", "logprob": -0.1}],
    }
    assert strip_event(delta, wants)["logprobs"] == []
    done = {"type": "response.content_part.done", "part": _answer([-0.1])["output"][0]["content"][0]}
    assert strip_event(done, wants)["part"]["logprobs"] is None
    _, own = prepare({"input": "hi", "enable_response_messages": True, "include": [LOGPROBS]}, True, True)
    kept = _answer([-0.1], input_messages=[_raw([1])], output_messages=[_raw([7])])
    assert strip(dict(kept), own) == kept
