"""The engine's own forward pass for Llama-family models (prefills and decode steps).

transformers' ``LlamaForCausalLM.forward`` is general: every call it builds a 4-D attention mask
from the 2-D padding mask (Python-heavy mask functions), recomputes the rotary embedding's cos/sin
from the position ids, runs ``LlamaRMSNorm`` as eight separate ops with float32 upcasts, and goes
through its cache, output and keyword-argument machinery. ``LlamaForward`` computes the same
function with less of that work around the matrix products:

- the key-padding mask is the batcher's 2-D mask viewed as booleans (one op per step; an additive
  bias for the float32 batched-product attention below); a causal mask is built only for
  prefills (more than one new token per row);
- RoPE reads cos/sin from tables computed once by the model's own rotary module for every
  position (bit-identical to computing them per step: each entry is one product), indexed by
  the position ids;
- RMSNorm is ``F.rms_norm`` on the float32 input, rounded to the model's dtype, times the
  weight: the rounding steps of ``LlamaRMSNorm`` in four ops (one, weight included, in float32);
- attention is ``F.scaled_dot_product_attention`` on the batch's KV cache
  (:mod:`agentbolt.engine.kv_cache`); for one new token per row, the query heads that share a
  key-value head are packed as query rows of that head (what transformers does too, and what the
  CPU flash kernel runs fast), otherwise ``enable_gqa=True``; for float32 models on CPU a decode
  step's attention is instead two batched products over the whole cache buffers (the columns past
  the end masked), which needs no copy of the strided cache (``torch.matmul`` on the cache view
  copies it): SmolLM2 decode steps in float32 1.05x against the flash kernel's 1.01x over
  transformers' forward (one thread, alternated); not used in bfloat16, where its scores are
  rounded to bfloat16 (decode steps 1.21x against 1.09-1.13x, but logprobs up to twice as far from
  a teacher-forced pass when attention scores are large; ``bmm_attention`` switches it);
- the elementwise work runs with torch-function modes switched off, the linear products and the
  attention call inside the caller's mode (``PackedMatmul`` costs ~2.5 us of Python per call it
  sees): decode steps 1.04-1.05x faster than transformers' forward without this, 1.08-1.09x with
  it (SmolLM2 bf16, 32 rows, one thread, alternated step by step, loaded 2-core machine);
- where the engine's C kernels are built (:mod:`agentbolt.engine.kernels`, ``use_kernels``), a
  decode step's RoPE and cache write, attention, residual adds with their norms and the MLP's
  ``silu(gate) * up`` are one C call each per layer instead of PyTorch's attention kernel and
  about twenty small ops (SmolLM2, bfloat16, 32 rows, 2 threads: median decode step 35.6 ms
  before, 25.9-27.1 ms with them, ``inference_throughput.py --profile-steps``);
- with :class:`~agentbolt.engine.matmul.PackedMatmul` (``self.packed``) the products are called
  directly (``PackedMatmul.project``, which takes only plain ``nn.Linear`` modules without
  hooks), not through the modules and the mode: median decode step 28.6 against 29.5 ms (10
  alternated batches in one process, faster in 9);
- every other linear product is a call of the model's own modules, so weight updates, LoRA
  wrappers and any mode the caller entered apply unchanged (packed copies follow weight changes
  either way); only the last position of each row goes through the final norm and the output
  layer.

Decode steps of SmolLM2 (bfloat16, packed weights, 32 rows) were 1.07-1.11x faster than with
transformers' forward on one thread (seven runs) and 1.14-1.15x on two (medians of 62-124 steps
each, the two alternated step by step in one process, on a 2-core machine shared with other jobs,
load average 1.0-3.4); the matrix products (~63% of a step) and the flash attention kernel (~21%)
are unchanged. Served over HTTP with the loop in the main thread it was faster in every round
(``EngineConfig.forward``, whose default it is).

``unsupported_reason(model)`` says why a model cannot take this path (it takes a
``LlamaForCausalLM`` with a static RoPE type, sdpa or eager attention, LlamaRMSNorm norms and
gate/up/down MLPs); anything
else keeps transformers' forward (``Batcher(forward=...)``, reported by ``ModelEngine.stats()``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentbolt.engine import kernels, kv_cache

__all__ = ["FORWARDS", "LlamaForward", "unsupported_reason"]

FORWARDS = ("auto", "engine", "transformers")
"""The values of ``EngineConfig.forward`` (and ``GRPO.engine_forward``)."""

_STATIC_ROPE = {"default", "linear", "llama3"}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the engine's own forward pass (None: it can)."""
    if type(model).__name__ != "LlamaForCausalLM":
        return f"{type(model).__name__} is not LlamaForCausalLM"
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if inner is None or config is None:
        return "no .model or .config"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in _STATIC_ROPE:
        return f"RoPE type {getattr(rotary, 'rope_type', None)!r} is not one of {sorted(_STATIC_ROPE)}"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r}"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention layer without q/k/v/o projections"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "MLP without gate/up/down projections"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm).__name__ != "LlamaRMSNorm":
                return f"norm {type(norm).__name__}"
    return None


