"""The fused LoRA forward against peft's own: the same outputs and gradients (exactly up to
float32 rounding, within bfloat16 rounding under autocast), and peft's forward wherever the
fused one does not apply."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from agentbolt.algorithms.lora_products import fuse_lora_products, fused_layers
from agentbolt.algorithms.train_state import TrainConfig, make_trainable

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(tiny_llama, **config):
    """Two LoRA models with the same weights (the B matrices made non-zero, so the adapter
    counts), the second fused."""
    cfg = TrainConfig(**config)
    a = make_trainable(tiny_llama(seed=3), cfg)
    torch.manual_seed(7)
    for name, p in a.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    b = make_trainable(tiny_llama(seed=3), cfg)
    b.load_state_dict(a.state_dict())
    _restore_peft(a)
    fuse_lora_products(b)
    return a, b


def _restore_peft(model) -> None:
    for m in model.modules():
        if isinstance(m, LoraLinear) and "forward" in m.__dict__:
            del m.forward
            m._agentbolt_fused_forward = False


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach().float(), grads


def test_float32_same_outputs_and_gradients(tiny_llama):
    peft_model, fused = _pair(tiny_llama)
    assert fused_layers(peft_model) == 0
    assert fused_layers(fused) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    ids = torch.randint(0, 300, (3, 17))
    ref_logits, ref_grads = _loss_and_grads(peft_model, ids)
    logits, grads = _loss_and_grads(fused, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == grads.keys() and len(grads) == 28  # every A and B
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)


def test_bfloat16_autocast_within_rounding(tiny_llama):
    peft_model, fused = _pair(tiny_llama)
    ids = torch.randint(0, 300, (3, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_grads = _loss_and_grads(peft_model, ids)
        logits, grads = _loss_and_grads(fused, ids)
    # peft rounds the LoRA product, its scaling and the sum; the fused forward the sum only
    assert (logits - ref_logits).abs().max() < 0.05
    for name, g in grads.items():
        rel = (g - ref_grads[name]).norm() / ref_grads[name].norm()
        assert rel < 0.05, (name, float(rel))


def test_the_fused_forward_does_not_call_peft(tiny_llama, monkeypatch):
    _, fused = _pair(tiny_llama)

    def refuse(*_a, **_k):
        raise AssertionError("peft's forward was called")

    monkeypatch.setattr(LoraLinear, "forward", refuse)
    fused(input_ids=torch.randint(0, 300, (2, 9)))  # no AssertionError: every layer took the fused path


def test_what_it_does_not_cover_is_peft_own(tiny_llama):
    """Adapters disabled, and dropout: the fused forward hands over to peft's."""
    peft_model, fused = _pair(tiny_llama)
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad(), peft_model.disable_adapter(), fused.disable_adapter():
        assert torch.equal(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits)
    dropped_peft, dropped = _pair(tiny_llama, lora_dropout=0.1)
    dropped_peft.eval(), dropped.eval()  # dropout off in eval: peft's result is deterministic
    with torch.no_grad():
        assert torch.equal(dropped(input_ids=ids).logits, dropped_peft(input_ids=ids).logits)


def test_fusing_twice_changes_nothing(tiny_llama):
    _, fused = _pair(tiny_llama)
    assert fuse_lora_products(fused) == 14 and fused_layers(fused) == 14


def test_one_cast_serves_every_layer_that_takes_the_same_input():
    from agentbolt.algorithms.lora_products import _cast_once

    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    first = _cast_once(h, torch.bfloat16)
    assert _cast_once(h, torch.bfloat16) is first  # q, k and v: one cast
    assert first.grad_fn is not None
    h.add_(1)  # changed in place: cast afresh
    again = _cast_once(h, torch.bfloat16)
    assert again is not first and torch.equal(again, h.detach().to(torch.bfloat16))
    with torch.no_grad():
        assert _cast_once(h, torch.bfloat16) is not again  # no autograd history to share
    assert _cast_once(h * 1, torch.bfloat16) is not again  # another tensor, equal values


def test_make_trainable_fuses_every_lora_layer(tiny_llama):
    model = make_trainable(tiny_llama(), TrainConfig())
    assert fused_layers(model) == 14


def test_is_peft_knows_a_lora_model_and_training_without_lora_never_imports_peft(tiny_llama):
    import subprocess
    import sys

    from agentbolt.algorithms.lora_products import is_peft

    assert is_peft(make_trainable(tiny_llama(seed=3), TrainConfig(lora=True)))
    assert not is_peft(make_trainable(tiny_llama(seed=3), TrainConfig(lora=False)))
    assert not is_peft(torch.nn.Linear(2, 2))
    # peft takes seconds of CPU to import: a training process (or a runner child that imports
    # a module of the training stack) without LoRA must not pay it
    code = (
        "import sys, agentbolt.algorithms.grpo, agentbolt.algorithms.sft, agentbolt.algorithms.distributed; "
        "print(sorted(m for m in ('peft', 'accelerate') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
