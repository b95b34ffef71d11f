"""Prompt prefixes shared by the prompts of one prefill, or kept from an earlier prefill, are
computed once; the log-probabilities stay those of a teacher-forced pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_helpers import make_engine, max_logprob_error

from agentbolt.engine import ModelEngine
from agentbolt.engine.prefix import MIN_SHARED_PREFIX, common_length

SYSTEM = {
    "role": "system",
    "content": "You are a careful assistant who answers briefly and checks every step.",
}


def _body(text: str, **extra) -> dict:
    messages = [SYSTEM, {"role": "user", "content": text}]
    return {"model": "tiny", "messages": messages, "ignore_eos": True, "logprobs": True, **extra}


def _max_error(engine: ModelEngine, responses: list[dict]) -> float:
    return max_logprob_error(engine.model, responses)


def _record_prefill_widths(engine: ModelEngine) -> list[tuple[int, int]]:
    """(new tokens per row, cached + new columns) of the forward pass of every prefill's prompts."""
    batcher, widths, inside = engine._batcher, [], []
    forward, prefill = batcher._forward, batcher._prefill

    def recording_forward(ids_BT, mask_BL, pos_BT, cache, adapters=None):
        if inside:
            inside[-1] = (ids_BT.shape[1], mask_BL.shape[1])  # the last one is the prompts' pass
        return forward(ids_BT, mask_BL, pos_BT, cache, adapters)

    def recording_prefill(groups):
        inside.append(None)
        try:
            prefill(groups)
        finally:
            widths.append(inside.pop())

    batcher._forward = recording_forward  # type: ignore[method-assign]
    batcher._prefill = recording_prefill  # type: ignore[method-assign]
    return widths


def testcommon_length() -> None:
    assert common_length([(1, 2, 3), (1, 2, 4), (1, 2)]) == 2
    assert common_length([(1, 2), (1, 2)]) == 2
    assert common_length([(5,), (1, 2)]) == 0


@pytest.fixture
def prefix_engine(tiny_dir: Path):
    eng = make_engine(tiny_dir, max_batch=16)
    yield eng
    eng.close()


async def test_shared_and_kept_prefixes_are_computed_once_and_stay_exact(prefix_engine: ModelEngine) -> None:
    engine = prefix_engine
    widths = _record_prefill_widths(engine)
    first = await engine.chat(_body("Hi", max_tokens=6))  # alone: the whole prompt, then kept
    texts = ["What is two plus two?", "Tell me a story about a cat.", "Hi"]
    together = await asyncio.gather(*[engine.chat(_body(t, max_tokens=9, temperature=0)) for t in texts])
    sampled = await engine.chat(_body("Name three colours.", max_tokens=7, n=2, seed=3))
    prompts = [r["prompt_token_ids"] for r in [first, *together, sampled]]
    assert len(widths) >= 3, widths
    assert widths[0] == (len(prompts[0]), len(prompts[0]))  # nothing to share yet
    shared = common_length([tuple(p) for p in prompts])
    assert shared >= MIN_SHARED_PREFIX
    for new, columns in widths[1:]:  # later prefills start from the kept prefix
        assert new <= columns - shared, widths
    assert _max_error(engine, [first, *together, sampled]) < 1e-4


async def test_a_weight_update_drops_the_kept_prefix(prefix_engine: ModelEngine) -> None:
    engine = prefix_engine
    await engine.chat(_body("Hi", max_tokens=3))
    assert engine._batcher._kept.kept is not None
    state = {k: v * 1.5 if k.endswith("proj.weight") else v for k, v in engine.model.state_dict().items()}
    engine.update_weights(state_dict=state)
    again = await engine.chat(_body("Hi there", max_tokens=5))
    assert _max_error(engine, [again]) < 1e-4  # computed with the new weights, not the kept keys


async def test_a_prompt_that_is_the_kept_prefix_still_prefills_its_last_token(
    prefix_engine: ModelEngine,
) -> None:
    engine = prefix_engine
    widths = _record_prefill_widths(engine)
    body = _body("Hello", max_tokens=4, temperature=0)
    responses = [await engine.chat(body), await engine.chat(body)]  # the second prompt is all kept
    assert responses[0]["choices"][0]["token_ids"] == responses[1]["choices"][0]["token_ids"]
    assert _max_error(engine, responses) < 1e-4
    assert widths[-1] == (1, len(responses[1]["prompt_token_ids"]))
