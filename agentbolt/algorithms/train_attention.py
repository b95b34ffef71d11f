"""Attention for training passes on the CPU, where PyTorch's fused kernel is slow to differentiate.

A GRPO update's attention is many short rows: 32 completions of about 40 tokens after a shared
prompt prefix. For those shapes PyTorch's CPU flash-attention kernel (what transformers' "sdpa"
implementation runs) spends most of its time in the backward pass: SmolLM2's attention shapes
(32 rows, 9 query heads sharing 3 key-value heads, 40 queries over 72 keys, bfloat16, 2 threads)
took 49 ms per layer forward and backward, against 16 ms for the plain computation below
(``benchmarks/update_parts.py --attention``); in a profiled 6.3 s update its backward calls took
1.0 s and its forward calls 0.3 s. For long rows the fused kernel wins (8 rows of 512 tokens:
144 ms against 231 ms), so the plain computation is used only up to :data:`MAX_SCORES`
attention scores per call.

:func:`use_train_attention` registers an attention implementation with transformers
(``AttentionInterface``, with sdpa's masks) and switches a model to it. It computes, with
gradients, on the CPU and up to that size::

    softmax(q k^T * scaling, masked) v

in float32 (the scores, their softmax and the product with the values; the inputs and the output
stay in their dtype), with the query heads that share a key-value head stacked as rows of that
head (no copy of the keys and values per query head). Masked positions get float32's lowest
value rather than -inf, so a row with nothing to attend to (padding) is finite, as in
transformers' eager attention. Everything else (no gradient: reference and behaviour log-prob
passes, other devices, dropout, soft-capping, position biases, larger calls) goes to
transformers' own sdpa function, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MAX_SCORES", "NAME", "train_attention", "use_train_attention"]

NAME = "agentbolt_cpu_train"
MAX_SCORES = 2**23
"""Most attention scores (batch x heads x queries x keys) one call computes itself: 32 MB of
float32 probabilities kept for the backward pass (per layer without activation checkpointing)."""


def _sdpa() -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _plain(query: Tensor, key: Tensor, value: Tensor, dropout: float, kwargs: dict[str, Any]) -> bool:
    B, H, S, _ = query.shape
    return (
        torch.is_grad_enabled()
        and query.device.type == "cpu"
        and not dropout
        and H % key.shape[1] == 0
        and value.shape[-1] == query.shape[-1]  # not for value heads of another width (MLA)
        and B * H * S * key.shape[2] <= MAX_SCORES
        and not kwargs.get("output_attentions")
        and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux"))
    )


def train_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query`` [B, H, S, D], ``key``/``value``
    [B, KV, T, D], a boolean (True: attend) or additive mask [B, 1, S, T] or None (causal when
    the layer is, the queries being the last S of the T positions); returns [B, S, H, D]."""
    if not _plain(query, key, value, dropout, kwargs):
        return _sdpa()(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    with torch.autocast("cpu", enabled=False):  # float32 products, not autocast's bfloat16
        return _plain_attention(module, query, key, value, attention_mask, scaling, is_causal)


def _plain_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    is_causal: bool | None,
) -> tuple[Tensor, None]:
    B, H, S, D = query.shape
    KV, T = key.shape[1], key.shape[2]
    group = H // KV
    scale = scaling if scaling is not None else D**-0.5
    q = (query.float() * scale).reshape(B, KV, group * S, D)  # the heads of a KV head as its rows
    scores = torch.matmul(q, key.float().transpose(-1, -2)).view(B, KV, group, S, T)
    lowest = torch.finfo(torch.float32).min
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and S > 1:
            keep = torch.arange(S, device=query.device)[:, None] + (T - S) >= torch.arange(
                T, device=query.device
            )
            scores = scores.masked_fill(~keep, lowest)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask.view(B, 1, 1, S, T), lowest)
    else:
        scores = scores + attention_mask.view(B, 1, 1, S, T).float()
    probs = torch.softmax(scores, dim=-1).view(B, KV, group * S, T)
    out = torch.matmul(probs, value.float()).view(B, H, S, D)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def use_train_attention(model: nn.Module) -> bool:
    """Switch ``model`` (a transformers model using sdpa, possibly PEFT-wrapped) to
    :func:`train_attention`; False (nothing changed) for models on another implementation or a
    transformers without the attention registries."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    get_base = getattr(model, "get_base_model", None)
    base: Any = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, train_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        base.set_attn_implementation(NAME)
    except (AttributeError, ValueError):
        return False
    return bool(config._attn_implementation == NAME)