class LlamaForward:
    """A Llama forward pass over the batcher's mask, position ids and KV cache (module docstring)."""

    def __init__(self, model: torch.nn.Module, max_positions: int, use_kernels: bool = True) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the engine's Llama forward does not support this model: {reason}")
        self.model: Any = model
        inner: Any = model.model
        self.inner = inner
        config: Any = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.scale = self.head_dim**-0.5
        self.eps = float(inner.norm.variance_epsilon)
        self.dtype = inner.embed_tokens.weight.dtype
        self.bmm_attention = inner.embed_tokens.weight.device.type == "cpu" and self.dtype == torch.float32
        """Decode-step attention as two batched products over the whole cache buffers instead of
        the flash kernel (see ``_bmm_attention``). On by default for float32 on CPU only: in
        bfloat16 the scores are rounded to bfloat16 before the softmax, and with large scores the
        logprobs drift twice as far from a teacher-forced pass as the flash kernel's."""
        self.kernel_note = ""
        """Why the engine's C kernels do not serve (empty when they do)."""
        if not use_kernels:
            self.kernel_note = "switched off (kernels=False)"
        elif inner.embed_tokens.weight.device.type != "cpu" or self.dtype not in (
            torch.bfloat16,
            torch.float32,
        ):
            self.kernel_note = (
                f"{self.dtype} on {inner.embed_tokens.weight.device.type}: CPU bfloat16/float32 only"
            )
        elif not kernels.available():
            self.kernel_note = kernels.status()
        self.kernel = not self.kernel_note
        """The C kernels of :mod:`agentbolt.engine.kernels` serve: a decode step's RoPE, cache write
        and attention, and every pass's norms and MLP activation (each where it takes the tensors)."""
        self.packed: Any = None
        """The :class:`~agentbolt.engine.matmul.PackedMatmul` mode the caller enters around this
        forward pass, if any: its products are then called directly (``PackedMatmul.project``)."""
        self.adapters: Any = None
        """The :class:`~agentbolt.engine.lora_rows.RowAdapters` whose rows this pass serves, if any."""
        self.silu = getattr(config, "hidden_act", None) == "silu"
        """The MLP's activation is SiLU, which ``kernels.silu_mul`` computes."""
        self._tables_for(max(max_positions, int(getattr(config, "max_position_embeddings", 0))))

    def _tables_for(self, positions: int) -> None:
        """cos/sin for positions 0..positions-1, from the model's rotary module (same numbers)."""
        weight = self.inner.embed_tokens.weight
        probe = torch.empty(0, device=weight.device, dtype=weight.dtype)
        with torch.inference_mode():
            cos, sin = self.inner.rotary_emb(probe, torch.arange(positions, device=weight.device)[None])
        half = self.head_dim // 2
        self.cos = cos[0]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half of sin negated
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def __call__(
        self, ids_BT: torch.Tensor, mask_BL: torch.Tensor, pos_BT: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits of every row's last position; appends this step's keys and values to ``cache``.

        ``mask_BL`` covers the cached positions and the new ones (1: a token, 0: padding),
        ``pos_BT`` holds the new tokens' positions.
        """
        device = self.inner.embed_tokens.weight.device
        ids_BT, mask_BL, pos_BT = ids_BT.to(device), mask_BL.to(device), pos_BT.to(device)
        B, T = ids_BT.shape
        L = mask_BL.shape[1]
        if int(pos_BT.max()) >= self.cos.shape[0]:
            self._tables_for(int(pos_BT.max()) * 2)
        cos = self.cos[pos_BT].unsqueeze(2)  # B T 1 D: broadcast over the heads
        sin = self.sin_signed[pos_BT].unsqueeze(2)
        keys_ok = mask_BL.bool()
        if T == 1:
            attn_mask = keys_ok[:, None, None, :]  # B 1 1 L: the packed query rows share it
        else:
            query_cols = torch.arange(L - T, L, device=device)
            causal_TL = torch.arange(L, device=device)[None, :] <= query_cols[:, None]
            attn_mask = keys_ok[:, None, None, :] & causal_TL
            # a padding query sees at least itself: no fully masked row (NaN) whose values would
            # then reach the real tokens through a zero weight
            attn_mask[:, :, torch.arange(T, device=device), query_cols] = True
        x = self.inner.embed_tokens(ids_BT)
        half = self.head_dim // 2
        bias: torch.Tensor | None = None
        # Elementwise work runs with torch-function modes off: a mode such as PackedMatmul costs
        # about 2.5 us of Python per torch call it sees (~1,500 calls a step for SmolLM2). The
        # linear products and the attention call stay inside whatever mode the caller entered.
        plain = torch._C.DisableTorchFunction
        layers = self.inner.layers
        if self.kernel and T == 1:
            cos_BD, sin_BD = cos.view(B, self.head_dim), sin.view(B, self.head_dim)
        with plain():
            h = self._norm_of(x, layers[0].input_layernorm.weight)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = self._project(h, attn.q_proj, attn.k_proj, attn.v_proj)
            fast = None
            with plain():
                room = kv_cache.append_column(cache, i) if self.kernel and T == 1 else None
                if room is not None:  # the decode step's rotary embedding, cache write and attention in C
                    buf_k, buf_v, column = room
                    q_rot = kernels.rope_append(q, k, v, cos_BD, sin_BD, buf_k, buf_v, column, self.head_dim)
                    if q_rot is None:  # shapes the kernel does not take: the same, in PyTorch
                        q_rot = self._rope(q.view(B, T, self.heads, self.head_dim), cos, sin, half)
                        k_rot = self._rope(k.view(B, T, self.kv_heads, self.head_dim), cos, sin, half)
                        buf_k[:, :, column].copy_(k_rot[:, 0])
                        buf_v[:, :, column].copy_(v.view(B, self.kv_heads, self.head_dim))
                    keys, values = cache.layers[i].keys, cache.layers[i].values
                    q = q_rot.view(B, self.kv_heads, self.groups, self.head_dim)
                    fast = kernels.decode_attention(q, keys, values, mask_BL, self.scale)
                else:
                    q = self._rope(q.view(B, T, self.heads, self.head_dim), cos, sin, half)
                    k = self._rope(k.view(B, T, self.kv_heads, self.head_dim), cos, sin, half)
                    v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
                    keys, values = cache.update(k.transpose(1, 2), v, i)
                    if T == 1:
                        q = q.view(B, self.kv_heads, self.groups, self.head_dim)
                        if self.kernel:
                            fast = kernels.decode_attention(q, keys, values, mask_BL, self.scale)
                    else:
                        q = q.transpose(1, 2)
            whole = (
                self._whole_buffers(cache, i, B) if fast is None and T == 1 and self.bmm_attention else None
            )
            if fast is not None:
                out = fast
            elif whole is not None:
                with plain():
                    if bias is None or bias.shape[-1] != whole[0].shape[2]:
                        bias = self._bias(keys_ok, whole[0].shape[2])
                    out = self._bmm_attention(q, whole[0], whole[1], bias)
            elif T == 1:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attn_mask, scale=self.scale, enable_gqa=self.groups > 1
                ).transpose(1, 2)
            with plain():
                out = out.reshape(B, T, self.heads * self.head_dim)
            (out,) = self._project(out, attn.o_proj)
            mlp = layer.mlp
            with plain():
                x, h = self._residual_norm(x, out, layer.post_attention_layernorm.weight)
            gate, up = self._project(h, mlp.gate_proj, mlp.up_proj)
            with plain():
                fused = kernels.silu_mul(gate, up) if self.kernel and self.silu else None
                h = mlp.act_fn(gate) * up if fused is None else fused
            (out,) = self._project(h, mlp.down_proj)
            with plain():
                if i + 1 < len(layers):
                    x, h = self._residual_norm(x, out, layers[i + 1].input_layernorm.weight)
                else:
                    x = x + out
                    h = self._norm_of(x[:, -1:], self.inner.norm.weight)
        (logits,) = self._project(h, self.model.lm_head)
        return logits[:, -1, :]

    def _project(self, x: torch.Tensor, *layers: torch.nn.Module) -> list[torch.Tensor]:
        """Each layer applied to ``x``: through ``self.packed`` directly where it takes them, else
        by calling the layers (inside whatever mode the caller entered)."""
        out = None
        if self.packed is not None:
            with torch._C.DisableTorchFunction():
                out = self.packed.project(x, layers)
        out = out if out is not None else [layer(x) for layer in layers]
        if self.adapters is not None and self.adapters.active:  # LoRA adapters served per row
            with torch._C.DisableTorchFunction():  # small float32 products: no matmul mode's
                out = self.adapters.add_deltas(layers, x, out)
        return out

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, half: int) -> torch.Tensor:
        return x * cos + x.roll(half, -1) * sin_signed

    def _residual_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + residual`` and its norm times ``weight``; in one kernel call (``x`` updated in
        place) where the C kernels serve."""
        if self.kernel:
            h = kernels.add_rms_norm(x, residual, weight, self.eps)
            if h is not None:
                return x, h
        x = x + residual
        return x, self._norm(x, weight)

    def _norm_of(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` times ``weight`` (the C kernel where it serves)."""
        h = kernels.add_rms_norm(x, None, weight, self.eps) if self.kernel else None
        return self._norm(x, weight) if h is None else h

    def _whole_buffers(self, cache: Any, i: int, B: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        buffers = getattr(cache.layers[i], "buffers", None)
        whole = buffers() if buffers is not None else None
        if whole is None or not (whole[0].is_contiguous() and whole[1].is_contiguous()):
            return None
        return whole

    def _bias(self, keys_ok_BL: torch.Tensor, capacity: int) -> torch.Tensor:
        """Additive attention bias over a whole cache buffer: 0 for tokens, -inf elsewhere."""
        B, L = keys_ok_BL.shape
        bias = torch.full((B, 1, 1, capacity), float("-inf"), dtype=self.dtype, device=keys_ok_BL.device)
        bias[:, 0, 0, :L].masked_fill_(keys_ok_BL, 0.0)
        return bias

    def _bmm_attention(
        self, q: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """One query position per row, its query heads packed per key-value head, over the whole
        (contiguous) cache buffers: two batched products and a float32 softmax, no copies."""
        B, KV, G, D = q.shape
        C = buf_k.shape[2]
        scores = torch.bmm(q.reshape(B * KV, G, D) * self.scale, buf_k.view(B * KV, C, D).transpose(1, 2))
        weights = (scores.view(B, KV, G, C) + bias).softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(weights.view(B * KV, G, C), buf_v.view(B * KV, C, D)).view(B, KV, G, D)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``LlamaRMSNorm``: normalised in float32, rounded to the input dtype, times the weight."""
        if x.dtype == weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
