"""Prompt rendering, tools in the system message, and tool-call parsing."""

from __future__ import annotations

import json

import pytest

from agentbolt.engine import EngineRequestError, ModelEngine
from agentbolt.engine.chat_format import parse_tool_calls, render_chat_prompt, template_supports_tools
from agentbolt.engine.protocol import ChatCompletionRequest
from agentbolt.engine.responses import chat_response
from agentbolt.engine.sampling import SamplingParams
from agentbolt.engine.sequence import Sequence

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def test_tools_go_into_the_system_message_when_the_template_lacks_them(engine: ModelEngine) -> None:
    tok = engine.tokenizer
    assert not template_supports_tools(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30?"}]
    text = tok.decode(render_chat_prompt(tok, messages, tools=[CALC]))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.") and json.dumps(CALC) in system
    assert "<tool_call>" in system
    no_system = tok.decode(render_chat_prompt(tok, messages[1:], tools=[CALC]))
    assert no_system.startswith("<|im_start|>system\n# Tools")


def test_history_with_tool_calls_and_results(engine: ModelEngine) -> None:
    tok = engine.tokenizer
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "12+30"}'},
    }
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "12+30?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = tok.decode(render_chat_prompt(tok, messages))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>tool\n42<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(EngineRequestError, match="image_url"):
        render_chat_prompt(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_parse_tool_calls_rule() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*21"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "2*21"}'}
    two = parse_tool_calls(
        '<tool_call>{"name": "a", "parameters": {}}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    assert two[0] is None and [c["function"]["name"] for c in two[1]] == ["a", "b"]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []


def _finished(engine: ModelEngine, text: str) -> Sequence:
    seq = Sequence(
        [1], SamplingParams(), decode=lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)
    )
    seq.output_ids = engine.tokenizer(text)["input_ids"] + [engine.tokenizer.eos_token_id]
    seq.logprobs = [0.0] * len(seq.output_ids)
    seq.finish_reason, seq.versions = "stop", [0]
    return seq


def test_tool_calls_in_the_response(engine: ModelEngine) -> None:
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>'
    with_tools = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[CALC])
    body = chat_response(with_tools, "tiny", engine.tokenizer, [1], [_finished(engine, text)])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"expression": "12+30"}
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    body = chat_response(plain, "tiny", engine.tokenizer, [1], [_finished(engine, text)])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    none = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=[CALC], tool_choice="none"
    )
    assert (
        "tool_calls"
        not in chat_response(none, "tiny", engine.tokenizer, [1], [_finished(engine, text)])["choices"][0][
            "message"
        ]
    )


async def test_tool_request_end_to_end(engine: ModelEngine) -> None:
    response = await engine.chat(
        {
            "messages": [{"role": "user", "content": "12+30?"}],
            "tools": [CALC],
            "max_tokens": 4,
            "temperature": 0,
        }
    )
    prompt = engine.tokenizer.decode(response["prompt_token_ids"])
    assert '"name": "calculator"' in prompt and response["choices"][0]["finish_reason"] in ("length", "stop")


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.expression }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tool_support_renders_them_itself(engine: ModelEngine) -> None:
    import copy

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    assert template_supports_tools(tok)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'},
    }
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    text = tok.decode(render_chat_prompt(tok, messages, tools=[CALC]))
    assert text.startswith("<|im_start|>system\nTOOLS: calculator<|im_end|>")
    assert "CALL calculator 1+2" in text and "# Tools" not in text  # arguments handed over as an object
