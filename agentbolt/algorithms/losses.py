"""The loss side of GRPO and SFT: advantages, log-probs and losses. Small functions over
batches and tensors; no store access, no optimizer (that is :mod:`agentbolt.algorithms.train_state`).
The rows and padded batches they read are :mod:`agentbolt.algorithms.batch` (re-exported here,
where the training code has always found them).

Shapes are in the names: ``B`` batch, ``T`` tokens, ``V`` vocabulary, ``G`` group.
``logprobs_BT[b, t]`` is ``log p(input_ids[b, t] | input_ids[b, :t])``; position 0 has no
prefix and holds 0. ``loss_mask_BT`` is aligned the same way (1 on model-generated tokens), so
recorded gateway logprobs, recomputed logprobs and masks line up without shifting.

Where this departs from the papers:

- GRPO (Shao et al. 2024) averages per sequence, then over the group. We use DAPO's token-level
  mean (Yu et al. 2025): the loss is summed over every model token of the whole batch and divided
  by their count, so long answers are not down-weighted; with gradient accumulation the count is
  that of all micro-batches together. DAPO's asymmetric clip (``clip_high`` 0.28) is the default;
  pass 0.2 for the symmetric PPO clip.
- The advantage std is the population std (``correction=0``); ``normalize_std=False`` gives the
  Dr. GRPO variant. Which tokens get which advantage (per rollout, per turn, GiGPO) is
  :mod:`agentbolt.algorithms.credit`; groups without a spread are skipped there.
- The KL penalty is optional (off by default, as in DAPO); when on it is the k3 estimator
  ``exp(ref - new) - (ref - new) - 1`` of GRPO, added per token.
- An advantage is per sequence (``advantages_B``) or per token (``advantages_BT``, per-turn
  credit); the surrogate is the same, only the factor on each token's ratio differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from agentbolt.algorithms.batch import Batch, TrainRow, micro_batches, pad_batch
from agentbolt.algorithms.importance import ImportanceMode, importance_weights
from agentbolt.algorithms.lora_products import is_peft

__all__ = [
    "Batch",
    "LossFn",
    "PolicyLoss",
    "TrainRow",
    "checkpointed_layers",
    "clipped_policy_loss",
    "entropy_from_logits",
    "forward_logits",
    "group_advantages",
    "logprobs_from_logits",
    "logprobs_from_suffix",
    "masked_logprobs",
    "micro_batches",
    "pad_batch",
    "reference_logprobs",
    "sft_loss",
    "shared_prefix_len",
    "suffix_logits",
    "token_logprobs",
]


# ---------------------------------------------------------------------------- advantages


def group_advantages(rewards_G: Tensor, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """``(r - mean) / (std + eps)`` over one group (or just ``r - mean``)."""
    advantages_G = rewards_G - rewards_G.mean()
    return advantages_G / (rewards_G.std(correction=0) + eps) if normalize_std else advantages_G


# ---------------------------------------------------------------------------- log-probs


def forward_logits(model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor) -> Tensor:
    return model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False).logits


def logprobs_from_logits(logits_BTV: Tensor, input_ids_BT: Tensor) -> Tensor:
    """``logprobs_BT[:, t] = log softmax(logits[:, t-1])[input_ids[:, t]]``; column 0 is 0."""
    logits_BTV = logits_BTV[:, :-1].float()
    picked_BT = logits_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    logprobs_BT = picked_BT - torch.logsumexp(logits_BTV, dim=-1)
    return torch.nn.functional.pad(logprobs_BT, (1, 0))


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the distribution each token was drawn from, aligned like the logprobs."""
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return torch.nn.functional.pad(entropy_BT, (1, 0))


def shared_prefix_len(batch: Batch, min_len: int = 16) -> int:
    """Length P of the prefix every row shares, trimmed so that no trained token sits at or
    before P (its log-prob needs the logits at P or later); 0 when shorter than ``min_len``
    or the batch has one row."""
    ids_BT, B = batch.input_ids_BT, batch.input_ids_BT.shape[0]
    if B < 2:
        return 0
    same_T = (ids_BT == ids_BT[:1]).all(0) & batch.attention_mask_BT.bool().all(0)
    differs = (~same_T).nonzero()
    P = int(differs[0]) if len(differs) else ids_BT.shape[1]
    trained = batch.loss_mask_BT.bool().any(0).nonzero()
    if len(trained):
        P = min(P, int(trained[0]) - 1)
    P = min(P, ids_BT.shape[1] - 1)
    return P if P >= min_len else 0


