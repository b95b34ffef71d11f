"""The chunked, masked log-prob path against the plain full-softmax computation: same values,
same entropy, same gradients (fp32, 1e-5), with shared prefixes and rows of uneven lengths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from agentbolt.algorithms.losses import (
    Batch,
    PolicyLoss,
    TrainRow,
    checkpointed_layers,
    entropy_from_logits,
    forward_logits,
    logprobs_from_logits,
    masked_logprobs,
    pad_batch,
    reference_logprobs,
    sft_loss,
    shared_prefix_len,
)
from agentbolt.algorithms.train_state import TrainConfig, make_trainable

pytestmark = pytest.mark.usefixtures("one_thread")

TinyLlama = Callable[..., LlamaForCausalLM]
PREFIX = tuple(range(3, 23))  # 20 shared tokens: above shared_prefix_len's minimum of 16


def _rows(shared: bool) -> list[TrainRow]:
    """Uneven rows (right padding differs); with ``shared`` they start with the same 20 tokens."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, (prompt, answer) in enumerate([(3, 5), (6, 2), (2, 9), (4, 1)]):
        head = PREFIX if shared else tuple(int(x) for x in torch.randint(3, 290, (20,), generator=g))
        body = tuple(int(x) for x in torch.randint(3, 290, (prompt + answer,), generator=g))
        mask = (0,) * (len(head) + prompt) + (1,) * answer
        rows.append(TrainRow(head + body, mask, None, 1.0 if i % 2 else -0.5))
    return rows


