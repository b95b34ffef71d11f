from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from agentbolt.algorithms.losses import (
    PolicyLoss,
    TrainRow,
    forward_logits,
    logprobs_from_logits,
    pad_batch,
    reference_logprobs,
    sft_loss,
)
from agentbolt.algorithms.train_state import (
    TrainConfig,
    TrainState,
    export_weights,
    load_adapter,
    load_checkpoint,
    make_train_state,
    merge_lora,
    merged_state_dict,
    optimizer_step,
    save_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TinyLlama = Callable[..., LlamaForCausalLM]


def sft_rows() -> list[TrainRow]:
    return [TrainRow((1 + i, 2, 3, 10 + i, 20 + i, 30 + i), (0, 0, 0, 1, 1, 1)) for i in range(4)]


# ---------------------------------------------------------------------------- the optimizer step


def test_gradient_accumulation_equals_one_batch(tiny_llama: TinyLlama) -> None:
    rows = [TrainRow((1, 2, 3, 4), (0, 1, 1, 1), None, 1.0), TrainRow((1, 2), (0, 1), None, -0.5)]
    one = make_train_state(tiny_llama(), TrainConfig(lora=False))
    split = make_train_state(tiny_llama(), TrainConfig(lora=False))
    for loss_fn in (sft_loss, PolicyLoss(kl_coef=0.0)):
        whole = optimizer_step(one, [pad_batch(rows)], loss_fn)
        parts = optimizer_step(split, [pad_batch([r]) for r in rows], loss_fn)
        assert whole["loss"] == pytest.approx(parts["loss"], abs=1e-5)
        for a, b in zip(one.model.parameters(), split.model.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.allclose(a.grad, b.grad, atol=1e-6)


# ---------------------------------------------------------------------------- checkpoints and export


@pytest.fixture
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _fresh_state(tiny_llama: TinyLlama) -> TrainState:
    model = tiny_llama(seed=0)
    torch.manual_seed(1)
    return make_train_state(model, TrainConfig(lr=1e-2, lora_dropout=0.1))  # dropout uses the RNG


def _train(state: TrainState, steps: int) -> None:
    for _ in range(steps):
        optimizer_step(state, [pad_batch(sft_rows())], sft_loss)


def test_resume_gives_the_same_next_step(tmp_path: Path, deterministic: None, tiny_llama: TinyLlama) -> None:
    straight = _fresh_state(tiny_llama)
    _train(straight, 3)

    interrupted = _fresh_state(tiny_llama)
    _train(interrupted, 2)
    save_checkpoint(
        tmp_path / "ckpt", interrupted.model, interrupted.optimizer, interrupted.step, extra={"k": 1}
    )
    torch.manual_seed(99)  # whatever happens in between
    resumed = _fresh_state(tiny_llama)
    checkpoint = load_checkpoint(tmp_path / "ckpt", resumed.model, resumed.optimizer)
    resumed.step = checkpoint.step
    _train(resumed, 1)

    assert (checkpoint.step, checkpoint.extra, resumed.step) == (2, {"k": 1}, 3)
    pairs = zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


def test_export_and_merged_weights(tmp_path: Path, tiny_llama: TinyLlama) -> None:
    state = make_train_state(tiny_llama(), TrainConfig(lr=1e-2))
    _train(state, 2)  # LoRA B starts at zero: train so the merge matters
    assert export_weights(state.model, tmp_path / "lora") == "lora"
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()

    merged = tiny_llama(seed=5)
    merged.load_state_dict(merged_state_dict(state.model))
    ids_BT, mask_BT = torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long)
    state.model.eval()
    with torch.no_grad():
        expected = forward_logits(state.model, ids_BT, mask_BT)
        assert torch.allclose(forward_logits(merged.eval(), ids_BT, mask_BT), expected, atol=1e-4)
        base = logprobs_from_logits(forward_logits(tiny_llama(), ids_BT, mask_BT), ids_BT)
        reference = reference_logprobs(state.model, pad_batch([TrainRow((1, 2, 3, 4), (0, 1, 1, 1))]))
    assert torch.allclose(reference, base, atol=1e-5)  # adapter disabled = the base model

    assert export_weights(merged, tmp_path / "full") == "full"
    assert (tmp_path / "full" / "model.safetensors").exists()


def test_merge_lora_merges_a_copy_unless_in_place(tmp_path: Path, tiny_llama: TinyLlama) -> None:
    state = make_train_state(tiny_llama(), TrainConfig(lr=1e-2))
    _train(state, 2)
    merged = merge_lora(state.model)
    assert isinstance(state.model, PeftModel) and not isinstance(merged, PeftModel)
    plain = tiny_llama()
    assert merge_lora(plain) is plain  # nothing to merge

    # an adapter saved, loaded onto a fresh base and merged in place gives the same weights
    export_weights(state.model, tmp_path / "lora")
    loaded = merge_lora(load_adapter(tiny_llama(), tmp_path / "lora"), in_place=True)
    expected, got = merged.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.allclose(expected[name], got[name], atol=1e-6), name


# ---------------------------------------------------------------------------- KL to the initial weights


def _kl_after_updates(state: TrainState, updates: int) -> list[float]:
    """The KL reported by each of ``updates`` policy-gradient steps on one fixed batch."""
    rows = [
        TrainRow((1, 2, 3, 4 + i, 5 + i), (0, 0, 1, 1, 1), None, 1.0 if i % 2 else -1.0) for i in range(4)
    ]
    kls = []
    for _ in range(updates):
        batch = pad_batch(rows)
        batch = replace(batch, ref_logprobs_BT=reference_logprobs(state.reference_model, batch))
        kls.append(optimizer_step(state, [batch], PolicyLoss(kl_coef=0.1))["kl"])
    return kls


@pytest.mark.parametrize("lora", [False, True])
def test_kl_is_measured_against_the_initial_weights(tiny_llama: TinyLlama, lora: bool) -> None:
    state = make_train_state(tiny_llama(), TrainConfig(lora=lora, lr=1e-2), reference=True)
    if lora:
        assert state.reference is None and state.reference_model is state.model  # adapter disabled
    else:
        assert state.reference is not None and state.reference is not state.model
        assert not any(p.requires_grad for p in state.reference.parameters())
    kls = _kl_after_updates(state, 4)
    assert kls[0] == pytest.approx(0.0, abs=1e-7)  # nothing trained yet: the policy is the reference
    assert kls[-1] > 1e-4  # the trained policy drifted from the frozen one
    if not lora:  # the frozen copy did not move with the trained model
        initial = tiny_llama()
        for a, b in zip(state.reference.parameters(), initial.parameters(), strict=True):
            assert torch.equal(a, b)


def test_full_fine_tuning_without_a_reference_refuses_kl(tiny_llama: TinyLlama) -> None:
    state = make_train_state(tiny_llama(), TrainConfig(lora=False))
    with pytest.raises(ValueError, match="reference"):
        _ = state.reference_model


def test_trained_weights_are_the_merged_adapted_layers(tiny_llama: TinyLlama) -> None:
    from agentbolt.algorithms.train_state import trained_weights

    state = make_train_state(tiny_llama(), TrainConfig(lr=1e-2))
    _train(state, 2)
    changed, full = trained_weights(state.model), merged_state_dict(state.model)
    assert changed is not None and set(changed) < set(full)
    assert "model.embed_tokens.weight" in full and "model.embed_tokens.weight" not in changed
    for name, tensor in changed.items():
        assert torch.allclose(tensor, full[name], atol=1e-6), name
    # what is not sent is the base: a copy of the base with only these loaded is the merged model
    served = tiny_llama()
    served.load_state_dict(changed, strict=False)
    for name, tensor in served.state_dict().items():
        assert torch.allclose(tensor, full[name], atol=1e-6), name
    assert any(not torch.allclose(changed[n], tiny_llama().state_dict()[n]) for n in changed)  # it trained

    assert trained_weights(tiny_llama()) is None  # no adapter: everything may have changed
    # anything trainable besides the adapter: send everything
    next(p for n, p in state.model.named_parameters() if "embed_tokens" in n).requires_grad_(True)
    assert trained_weights(state.model) is None


def test_an_engine_synced_with_only_the_trained_weights_serves_the_merged_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentbolt.algorithms.policy import EnginePolicy
    from agentbolt.engine import ModelEngine, tiny_model_dir

    path = str(tiny_model_dir(tmp_path))
    engine = ModelEngine.from_pretrained(path, dtype="float32")
    try:
        state = make_train_state(AutoModelForCausalLM.from_pretrained(path), TrainConfig(lr=1e-2))
        _train(state, 2)
        sent: list[Any] = []
        update = engine.update_weights
        engine.update_weights = lambda **kw: sent.append(kw) or update(**kw)  # type: ignore[method-assign]
        EnginePolicy(engine, "http://127.0.0.1:9/v1", path).sync(state.model, 1)
        assert (
            len(sent) == 1 and "model.embed_tokens.weight" not in sent[0]["state_dict"]
        )  # only the adapted layers
        served = engine.model.state_dict()
        for name, tensor in merged_state_dict(state.model).items():
            assert torch.allclose(served[name].float(), tensor.float(), atol=1e-6), name
    finally:
        engine.close()
