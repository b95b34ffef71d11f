"""The sampler on hand-made logits."""

from __future__ import annotations

import torch

from agentbolt.engine.sampling import SamplingParams, sample_step


def _gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_rows_take_the_argmax_and_report_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample_step(
        logits, [SamplingParams(temperature=0), SamplingParams(top_k=1)], _gens(2), max_top_logprobs=2
    )
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == [1, 0]
    assert torch.allclose(torch.tensor(out.logprobs), raw[[0, 1], [1, 0]])
    assert out.top_ids == [[1, 2], [0, 2]]


def test_temperature_and_truncation_do_not_change_the_reported_logprob() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.3, top_p=0.5, top_k=5)
    out = sample_step(logits, [params], _gens(1))
    assert torch.isclose(torch.tensor(out.logprobs[0]), torch.log_softmax(logits, -1)[0, out.token_ids[0]])
    assert out.token_ids[0] in logits[0].topk(5).indices.tolist()


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [SamplingParams(temperature=1.0, top_p=0.75)] * 400
    out = sample_step(probs.log().repeat(400, 1), params, _gens(400))
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 reaches it: token 2 never drawn


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    out = sample_step(probs.log().repeat(2000, 1), [SamplingParams()] * 2000, _gens(2000))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 2000
    assert torch.allclose(freq, probs[0], atol=0.04)


def test_a_row_draws_from_its_own_generator() -> None:
    logits = torch.zeros(3, 1000)
    a = sample_step(logits, [SamplingParams()] * 3, _gens(3, seed=7)).token_ids
    b = sample_step(logits[:1], [SamplingParams()], _gens(1, seed=7)).token_ids
    assert a[0] == b[0] and len(set(a)) > 1


def test_first_argmax_is_torch_argmax_including_ties_and_nan() -> None:
    from agentbolt.engine.sampling import first_argmax

    torch.manual_seed(5)
    x = torch.randn(6, 64 * 20)
    x[1, 70] = x[1, 900] = x[1, 65] = 50.0  # ties across blocks and inside one: the first index wins
    x[2] = float("-inf")
    x[2, 1000] = 0.0
    x[3] = 7.0  # all equal
    x[4, 333] = float("nan")
    x[5, 128:192] = 9.0
    for t in (x, x.bfloat16().float(), torch.randn(3, 1000), torch.randn(4, 64 * 8)[:, ::2]):
        assert torch.equal(first_argmax(t), torch.argmax(t, dim=-1))
    assert first_argmax(x)[1] == 65
