"""Pure body handling: what is asked for, stripped and recorded, in shapes the double lacks."""

from __future__ import annotations

from agentbolt.server.openai_format import CHAT, COMPLETIONS, StreamAssembler, extract, prepare, strip


def test_prepare_asks_for_extras_and_remembers_what_the_agent_wanted():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": False}}
    upstream, wants = prepare(CHAT, body, ask_token_ids=True)
    assert upstream["return_token_ids"] is True and upstream["logprobs"] is True
    assert upstream["stream_options"] == {"include_usage": True} and body["stream_options"] == {
        "include_usage": False
    }
    assert not (wants.token_ids or wants.logprobs or wants.usage)
    upstream, wants = prepare(COMPLETIONS, {"prompt": "x", "logprobs": 0}, ask_token_ids=False)
    assert "return_token_ids" not in upstream and upstream["logprobs"] == 0 and wants.logprobs


def test_engine_version_reports_are_recorded_and_stripped():
    body = {
        "id": "c",
        "model": "m",
        "model_version": 4,
        "model_version_mixed": True,
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                "token_ids": [3, 4],
                "model_versions": [3, 4],
                "logprobs": {"content": [{"token": "h", "logprob": -0.5}, {"token": "i", "logprob": -0.25}]},
            }
        ],
    }
    prompt_ids, [choice] = extract(CHAT, body)
    assert prompt_ids == [1, 2] and choice["model_versions"] == [3, 4] and choice["logprobs"] == [-0.5, -0.25]
    _, wants = prepare(CHAT, {"messages": []}, ask_token_ids=True)
    out = strip(body, wants)
    assert set(out) == {"id", "model", "choices"}
    assert out["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "logprobs": None,
    }


def test_a_batch_of_completion_prompts_keeps_each_prompt():
    body = {
        "choices": [
            {"index": 0, "text": "a", "prompt_token_ids": [1], "token_ids": [5], "logprobs": None},
            {"index": 1, "text": "b", "prompt_token_ids": [2], "token_ids": [6], "logprobs": None},
        ]
    }
    prompt_ids, choices = extract(COMPLETIONS, body)
    assert (
        prompt_ids == [1] and "prompt_token_ids" not in choices[0] and choices[1]["prompt_token_ids"] == [2]
    )


def test_stream_assembly_of_tool_calls_without_index_and_split_arguments():
    assembler = StreamAssembler(CHAT)
    assembler.add(
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    )
    assembler.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "id": "t1",
                                "type": "function",
                                "function": {"name": "calc", "arguments": '{"x": '},
                            }
                        ]
                    },
                    "token_ids": [7],
                }
            ]
        }
    )
    assembler.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                    "token_ids": [8],
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    [choice] = assembler.response()["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
        ],
    }
    assert choice["token_ids"] == [7, 8] and choice["finish_reason"] == "tool_calls"