def suffix_logits(model: nn.Module, batch: Batch, prefix_len: int) -> Tensor:
    """Logits at positions ``prefix_len..T-1`` ([B, T - P, V]), the shared prefix computed once.

    The prefix runs as one row and its key/value cache is expanded (a view) to the batch, so
    gradients from every row flow back through the single prefix pass: exact, not an
    approximation, at a fraction of the cost when prompts share a long system prompt."""
    ids_BT, mask_BT = batch.input_ids_BT, batch.attention_mask_BT
    if prefix_len == 0:
        return forward_logits(model, ids_BT, mask_BT)
    B = ids_BT.shape[0]
    out = model(input_ids=ids_BT[:1, :prefix_len], use_cache=True)
    cache = out["cache"]
    for layer in cache.layers:
        layer.keys = layer.keys.expand(B, *layer.keys.shape[1:])
        layer.values = layer.values.expand(B, *layer.values.shape[1:])
    return model(input_ids=ids_BT[:, prefix_len:], attention_mask=mask_BT, cache=cache, use_cache=True).logits


def logprobs_from_suffix(logits_BSV: Tensor, input_ids_BT: Tensor, prefix_len: int) -> Tensor:
    """Like :func:`logprobs_from_logits` for suffix logits; positions up to ``prefix_len`` are 0."""
    return torch.nn.functional.pad(
        logprobs_from_logits(logits_BSV, input_ids_BT[:, prefix_len:])[:, 1:], (prefix_len + 1, 0)
    )


def token_logprobs(model: nn.Module, input_ids_BT: Tensor, attention_mask_BT: Tensor) -> Tensor:
    return logprobs_from_logits(forward_logits(model, input_ids_BT, attention_mask_BT), input_ids_BT)


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The transformer body (returning final hidden states) and the output layer of a Hugging
    Face causal LM (PEFT-wrapped or not); None when the logits are more than ``head(hidden)``
    (soft-capping, scaling) or the model is not built that way."""
    base = model.get_base_model() if is_peft(model) else model
    get_decoder = getattr(base, "get_decoder", None)
    get_head = getattr(base, "get_output_embeddings", None)
    config = getattr(base, "config", None)
    if get_decoder is None or get_head is None or config is None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    try:
        decoder, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def _read_only(cache: Any, batch_size: int) -> None:
    """The prefix cache expanded (a view) to ``batch_size`` rows and made read-only: each layer's
    ``update`` returns the prefix's keys and values followed by the new ones without storing them.
    The pass that reads it is then a pure function of its inputs, so a checkpointed layer
    recomputed in the backward pass sees the same prefix, not the prefix plus its first pass."""
    for layer in cache.layers:
        keys = layer.keys.expand(batch_size, *layer.keys.shape[1:])
        values = layer.values.expand(batch_size, *layer.values.shape[1:])
        layer.keys, layer.values = keys, values

        def update(
            key_states: Tensor,
            value_states: Tensor,
            *args: Any,
            _k: Tensor = keys,
            _v: Tensor = values,
            **kwargs: Any,
        ) -> tuple[Tensor, Tensor]:
            return torch.cat([_k, key_states], dim=-2), torch.cat([_v, value_states], dim=-2)

        layer.update = update


_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func", "_can_checkpoint_with_cache")


@contextmanager
def checkpointed_layers(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Activation checkpointing of the decoder layers while the block runs (yields how many).

    Each layer keeps only its input for the backward pass and runs its forward again there
    (``torch.utils.checkpoint``, non-reentrant): a pass holds one layer's activations instead of
    all of them, for about one more forward. The layers may read a key/value cache (the shared
    prefix of :func:`masked_logprobs`, made read-only there); one that writes into a cache must
    not run inside this block with gradients on. Layers are Hugging Face's
    ``GradientCheckpointingLayer`` (a model with none runs unchanged); their own setting is restored
    on exit."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - an older transformers
        GradientCheckpointingLayer = ()  # type: ignore[assignment,misc]  # noqa: N806
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)] if enabled else []
    saved = [{a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__} for m in layers]
    for m in layers:
        m.gradient_checkpointing = True
        m._gradient_checkpointing_func = partial(  # type: ignore[assignment]
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
        m._can_checkpoint_with_cache = True
    try:
        yield len(layers)
    finally:
        for m, before in zip(layers, saved, strict=True):
            for a in _CHECKPOINT_ATTRS:
                m.__dict__.pop(a, None)
            m.__dict__.update(before)


def _hidden_states(decoder: nn.Module, batch: Batch, prefix_len: int, checkpoint: bool = False) -> Tensor:
    """Final hidden states at positions ``prefix_len..T-1`` ([B, T - P, H]); the shared prefix
    runs once, its cache expanded to the batch as in :func:`suffix_logits` (read-only).
    ``checkpoint``: the decoder layers of the batch's pass are checkpointed
    (:func:`checkpointed_layers`); the prefix's one-row pass keeps its activations."""
    ids_BT, mask_BT = batch.input_ids_BT, batch.attention_mask_BT
    if prefix_len == 0:
        with checkpointed_layers(decoder, checkpoint):
            return decoder(input_ids=ids_BT, attention_mask=mask_BT, use_cache=False).last_hidden_state
    B = ids_BT.shape[0]
    cache = decoder(input_ids=ids_BT[:1, :prefix_len], use_cache=True)["cache"]
    _read_only(cache, B)
    with checkpointed_layers(decoder, checkpoint):
        # the layers read the cache whenever it is given; use_cache=True would only be turned off
        # (with a warning) by a checkpointed layer
        suffix_ids = ids_BT[:, prefix_len:]
        out = decoder(input_ids=suffix_ids, attention_mask=mask_BT, cache=cache, use_cache=not checkpoint)
    return out.last_hidden_state


