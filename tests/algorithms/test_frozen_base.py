"""The frozen LoRA base stored in bfloat16 when training under bfloat16 autocast
(train_state.frozen_base_to): half the memory of its projections, the same update."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from agentbolt.algorithms.losses import PolicyLoss, TrainRow, pad_batch
from agentbolt.algorithms.train_state import (
    TrainConfig,
    frozen_base_to,
    frozen_embeddings_to,
    make_train_state,
    trained_weights,
)

TinyLlama = Callable[..., LlamaForCausalLM]


def _state(tiny_llama: TinyLlama):  # type: ignore[no-untyped-def]
    state = make_train_state(tiny_llama(), TrainConfig(lora_r=4, lr=1e-2))
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return state


def _rows() -> list[TrainRow]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, n in enumerate((9, 14, 6)):
        ids = tuple(int(t) for t in torch.randint(3, 300, (5 + n,), generator=g))
        mask = (0,) * 5 + (1,) * n
        rows.append(TrainRow(ids, mask, tuple([-2.0] * len(ids)), advantage=(-1.0, 0.5, 1.0)[i]))
    return rows


def _update_under_autocast(state) -> tuple[float, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    batch = pad_batch(_rows())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = PolicyLoss()(state.model, batch, float(batch.num_tokens))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in state.model.named_parameters() if p.grad is not None}
    state.model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_a_bf16_frozen_base_gives_the_same_update_at_half_the_memory(
    tiny_llama: TinyLlama, one_thread: None
) -> None:
    state = _state(tiny_llama)
    loss, grads = _update_under_autocast(state)

    spared = frozen_base_to(state.model, torch.bfloat16)
    base_bytes = sum(
        m.get_base_layer().weight.numel() * 2
        for m in state.model.modules()
        if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")
    )
    assert spared == base_bytes > 0  # 4 bytes -> 2 for every adapted projection
    for name, p in state.model.named_parameters():
        if p.requires_grad:  # the adapter trains in float32
            assert p.dtype == torch.float32, name
        elif "embed_tokens" in name or "norm" in name or "lm_head" in name:  # not adapted
            assert p.dtype == torch.float32, name
        else:
            assert p.dtype == torch.bfloat16, name

    # autocast computed the projections in bfloat16 before: loss and gradients are the same
    loss_bf16, grads_bf16 = _update_under_autocast(state)
    assert loss_bf16 == loss
    assert grads_bf16.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, grads_bf16[name]), name

    assert frozen_base_to(state.model, torch.bfloat16) == 0  # already so
    assert frozen_base_to(tiny_llama(), torch.bfloat16) == 0  # no adapter: left as it is


def test_the_weights_sent_from_a_bf16_base_are_merged_in_float32(tiny_llama: TinyLlama) -> None:
    state = _state(tiny_llama)
    wide = trained_weights(state.model)
    frozen_base_to(state.model, torch.bfloat16)
    narrow = trained_weights(state.model)
    assert wide is not None and narrow is not None and wide.keys() == narrow.keys()
    for name, tensor in narrow.items():
        assert tensor.dtype == torch.bfloat16, name
        # the base rounded to bfloat16, plus the float32 delta, rounded once
        base = state.model.get_base_model().get_parameter(name)
        delta = wide[name] - tiny_llama().state_dict()[name]
        assert torch.equal(tensor, (base.float() + delta).to(torch.bfloat16)), name


def test_bf16_frozen_embeddings_keep_float32_hidden_states(one_thread: None, tiny_llama: TinyLlama) -> None:
    """The tied embeddings stored in bfloat16: half their memory, the layers still get float32
    hidden states (the lookups widened back), the update differs only by the embeddings' rounding."""
    state = make_train_state(tiny_llama(tied=True), TrainConfig(lora_r=4, lr=1e-2))
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    frozen_base_to(state.model, torch.bfloat16)
    loss, grads = _update_under_autocast(state)
    embeddings = state.model.get_input_embeddings()
    wide = embeddings.weight.detach().clone()

    spared = frozen_embeddings_to(state.model, torch.bfloat16)
    assert spared == wide.numel() * 2 > 0
    assert embeddings.weight.dtype == torch.bfloat16
    assert state.model.get_output_embeddings().weight is embeddings.weight  # still tied
    assert torch.equal(embeddings.weight.float(), wide.to(torch.bfloat16).float())
    seen: list[torch.dtype] = []
    layer = state.model.get_base_model().model.layers[0]
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    loss_bf16, grads_bf16 = _update_under_autocast(state)
    hook.remove()
    assert seen == [torch.float32]  # the residual stream stays float32
    assert abs(loss_bf16 - loss) < 0.02 * max(1.0, abs(loss))
    assert grads_bf16.keys() == grads.keys() and len(grads) > 0
    for name, grad in grads.items():  # the same direction, up to the embeddings' rounding
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), grads_bf16[name].flatten(), dim=0)
        assert cos > 0.99, name
    assert frozen_embeddings_to(state.model, torch.bfloat16) == 0  # already so
    assert frozen_embeddings_to(tiny_llama(tied=True), torch.bfloat16) == 0  # no adapter: left as it is