def _reference(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward computation: full logits, log-softmax over everything, masked after."""
    logits_BTV = forward_logits(model, batch.input_ids_BT, batch.attention_mask_BT)
    mask_BT = batch.loss_mask_BT
    logprobs_BT = logprobs_from_logits(logits_BTV, batch.input_ids_BT) * mask_BT
    with torch.no_grad():
        entropy_BT = entropy_from_logits(logits_BTV) * mask_BT
    return logprobs_BT, entropy_BT


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize(
    "chunk_tokens,recompute,checkpoint",
    [(1024, False, False), (3, False, False), (4, True, False), (3, False, True)],
)
def test_masked_logprobs_match_the_full_softmax(
    tiny_llama: TinyLlama, shared: bool, lora: bool, chunk_tokens: int, recompute: bool, checkpoint: bool
) -> None:
    model = tiny_llama()
    if lora:
        model = make_trainable(model, TrainConfig(lora_r=4))
        for name, p in model.named_parameters():  # LoRA B starts at 0: give the adapter weight
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    batch = pad_batch(_rows(shared))
    P = shared_prefix_len(batch)
    assert (P > 0) == shared
    assert len(set(map(len, (r.input_ids for r in _rows(shared))))) > 1  # uneven: padding present
    weights_BT = torch.randn(batch.loss_mask_BT.shape, generator=torch.Generator().manual_seed(2))

    expected_BT, expected_ent_BT = _reference(model, batch)
    (expected_BT * weights_BT).sum().backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    got_BT, got_ent_BT = masked_logprobs(
        model, batch, P, entropy=True, chunk_tokens=chunk_tokens, recompute=recompute, checkpoint=checkpoint
    )
    assert got_ent_BT is not None
    (got_BT * weights_BT).sum().backward()
    got_grads = _grads(model)

    assert torch.allclose(got_BT, expected_BT, atol=1e-5)
    assert torch.allclose(got_ent_BT, expected_ent_BT, atol=1e-5)
    assert bool((got_BT[batch.loss_mask_BT.bool()] < 0).all())  # real values on the model tokens
    assert got_grads.keys() == expected_grads.keys() and got_grads
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-5), name


@pytest.mark.parametrize("lora", [False, True])
def test_the_fused_output_layer_under_bfloat16_autocast(tiny_llama: TinyLlama, lora: bool) -> None:
    """With ``recompute`` the output layer's log-probs and gradients come from one autograd
    function (logits computed again in its backward pass); under bfloat16 autocast it multiplies
    in bfloat16 like the plain chunked path, so both agree up to float32 summation order, for
    the hidden states and, in full fine-tuning, the (tied) output weights too."""
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = tiny_llama()
        if lora:
            model = make_trainable(model, TrainConfig(lora_r=4))
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(3))
        batch = pad_batch(_rows(True))
        weights_BT = torch.randn(batch.loss_mask_BT.shape, generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got_BT, ent_BT = masked_logprobs(
                model, batch, shared_prefix_len(batch), entropy=True, chunk_tokens=5, recompute=recompute
            )
        (got_BT * weights_BT).sum().backward()
        results.append((got_BT.detach(), ent_BT, _grads(model)))
    (plain_BT, plain_ent, plain_grads), (fused_BT, fused_ent, fused_grads) = results
    assert torch.allclose(fused_BT, plain_BT, atol=1e-4)
    assert fused_ent is not None and plain_ent is not None and torch.allclose(fused_ent, plain_ent, atol=1e-4)
    assert fused_grads.keys() == plain_grads.keys() and fused_grads
    if not lora:
        assert any("embed" in n or "lm_head" in n for n in fused_grads)
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max()) or 1.0
        assert float((fused_grads[name] - grad).abs().max()) <= 2e-2 * scale, name


@pytest.mark.parametrize("shared", [False, True])
def test_checkpointed_policy_loss_equals_the_plain_one(tiny_llama: TinyLlama, shared: bool) -> None:
    """Activation checkpointing changes memory, not results: the same GRPO loss, metrics and
    gradients (1e-5), the layers really run twice (forward, then again in the backward pass) and
    the model is left as it was."""
    model = make_trainable(tiny_llama(), TrainConfig(lora_r=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = pad_batch(_rows(shared))
    assert (shared_prefix_len(batch) > 0) == shared
    with torch.no_grad():
        batch = replace(batch, old_logprobs_BT=_reference(model, batch)[0] - 0.05)
    layer = model.get_base_model().model.layers[0]
    calls: list[int] = []
    layer.register_forward_pre_hook(lambda module, args: calls.append(1))
    mlp_calls: list[int] = []
    layer.mlp.register_forward_pre_hook(lambda module, args: mlp_calls.append(1))

    results = {}
    for checkpoint in (False, True):
        mlp_calls.clear()
        loss, metrics = PolicyLoss(checkpoint=checkpoint)(model, batch, float(batch.num_tokens))
        loss.backward()
        results[checkpoint] = (float(loss.detach()), metrics, _grads(model), len(mlp_calls))
        model.zero_grad(set_to_none=True)
    (plain_loss, plain_metrics, plain_grads, plain_runs), (loss, metrics, grads, runs) = (
        results[False],
        results[True],
    )
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    assert metrics.keys() == plain_metrics.keys()
    for name, value in plain_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5), name
    # the batch's pass runs each layer once more in the backward pass (the prefix's does not)
    assert runs == plain_runs + 1
    assert not layer.gradient_checkpointing  # restored after the pass


def test_checkpointed_layers_restores_a_model_s_own_setting(tiny_llama: TinyLlama) -> None:
    model = tiny_llama()
    layer = model.model.layers[0]
    own = print  # a setting of the model's own, whatever it is
    layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, own
    with checkpointed_layers(model) as n:
        assert n == len(model.model.layers) and layer._can_checkpoint_with_cache
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func is own
    assert not layer._can_checkpoint_with_cache
    with checkpointed_layers(model, enabled=False) as n:
        assert n == 0


def test_policy_loss_gradient_equals_the_full_softmax_loss(tiny_llama: TinyLlama) -> None:
    """The whole GRPO loss (ratio, clip, token mean) through the chunked path."""
    model = make_trainable(tiny_llama(), TrainConfig(lora_r=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = pad_batch(_rows(shared=True))
    with torch.no_grad():
        old_BT = _reference(model, batch)[0] - 0.05  # a ratio away from 1 on every token
    batch = replace(batch, old_logprobs_BT=old_BT)
    loss, metrics = PolicyLoss()(model, batch, float(batch.num_tokens))
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    new_BT, entropy_BT = _reference(model, batch)
    ratio_BT = (new_BT - old_BT).exp()
    adv_BT = batch.advantages_B[:, None]
    per_token_BT = -torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(0.8, 1.28) * adv_BT)
    expected_loss = (per_token_BT * batch.loss_mask_BT).sum() / batch.num_tokens
    expected_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(expected_loss.detach()), abs=1e-6)
    assert metrics["entropy"] == pytest.approx(float(entropy_BT.sum() / batch.num_tokens), abs=1e-5)
    for name, grad in _grads(model).items():
        assert torch.allclose(got[name], grad, atol=1e-5), name


def test_reference_and_sft_use_the_model_tokens_only(tiny_llama: TinyLlama) -> None:
    model = tiny_llama()
    batch = pad_batch(_rows(shared=False))
    with torch.no_grad():
        expected_BT, _ = _reference(model, batch)
    assert torch.allclose(reference_logprobs(model, batch), expected_BT, atol=1e-5)
    with torch.no_grad():
        loss, metrics = sft_loss(model, batch)
    assert float(loss) == pytest.approx(float(-expected_BT.sum() / batch.num_tokens), abs=1e-5)
    assert metrics["nll"] == pytest.approx(float(loss), abs=1e-5)


def test_a_batch_without_model_tokens_gives_zeros(tiny_llama: TinyLlama) -> None:
    batch = pad_batch([TrainRow((1, 2, 3), (0, 0, 0))])
    logprobs_BT, entropy_BT = masked_logprobs(tiny_llama(), batch, entropy=True)
    assert logprobs_BT.shape == (1, 3) and not logprobs_BT.any()
    assert entropy_BT is not None and not entropy_BT.any()