def _head_chunk(head: nn.Module, hidden_NH: Tensor, targets_N: Tensor) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and the entropy (no gradient) of its distribution, for one chunk."""
    logits_NV = head(hidden_NH).float()
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    logprobs_N = logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
    with torch.no_grad():
        probs_NV = torch.exp(logits_NV.detach() - lse_N.detach()[:, None])
        entropy_N = lse_N.detach() - (probs_NV * logits_NV.detach()).sum(-1)
    return logprobs_N, entropy_N


def _head_logits(hidden_NH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``head(hidden)`` computed in ``dtype`` (what autocast multiplies in), as float32."""
    bias = None if bias_V is None else bias_V.to(dtype)
    return F.linear(hidden_NH.to(dtype), weight_VH.to(dtype), bias).float()


class _HeadLogprobs(torch.autograd.Function):
    """Log-prob of each target under ``linear(hidden)`` and the entropy (no gradient) of its
    distribution, ``chunk`` tokens at a time, keeping only the hidden states and each token's
    log-normalizer for the backward pass, which computes the logits once more.

    The same values and gradients as :func:`_head_chunk` under ``torch.utils.checkpoint`` (which
    :func:`masked_logprobs` used for this before), with less work around the products: that path
    ran the whole chunk twice, entropy included, then took the log-softmax's and the gather's
    gradients as separate vocabulary-wide passes (a scatter into zeros among them); here the
    backward pass is one exponential, one scaled subtraction at the targets and the product."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        targets_N: Tensor,
        chunk: int,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        N = hidden_NH.shape[0]
        logprobs_N = hidden_NH.new_empty(N, dtype=torch.float32)
        entropy_N, lse_N = torch.empty_like(logprobs_N), torch.empty_like(logprobs_N)
        for start in range(0, N, chunk):
            end = min(start + chunk, N)
            logp_CV = _head_logits(hidden_NH[start:end], weight_VH, bias_V, dtype)
            lse_C = torch.logsumexp(logp_CV, dim=-1)
            logp_CV.sub_(lse_C[:, None])
            logprobs_N[start:end] = logp_CV.gather(-1, targets_N[start:end, None]).squeeze(-1)
            entropy_N[start:end] = -(logp_CV.exp() * logp_CV).sum(-1)
            lse_N[start:end] = lse_C
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, lse_N)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx: Any, grad_N: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden_NH, weight_VH, bias_V, targets_N, lse_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        weight = weight_VH.to(ctx.dtype)
        for start in range(0, hidden_NH.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden_NH.shape[0])
            h_CH, g_C1 = hidden_NH[start:end], grad_N[start:end, None]
            # d logprob[target] / d logits = onehot(target) - softmax: the softmax computed in place
            grad_CV = _head_logits(h_CH, weight_VH, bias_V, ctx.dtype).sub_(lse_N[start:end, None]).exp_()
            grad_CV.mul_(-g_C1).scatter_add_(1, targets_N[start:end, None], g_C1)
            grad_CV = grad_CV.to(ctx.dtype)
            if grad_h is not None:
                grad_h[start:end] = grad_CV.mm(weight).to(grad_h.dtype)
            if grad_w is not None:
                grad_w += grad_CV.t().mm(h_CH.to(ctx.dtype)).float()
            if grad_b is not None:
                grad_b += grad_CV.float().sum(0)
        return grad_h, _cast_like(grad_w, weight_VH), _cast_like(grad_b, bias_V), None, None, None


def _cast_like(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)


def masked_logprobs(
    model: nn.Module,
    batch: Batch,
    prefix_len: int = 0,
    *,
    entropy: bool = False,
    chunk_tokens: int = 1024,
    recompute: bool = False,
    checkpoint: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs_BT, entropy_BT)`` at the model tokens only (``loss_mask``), 0 elsewhere.

    The same values and gradients as :func:`token_logprobs` / :func:`entropy_from_logits` on
    those positions, without the B x T x V logits: the body's hidden states are gathered at the
    positions that predict a model token and the output layer, log-softmax and entropy run over
    ``chunk_tokens`` of them at a time. ``recompute`` keeps only the hidden states of each chunk
    for the backward pass (its logits are computed again there): less memory, one more pass of
    the output layer. ``checkpoint``: activation checkpointing of the decoder layers too
    (:func:`checkpointed_layers`; implies ``recompute``): the pass keeps per token little more
    than each layer's input, for about one more forward of the body. ``prefix_len`` as in
    :func:`suffix_logits`. Models whose logits are not ``head(hidden)`` take the full-logits
    path, with the same result (without checkpointing)."""
    ids_BT, mask_BT = batch.input_ids_BT, batch.loss_mask_BT
    B, T = ids_BT.shape
    parts = _decoder_and_head(model)
    if parts is None:
        logits_BSV = suffix_logits(model, batch, prefix_len)
        if prefix_len:
            full_BT = logprobs_from_suffix(logits_BSV, ids_BT, prefix_len)
        else:
            full_BT = logprobs_from_logits(logits_BSV, ids_BT)
        ent_BT = None
        if entropy:
            with torch.no_grad():
                ent_BT = torch.nn.functional.pad(entropy_from_logits(logits_BSV)[:, 1:], (prefix_len + 1, 0))
        keep_BT = mask_BT.bool()
        return full_BT.masked_fill(~keep_BT, 0.0), None if ent_BT is None else ent_BT.masked_fill(
            ~keep_BT, 0.0
        )
    decoder, head = parts
    recompute = recompute or checkpoint
    hidden_BSH = _hidden_states(decoder, batch, prefix_len, checkpoint and torch.is_grad_enabled())
    rows_N, cols_N = mask_BT[:, 1:].nonzero(as_tuple=True)  # target t = cols + 1, predicted at cols
    if (cols_N < prefix_len).any():
        raise ValueError(f"a model token lies inside the shared prefix (prefix_len={prefix_len})")
    hidden_NH = hidden_BSH[rows_N, cols_N - prefix_len]
    targets_N = ids_BT[rows_N, cols_N + 1]
    if recompute and torch.is_grad_enabled() and type(head) is nn.Linear:
        device = hidden_NH.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_NH.dtype
        logprobs_N, entropy_N = _HeadLogprobs.apply(
            hidden_NH, head.weight, head.bias, targets_N, chunk_tokens, dtype
        )
        return _scatter_rows(logprobs_N, entropy_N if entropy else None, rows_N, cols_N, B, T)
    logps, ents = [], []
    for start in range(0, len(targets_N), chunk_tokens):
        h, y = hidden_NH[start : start + chunk_tokens], targets_N[start : start + chunk_tokens]
        if recompute and torch.is_grad_enabled():
            lp, ent = torch.utils.checkpoint.checkpoint(_head_chunk, head, h, y, use_reentrant=False)
        else:
            lp, ent = _head_chunk(head, h, y)
        logps.append(lp)
        ents.append(ent)
    logprobs_N = torch.cat(logps) if logps else hidden_BSH.new_zeros(0, dtype=torch.float32)
    entropy_N = (torch.cat(ents) if ents else logprobs_N.detach()) if entropy else None
    return _scatter_rows(logprobs_N, entropy_N, rows_N, cols_N, B, T)


