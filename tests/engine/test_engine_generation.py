"""Generation through the in-process API: logprobs, batching, n, stop, seeds."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import chat_body, teacher_forced_logprobs

from agentbolt.engine import ModelEngine

PROMPTS = [
    "What is 12 plus 30?",
    "Hello!",
    "Use the calculator tool.",
    "The quick brown fox",
    "You are helpful.",
]


async def test_logprobs_match_a_teacher_forced_pass(engine: ModelEngine) -> None:
    body = chat_body(
        PROMPTS[0], max_tokens=24, temperature=1.0, top_p=0.9, seed=3, logprobs=True, top_logprobs=3
    )
    response = await engine.chat(body)
    choice = response["choices"][0]
    ids, prompt_ids = choice["token_ids"], response["prompt_token_ids"]
    returned = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    expected = teacher_forced_logprobs(engine.model, prompt_ids, ids)
    assert len(ids) == 24 or choice["finish_reason"] == "stop"
    assert torch.allclose(returned, expected, atol=1e-4), (returned - expected).abs().max()
    # alternatives are the raw distribution's top 3, best first, and hold the sampled token when it is among them
    for entry in choice["logprobs"]["content"]:
        alts = [a["logprob"] for a in entry["top_logprobs"]]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True) and alts[0] >= entry["logprob"] - 1e-6


async def test_completion_logprobs_match_a_teacher_forced_pass(engine: ModelEngine) -> None:
    response = await engine.complete(
        {"prompt": "The quick brown", "max_tokens": 10, "logprobs": 2, "seed": 1}
    )
    choice = response["choices"][0]
    expected = teacher_forced_logprobs(engine.model, choice["prompt_token_ids"], choice["token_ids"])
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)
    assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"]) == 10
    assert response["usage"] == {
        "prompt_tokens": len(choice["prompt_token_ids"]),
        "completion_tokens": 10,
        "total_tokens": len(choice["prompt_token_ids"]) + 10,
    }


async def test_prompt_ids_are_the_chat_template_rendering(engine: ModelEngine) -> None:
    response = await engine.chat(chat_body("Hello!", max_tokens=2))
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert response["prompt_token_ids"] == list(expected)
    assert response["model"] == "tiny" and response["model_version"] == engine.version
    assert response["system_fingerprint"] == f"agentbolt-v{engine.version}"


async def _greedy(engine: ModelEngine, text: str, n_tokens: int = 20) -> list[int]:
    response = await engine.chat(chat_body(text, max_tokens=n_tokens, temperature=0, ignore_eos=True))
    return response["choices"][0]["token_ids"]


async def test_batched_and_single_greedy_outputs_are_equal(engine: ModelEngine) -> None:
    single = [await _greedy(engine, p) for p in PROMPTS]
    together = await asyncio.gather(*[_greedy(engine, p) for p in PROMPTS])
    assert list(together) == single


async def test_requests_join_a_running_batch_and_stop_on_their_own(engine: ModelEngine) -> None:
    solo_short = await _greedy(engine, PROMPTS[1], 5)
    start = engine.stats()["steps"]
    long_task = asyncio.create_task(_greedy(engine, PROMPTS[0], 150))
    while engine.stats()["steps"] < start + 10:  # the long request is decoding
        await asyncio.sleep(0.005)
    short = await _greedy(engine, PROMPTS[1], 5)
    assert not long_task.done(), "the short request had to wait for the long one"
    assert short == solo_short  # joining mid-batch (left-padded rows) changes nothing
    assert len(await long_task) == 150
    # One decode step per token for the whole batch: the KV cache is reused, nothing is recomputed,
    # and the short request rode along in the long one's steps.
    assert engine.stats()["steps"] - start <= 150


async def test_n_choices_differ_and_share_one_prompt(engine: ModelEngine) -> None:
    response = await engine.chat(chat_body(PROMPTS[2], n=4, max_tokens=12, temperature=1.0, seed=11))
    choices = response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    assert response["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    again = await engine.chat(chat_body(PROMPTS[2], n=4, max_tokens=12, temperature=1.0, seed=11))
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in choices]


async def test_seeded_sampling_ignores_the_rest_of_the_batch(engine: ModelEngine) -> None:
    body = chat_body(PROMPTS[3], max_tokens=16, temperature=0.8, top_k=50, seed=5)
    alone = (await engine.chat(body))["choices"][0]["token_ids"]
    noise = [engine.chat(chat_body(p, max_tokens=16, temperature=1.0)) for p in PROMPTS]
    crowded, *_ = await asyncio.gather(engine.chat(body), *noise)
    assert crowded["choices"][0]["token_ids"] == alone
    unseeded = [(await engine.chat(dict(body, seed=None)))["choices"][0]["token_ids"] for _ in range(3)]
    assert any(u != alone for u in unseeded)


async def test_tiny_top_p_is_greedy(engine: ModelEngine) -> None:
    greedy = await _greedy(engine, PROMPTS[4], 12)
    nucleus = await engine.chat(
        chat_body(PROMPTS[4], max_tokens=12, temperature=1.0, top_p=1e-6, ignore_eos=True)
    )
    assert nucleus["choices"][0]["token_ids"] == greedy


async def test_stop_string_cuts_the_text_but_keeps_the_ids(engine: ModelEngine) -> None:
    full = await engine.chat(chat_body(PROMPTS[0], max_tokens=30, temperature=0, ignore_eos=True))
    text = full["choices"][0]["message"]["content"]
    clean = [i for i in range(4, len(text) - 3) if text[i : i + 2].isascii() and text[i : i + 2].strip()]
    stop = text[clean[0] : clean[0] + 2]
    cut = await engine.chat(chat_body(PROMPTS[0], max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    ids = choice["token_ids"]
    assert ids == full["choices"][0]["token_ids"][: len(ids)]
    assert stop in engine.tokenizer.decode(ids) and stop not in engine.tokenizer.decode(ids[:-1])
    kept = await engine.chat(
        chat_body(
            PROMPTS[0],
            max_tokens=30,
            temperature=0,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        )
    )
    assert kept["choices"][0]["message"]["content"] == text[: text.index(stop) + len(stop)]


async def test_stop_token_ids_and_length(engine: ModelEngine) -> None:
    ids = await _greedy(engine, PROMPTS[0], 10)
    stopped = await engine.chat(
        chat_body(PROMPTS[0], max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[ids[3]])
    )
    first = ids.index(ids[3])
    assert stopped["choices"][0]["token_ids"] == ids[: first + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    capped = await engine.chat(chat_body(PROMPTS[0], max_tokens=3, temperature=0, ignore_eos=True))
    assert capped["choices"][0]["finish_reason"] == "length" and capped["choices"][0]["token_ids"] == ids[:3]


async def test_eos_ends_the_sequence_and_is_reported(engine: ModelEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    # Make the model's own end-of-sequence token come out: sample until one run ends on it.
    for seed in range(40):
        response = await engine.chat(chat_body(PROMPTS[1], max_tokens=40, temperature=1.5, seed=seed))
        choice = response["choices"][0]
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] == eos and eos not in choice["token_ids"][:-1]
            assert "<|im_end|>" not in choice["message"]["content"]
            return
    pytest.fail("no sampled sequence ended with the end-of-sequence token")


async def test_token_ids_can_be_turned_off(engine: ModelEngine) -> None:
    response = await engine.chat(chat_body("Hello!", max_tokens=2, return_token_ids=False))
    assert "prompt_token_ids" not in response and "token_ids" not in response["choices"][0]
