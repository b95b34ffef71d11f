"""The training passes' attention on the CPU against transformers' sdpa: same logits and
gradients (float32, 1e-5 relative), close under bfloat16 autocast, and sdpa itself wherever
the plain computation is not used."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from agentbolt.algorithms import train_attention as ta
from agentbolt.algorithms import train_state
from agentbolt.algorithms.losses import PolicyLoss, TrainRow, pad_batch, shared_prefix_len
from agentbolt.algorithms.train_state import TrainConfig, make_trainable

pytestmark = pytest.mark.usefixtures("one_thread")

TinyLlama = Callable[..., LlamaForCausalLM]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows, right-padded to different lengths (one of them fully padded at the end)."""
    ids = torch.randint(3, 290, (3, 14), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, 9:] = 0
    mask[2, 12:] = 0
    return ids, mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return float((got - want).abs().max()) <= rel * max(float(want.abs().max()), 1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_logits_and_gradients_match_sdpa(tiny_llama: TinyLlama, autocast: bool) -> None:
    ids, mask = _batch()
    weights = torch.randn(3, 14, 300, generator=torch.Generator().manual_seed(5))
    results = []
    for switch in (False, True):
        model = tiny_llama()
        if switch:
            assert ta.use_train_attention(model)
            assert model.config._attn_implementation == ta.NAME
        else:
            assert model.config._attn_implementation == "sdpa"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        (logits * weights).sum().backward()
        results.append((logits.detach(), _grads(model)))
    (want, want_grads), (got, got_grads) = results
    rel = 2e-2 if autocast else 1e-5
    keep = mask.bool()  # padded positions' outputs are not used by any loss
    assert _close(got[keep], want[keep], rel)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _close(got_grads[name], grad, 5 * rel), name


def test_the_policy_loss_with_a_shared_prefix_matches_sdpa(
    tiny_llama: TinyLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO's loss path: LoRA, the shared prompt computed once (its keys and values expanded to
    the batch), the suffix's queries over prefix + suffix keys, checkpointed layers."""
    prefix = tuple(range(3, 23))
    rows = [
        TrainRow(prefix + tuple(range(30, 30 + n)), (0,) * 20 + (1,) * n, None, a)
        for n, a in ((4, 1.0), (7, -1.0), (2, 0.5))
    ]
    batch = pad_batch(rows)
    assert shared_prefix_len(batch) > 0
    results = []
    for switch in (False, True):
        with monkeypatch.context() as patch:
            if not switch:  # make_trainable's LoRA model, attention left on sdpa
                patch.setattr(train_state, "use_train_attention", lambda m: False)
            model = make_trainable(tiny_llama(), TrainConfig(lora_r=4))
        assert (model.config._attn_implementation == ta.NAME) == switch
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(6))
        loss, _ = PolicyLoss(0.2, 0.28, 0.0, checkpoint=True)(model, batch, 13.0)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (want, want_grads), (got, got_grads) = results
    assert _close(got, want, 1e-5)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, grad in want_grads.items():
        assert _close(got_grads[name], grad, 1e-4), name


def test_sdpa_serves_what_the_plain_computation_does_not(
    tiny_llama: TinyLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without gradients (reference and behaviour log-probs), over MAX_SCORES scores, or with
    dropout, the call goes to transformers' sdpa function."""
    calls: list[int] = []
    sdpa = ta._sdpa()

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(ta, "_sdpa", lambda: counting)
    model = tiny_llama()
    assert ta.use_train_attention(model)
    ids, mask = _batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2  # one per layer
    calls.clear()
    model(input_ids=ids, attention_mask=mask)  # gradients on, small: the plain computation
    assert not calls
    monkeypatch.setattr(ta, "MAX_SCORES", 3 * 4 * 14 * 14 - 1)
    model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(ta, "MAX_SCORES", 3 * 4 * 14 * 14)
    model(input_ids=ids, attention_mask=mask)
    assert not calls


def test_a_row_with_nothing_to_attend_to_stays_finite() -> None:
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, requires_grad=True)
    v = torch.randn(1, 1, 3, 8, requires_grad=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[0, 0, 1] = False  # query 1 attends to nothing
    out, _ = ta.train_attention(torch.nn.Module(), q, k, v, mask)
    out.sum().backward()
    assert out.shape == (1, 3, 2, 8)
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()  # type: ignore[arg-type]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(1, 2, 3, 8), v.expand(1, 2, 3, 8), attn_mask=mask
    ).transpose(1, 2)
    rows = torch.tensor([0, 2])
    assert torch.allclose(out[:, rows], want[:, rows], atol=1e-6)


def test_only_sdpa_models_are_switched_and_the_name_is_not_saved(tmp_path, tiny_llama: TinyLlama) -> None:
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    assert not ta.use_train_attention(eager)
    assert eager.config._attn_implementation == "eager"
    model = tiny_llama()
    assert ta.use_train_attention(model)
    model.save_pretrained(tmp_path)
    assert ta.NAME not in (tmp_path / "config.json").read_text()


def test_value_heads_of_another_width_go_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []

    def recording(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(tuple(value.shape))
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    monkeypatch.setattr(ta, "_sdpa", lambda: recording)
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 2, 3, 8)
    out, _ = ta.train_attention(torch.nn.Module(), q, k, torch.randn(1, 2, 3, 4), None)
    assert calls == [(1, 2, 3, 4)] and out.shape == (1, 3, 2, 4)
    out, _ = ta.train_attention(torch.nn.Module(), q, k, torch.randn(1, 2, 3, 8), None)
    assert len(calls) == 1 and out.shape == (1, 3, 2, 8)  # same widths: computed here