def _scatter_rows(
    logprobs_N: Tensor, entropy_N: Tensor | None, rows_N: Tensor, cols_N: Tensor, B: int, T: int
) -> tuple[Tensor, Tensor | None]:
    """The per-target values back at their ``[B, T]`` positions (target t = cols + 1), 0 elsewhere."""
    index = (rows_N, cols_N + 1)
    logprobs_BT = logprobs_N.new_zeros(B, T).index_put(index, logprobs_N)
    entropy_BT = None if entropy_N is None else entropy_N.new_zeros(B, T).index_put(index, entropy_N.detach())
    return logprobs_BT, entropy_BT


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def reference_logprobs(model: nn.Module, batch: Batch) -> Tensor:
    """Logprobs of the reference policy: a PEFT model with its adapter disabled, or ``model``
    itself otherwise (for full fine-tuning pass the frozen copy of the initial weights,
    :attr:`~agentbolt.algorithms.train_state.TrainState.reference_model`).

    Computed on the model's device (the batch is moved there if it is elsewhere); the result
    lies on that device. Only the model tokens (``loss_mask``) are computed, the rest hold 0
    (:func:`masked_logprobs`)."""
    device = next(model.parameters()).device
    batch = replace(
        batch,
        input_ids_BT=batch.input_ids_BT.to(device),
        attention_mask_BT=batch.attention_mask_BT.to(device),
        loss_mask_BT=batch.loss_mask_BT.to(device),
    )
    P = shared_prefix_len(batch)
    with _eval_mode(model):
        if is_peft(model):
            with model.disable_adapter():
                return masked_logprobs(model, batch, P)[0]
        return masked_logprobs(model, batch, P)[0]


