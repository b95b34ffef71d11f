"""PackedMatmul(release_plain=...): linear weights held only in packed form give the same logits,
bit for bit, are read back exactly, and take state-dict and LoRA updates like plain weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentbolt.engine.matmul import (
    PackedMatmul,
    is_placeholder,
    packed_matmul_available,
    plain_weight,
    releasable_weights,
    sibling_projections,
)
from agentbolt.engine.weights import WeightManager

needs_packed = pytest.mark.skipif(not packed_matmul_available(), reason="no oneDNN packed linear here")


def _pair(tiny_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    released = copy.deepcopy(model)
    keep = PackedMatmul(4, fuse=sibling_projections(model))
    drop = PackedMatmul(4, fuse=sibling_projections(released), release_plain=releasable_weights(released))
    return model, released, keep, drop


def _logits(model, mode, ids):
    with torch.inference_mode(), mode:
        return model(input_ids=ids).logits


@needs_packed
def test_released_weights_give_the_same_logits_and_read_back_exactly(tiny_dir: Path) -> None:
    model, released, keep, drop = _pair(tiny_dir)
    originals = {n: p.detach().clone() for n, p in released.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    for _ in range(2):  # packing, then the packed copies alone
        assert torch.equal(_logits(released, drop, ids), _logits(model, keep, ids))
    linear = {id(w) for w in releasable_weights(released)}
    assert linear
    for name, param in released.named_parameters():
        assert is_placeholder(param) == (id(param) in linear), name
        assert torch.equal(plain_weight(param), originals[name]), name
    # the embedding table (tied or not) stays a real tensor
    assert not is_placeholder(released.get_input_embeddings().weight)
    drop.invalidate()  # no weight written: the placeholders keep their packed copies
    assert torch.equal(_logits(released, drop, ids), _logits(model, keep, ids))


@needs_packed
def test_released_weights_take_state_dict_updates(tiny_dir: Path) -> None:
    model, released, keep, drop = _pair(tiny_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    _logits(released, drop, ids)
    before = _logits(model, keep, ids)
    # a partial state dict: only some of a fused group's weights change
    state = {
        k: v * 1.5 for k, v in model.state_dict().items() if k.endswith(("q_proj.weight", "up_proj.weight"))
    }
    for m, mode in ((model, keep), (released, drop)):
        WeightManager(m).apply_state_dict(state)
        mode.invalidate()
    after = _logits(model, keep, ids)
    assert not torch.equal(after, before)
    assert torch.equal(_logits(released, drop, ids), after)
    for name, param in released.named_parameters():
        assert torch.equal(plain_weight(param), model.state_dict()[name]), name


@needs_packed
def test_released_weights_take_lora_adapters_on_the_base(tiny_dir: Path, tmp_path: Path) -> None:
    model, released, keep, drop = _pair(tiny_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    base = _logits(model, keep, ids)
    _logits(released, drop, ids)
    managers = {id(model): WeightManager(model), id(released): WeightManager(released)}
    for seed in (1, 2):  # the second adapter goes on the base, not on the first
        folder = tmp_path / f"adapter{seed}"
        folder.mkdir()
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(model.config.num_hidden_layers):
            for proj, n_out in (("v_proj", model.model.layers[layer].self_attn.v_proj.out_features),):
                key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(4, model.config.hidden_size, generator=gen)
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 4, generator=gen) * 0.1
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
        for m, mode in ((model, keep), (released, drop)):
            manager = managers[id(m)]
            manager.apply_adapter(manager.prepare_adapter(folder))
            mode.invalidate()
        expected = _logits(model, keep, ids)
        assert not torch.equal(expected, base)
        assert torch.equal(_logits(released, drop, ids), expected)
    for m, mode in ((model, keep), (released, drop)):  # a state dict restores the bases first
        managers[id(m)].apply_state_dict({"model.norm.weight": m.model.norm.weight.detach().clone()})
        mode.invalidate()
    assert torch.equal(_logits(released, drop, ids), base)
    assert torch.equal(_logits(model, keep, ids), base)


def test_a_tied_output_layer_keeps_the_embedding_table(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = {id(w) for w in releasable_weights(model)}
    assert id(model.lm_head.weight) not in ids
    assert len(ids) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1
