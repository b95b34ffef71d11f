"""GRPO's update: the trained copy of the policy (:func:`build_train_state`) and one optimizer
step of the clipped policy-gradient loss (:class:`~agentbolt.algorithms.losses.PolicyLoss`) on a
step's rows (:func:`update`), on the training device, or spread over the torchrun ranks when
there are several (:mod:`agentbolt.algorithms.distributed`).

The rows are cut into micro-batches of at most ``max_tokens_per_micro_batch`` padded tokens and
their gradients accumulated. With ``kl_coef`` each micro-batch first gets the reference
policy's log-probs, under the same autocast as the update. Memory the rollouts freed is handed
back before the pass and the pass's own after it, so neither is held through the next rollouts."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, cast

import torch

from agentbolt.algorithms import distributed
from agentbolt.algorithms.batch import Batch, TrainRow, micro_batches, pad_batch, to_device
from agentbolt.algorithms.grpo_config import GRPOConfig
from agentbolt.algorithms.losses import LossFn, PolicyLoss, reference_logprobs
from agentbolt.algorithms.train_state import (
    TrainConfig,
    TrainState,
    fast_bf16,
    frozen_base_to,
    frozen_embeddings_to,
    make_train_state,
    optimizer_step,
)
from agentbolt.memory import large_blocks_mapped, release_free_memory

__all__ = ["build_train_state", "trains_in_bf16", "training_device", "update"]


def training_device(config: GRPOConfig) -> torch.device:
    """Where training runs: the GPU when there is one (the engine picks its device the same way)."""
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def trains_in_bf16(config: GRPOConfig) -> bool:
    """``bf16``, resolved: None means where bfloat16 is native on the training device."""
    return fast_bf16(training_device(config)) if config.bf16 is None else config.bf16


def build_train_state(config: GRPOConfig, base_model_path: str) -> TrainState:
    """The trained copy of the policy, on the training device, made trainable as ``config``
    says; full fine-tuning with KL keeps a frozen copy of the initial weights beside it."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)
    train = TrainConfig(lora=config.lora, lora_r=config.lora_r, lora_alpha=2 * config.lora_r, lr=config.lr)
    state = make_train_state(model.to(training_device(config)), train, reference=bool(config.kl_coef))
    if trains_in_bf16(config) and not distributed.leading():
        # the update runs under bfloat16 autocast, which casts every frozen projection to
        # bfloat16 anyway: stored so, the same results at half their memory
        frozen_base_to(state.model, torch.bfloat16)
        frozen_embeddings_to(state.model, torch.bfloat16)  # lookups widened back to float32
    return state


def update(
    config: GRPOConfig, state: TrainState, rows: list[TrainRow], proximal: bool = False
) -> dict[str, float]:
    """One optimizer step on ``rows``; its metrics, with ``num_tokens`` 0 when there was nothing
    to train on. ``proximal`` (asynchronous mode): the ratio against the current policy, the
    recorded logprobs corrected for by truncated importance weights; ``rows_without_logprobs``
    counts the rows that had none (trained with weight 1, the others corrected)."""
    if not rows:
        return {"num_tokens": 0.0}
    missing = {"rows_without_logprobs": float(sum(r.old_logprobs is None for r in rows))}
    if distributed.leading():
        return {**_update_distributed(config, state, rows, proximal), **missing}
    return {**_update_here(config, state, rows, proximal), **missing}


def _policy_loss(config: GRPOConfig, proximal: bool, checkpoint: bool = False) -> PolicyLoss:
    # checkpointed, the output layer's chunk is what peaks: smaller chunks, the same values
    chunk_tokens = 256 if checkpoint else 1024
    asynchronous: dict[str, Any] = {}
    if proximal:
        asynchronous = {
            "proximal": True,
            "importance": config.importance,
            "importance_cap": config.importance_cap,
        }
    return PolicyLoss(
        config.clip_low,
        config.clip_high,
        config.kl_coef,
        checkpoint=checkpoint,
        chunk_tokens=chunk_tokens,
        **asynchronous,
    )


def _micro_batches(config: GRPOConfig, rows: list[TrainRow]) -> list[Batch]:
    return [pad_batch(mb) for mb in micro_batches(rows, max_tokens=config.max_tokens_per_micro_batch)]


def _update_here(
    config: GRPOConfig, state: TrainState, rows: list[TrainRow], proximal: bool
) -> dict[str, float]:
    """The update on this process's training device."""
    device = training_device(config)
    batches = [to_device(b, device) for b in _micro_batches(config, rows)]
    policy_loss = _policy_loss(config, proximal, checkpoint=config.checkpointing)
    seen: list[dict[str, float]] = []

    def loss(
        model: torch.nn.Module, batch: Batch, num_tokens: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        value, metrics = policy_loss(model, batch, num_tokens)
        seen.append(metrics)
        return value, metrics

    bf16 = trains_in_bf16(config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    release_free_memory()  # what the rollouts freed into the heap, before the pass adds its own
    # low_memory: the pass's large blocks given back when freed, not kept as heap holes
    mapped = large_blocks_mapped() if config.low_memory else contextlib.nullcontext()
    with autocast, mapped:
        if config.kl_coef:  # under the same autocast as the update: KL is 0 before the first one
            batches = [_with_reference(state, b) for b in batches]
        out = optimizer_step(state, batches, cast(LossFn, loss))
    del batches
    release_free_memory()  # the pass's activations, not held through the next rollouts
    return {**out, **_weight_extremes(seen)}


def _with_reference(state: TrainState, batch: Batch) -> Batch:
    return replace(batch, ref_logprobs_BT=reference_logprobs(state.reference_model, batch))


def _weight_extremes(seen: list[dict[str, float]]) -> dict[str, float]:
    """The step averages metrics over micro-batches by tokens: the importance weights' extremes
    are taken over them instead."""
    out = {}
    for name, pick in (("is_weight_min", min), ("is_weight_max", max)):
        values = [m[name] for m in seen if name in m]
        if values:
            out[name] = pick(values)
    return out


def _update_distributed(
    config: GRPOConfig, state: TrainState, rows: list[TrainRow], proximal: bool
) -> dict[str, float]:
    """The update spread over the torchrun ranks: the micro-batches go to the ranks by token
    count, each computes its reference log-probs (KL) and gradients, the gradients are summed
    (:func:`agentbolt.algorithms.distributed.update`). Not checkpointed across ranks (untested
    under FSDP2's hooks)."""
    batches = _micro_batches(config, rows)
    policy_loss = _policy_loss(config, proximal)
    bf16, reference = trains_in_bf16(config), bool(config.kl_coef)
    out = distributed.update(state, batches, policy_loss, bf16=bf16, reference=reference)
    del batches
    release_free_memory()
    return out