# ---------------------------------------------------------------------------- losses


def _masked_mean(values_BT: Tensor, mask_BT: Tensor) -> float:
    return float((values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))


def clipped_policy_loss(
    new_logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    loss_mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logprobs_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_BT: Tensor | None = None,
    num_tokens: float | None = None,
    advantages_BT: Tensor | None = None,
    behaviour_logprobs_BT: Tensor | None = None,
    importance: ImportanceMode = "token",
    importance_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped surrogate, token-level mean (DAPO) over the model tokens of the batch.

    ``num_tokens`` is the divisor (default: this batch's mask sum); pass the total over all
    micro-batches when accumulating so the summed gradient equals that of the whole batch.
    ``advantages_BT`` (per token, aligned with the logprobs) replaces ``advantages_B`` when given.

    With ``behaviour_logprobs_BT`` (asynchronous GRPO) ``old_logprobs_BT`` is the proximal
    policy and each token's surrogate is multiplied by the truncated importance weight of
    proximal against behaviour (:func:`agentbolt.algorithms.importance.importance_weights`,
    ``importance`` and ``importance_cap``); the metrics then include ``is_weight_mean``,
    ``is_weight_min``, ``is_weight_max`` and ``is_clipped_fraction`` over the model tokens."""
    log_ratio_BT = new_logprobs_BT - old_logprobs_BT
    ratio_BT = log_ratio_BT.exp()
    adv_BT = (advantages_BT if advantages_BT is not None else advantages_B[:, None]).to(ratio_BT.dtype)
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    per_token_BT = -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    metrics: dict[str, float] = {}
    if behaviour_logprobs_BT is not None:
        weight_BT, truncated_BT = importance_weights(
            old_logprobs_BT, behaviour_logprobs_BT, loss_mask_BT, importance, importance_cap
        )
        per_token_BT = per_token_BT * weight_BT.to(per_token_BT.dtype)
        metrics.update(_weight_stats(weight_BT, truncated_BT, loss_mask_BT))
    if ref_logprobs_BT is not None and kl_coef:
        delta_BT = ref_logprobs_BT - new_logprobs_BT
        kl_BT = delta_BT.exp() - delta_BT - 1
        per_token_BT = per_token_BT + kl_coef * kl_BT
        metrics["kl"] = _masked_mean(kl_BT.detach(), loss_mask_BT)
    divisor = num_tokens if num_tokens is not None else float(loss_mask_BT.sum().clamp(min=1))
    loss = (per_token_BT * loss_mask_BT).sum() / divisor
    with torch.no_grad():
        is_clipped_BT = (ratio_BT * adv_BT > clipped_BT * adv_BT).float()
        metrics["clip_fraction"] = _masked_mean(is_clipped_BT, loss_mask_BT)
        metrics["approx_kl"] = _masked_mean(ratio_BT - 1 - log_ratio_BT, loss_mask_BT)
        metrics["ratio_mean"] = _masked_mean(ratio_BT, loss_mask_BT)
        if entropy_BT is not None:
            metrics["entropy"] = _masked_mean(entropy_BT, loss_mask_BT)
    return loss, metrics


def _weight_stats(weight_BT: Tensor, truncated_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """Mean, min, max and truncated share of the importance weights over the model tokens."""
    on = mask_BT.bool()
    if not bool(on.any()):
        return {}
    weights = weight_BT[on]
    return {
        "is_weight_mean": float(weights.mean()),
        "is_weight_min": float(weights.min()),
        "is_weight_max": float(weights.max()),
        "is_clipped_fraction": _masked_mean(truncated_BT.float(), mask_BT),
    }


LossFn = Callable[[nn.Module, Batch, float], tuple[Tensor, dict[str, float]]]
"""``(model, micro_batch, num_tokens_in_whole_batch) -> (loss, metrics)``."""


@dataclass(frozen=True)
class PolicyLoss:
    """The GRPO :data:`LossFn`. Without recorded old logprobs the ratio is taken against the
    current policy (detached): exact for the first update on freshly sampled data.

    ``proximal`` (asynchronous GRPO): the ratio is always taken against the current policy
    detached (the proximal policy: exact with one optimizer step per update), and the recorded
    logprobs are the behaviour policy's, corrected for by truncated importance weights
    (``importance``, ``importance_cap``; see :mod:`agentbolt.algorithms.importance`). A row
    without recorded logprobs gets weight 1 (its behaviour taken as the current policy); the
    rows beside it that have them are corrected all the same."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy: bool = True
    """Report the policy entropy (from the same chunks as the log-probs, without gradient)."""
    share_prefix: bool = True
    """Compute a prefix shared by every row of a micro-batch once (:func:`suffix_logits`)."""
    proximal: bool = False
    importance: ImportanceMode = "token"
    importance_cap: float = 2.0
    checkpoint: bool = False
    """Activation checkpointing of the policy's pass (:func:`masked_logprobs`): much less memory
    per micro-batch token, about one more forward of the body per update."""
    chunk_tokens: int = 1024
    """Model tokens per chunk of the output layer (:func:`masked_logprobs`): a chunk's logits,
    their gradient and its entropy's probabilities each hold ``chunk_tokens`` x vocabulary floats
    (SmolLM2: 200 MB each at 1024)."""

    def __call__(self, model: nn.Module, batch: Batch, num_tokens: float) -> tuple[Tensor, dict[str, float]]:
        P = shared_prefix_len(batch) if self.share_prefix else 0
        new_BT, entropy_BT = masked_logprobs(
            model, batch, P, entropy=self.entropy, chunk_tokens=self.chunk_tokens, checkpoint=self.checkpoint
        )
        recorded_BT = batch.old_logprobs_BT
        if recorded_BT is not None and batch.recorded_B is not None:  # some rows have none
            recorded_BT = torch.where(batch.recorded_B[:, None], recorded_BT, new_BT.detach())
        old_BT = recorded_BT if recorded_BT is not None else new_BT.detach()
        behaviour_BT = None
        if self.proximal:
            old_BT, behaviour_BT = new_BT.detach(), recorded_BT
        return clipped_policy_loss(
            new_BT,
            old_BT,
            batch.advantages_B,
            batch.loss_mask_BT,
            self.clip_low,
            self.clip_high,
            ref_logprobs_BT=batch.ref_logprobs_BT,
            kl_coef=self.kl_coef,
            entropy_BT=entropy_BT,
            num_tokens=num_tokens,
            advantages_BT=batch.advantages_BT,
            behaviour_logprobs_BT=behaviour_BT,
            importance=self.importance,
            importance_cap=self.importance_cap,
        )


def sft_loss(
    model: nn.Module, batch: Batch, num_tokens: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Next-token cross-entropy on model-generated tokens only (a :data:`LossFn`)."""
    logprobs_BT, _ = masked_logprobs(model, batch, shared_prefix_len(batch))
    mask_BT = batch.loss_mask_BT
    divisor = num_tokens if num_tokens is not None else float(mask_BT.sum().clamp(min=1))
    loss = -(logprobs_BT * mask_BT).sum() / divisor
    return loss, {"nll": -_masked_mean(logprobs_BT.detach(), mask_BT)}
