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


def test_top_k_alone_follows_the_truncated_distribution() -> None:
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    params = [SamplingParams(top_k=2)] * 3000
    out = sample_step(probs.log().repeat(3000, 1), params, _gens(3000))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=0.04)


def test_mixed_rows_each_keep_their_own_rule() -> None:
    """Plain, top-k and nucleus rows in one batch, in turn: each row draws what it would alone."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 3
    kinds = [
        SamplingParams(),
        SamplingParams(top_k=4),
        SamplingParams(top_p=0.6),
        SamplingParams(temperature=0),
    ]
    params = [kinds[i % 4] for i in range(400)]
    out = sample_step(logits.repeat(400, 1), params, _gens(400)).token_ids
    alone = [sample_step(logits, [p], _gens(1, seed=i)).token_ids[0] for i, p in enumerate(params)]
    assert out == alone
    top4 = set(logits[0].topk(4).indices.tolist())
    assert {t for t, p in zip(out, params, strict=True) if p.top_k == 4} <= top4
    assert (
        len({t for t, p in zip(out, params, strict=True) if p.top_k < 0 and p.top_p == 1.0 and p.temperature})
        > 4
    )


def test_tokens_of_probability_zero_are_never_drawn() -> None:
    """Without truncation the search runs over the vocabulary in order: masked tokens (-inf),
    wherever they lie, the last one included, are never picked, even by uniforms near 1."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, [3, 17, 40]] = torch.tensor([0.0, 1.0, 0.5])
    out = sample_step(logits.repeat(2000, 1), [SamplingParams()] * 2000, _gens(2000)).token_ids
    assert set(out) == {3, 17, 40}

    from agentbolt.engine import sampling

    weights = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    assert sampling._inverse_cdf(weights, torch.tensor([1.0])).tolist() == [1]
    assert sampling._inverse_cdf(weights, torch.tensor([0.0])).tolist() == [0]
    assert sampling._inverse_cdf(weights, torch.tensor([0.25])).tolist() == [1]


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


def test_nucleus_from_the_largest_probabilities_is_the_full_sort(monkeypatch) -> None:
    """A nucleus row first looks at its NUCLEUS_HEAD largest probabilities; the tokens drawn are
    those of sorting the whole vocabulary, when the head holds the nucleus (peaked rows) and when
    it does not (flat rows, which fall back to the full sort)."""
    from agentbolt.engine import sampling

    gen = torch.Generator().manual_seed(11)
    peaked = torch.randn(8, 5000, generator=gen) * 4
    flat = torch.randn(8, 5000, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 8 + [SamplingParams(top_p=0.95, top_k=3000)] * 8
    assert sampling._head_suffices(torch.softmax(peaked / 0.8, -1).topk(64).values, params[:8])
    assert not sampling._head_suffices(torch.softmax(flat, -1).topk(1024).values, params[8:])
    monkeypatch.setattr(sampling, "NUCLEUS_HEAD", 64)
    head = sample_step(logits, params, _gens(16, seed=4)).token_ids
    monkeypatch.setattr(sampling, "NUCLEUS_HEAD", 10**9)
    full = sample_step(logits, params, _gens(16, seed=4)).token_ids
    assert head == full
    draws = sample_step(flat[:1].repeat(500, 1), [params[8]] * 500, _gens(500)).token_ids
    assert len(set(draws)) > 300  # the flat rows' nucleus is wide: the fallback kept all of it
