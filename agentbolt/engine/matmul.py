"""bfloat16 matrix products on CPUs without bfloat16 units, computed in float32.

PyTorch multiplies bfloat16 matrices on the CPU with oneDNN when the CPU has bfloat16 instructions
(AVX512-BF16 or AMX). Elsewhere (AVX2 only, such as many AMD EPYC and older Intel servers) it falls
back to a generic kernel: on a 2-core AVX2 machine a batch-32 decode step of SmolLM2-135M took
1.1 s of CPU in bfloat16 against 0.23 s in float32, and Hugging Face ``generate`` pays the same.

``Float32Matmul`` is a ``TorchFunctionMode`` the engine thread enters around its forward passes:
every ``linear`` whose weight is bfloat16 on the CPU is computed as ``x.float() @ W.float().T``
(weights converted block by block into one reused scratch buffer, so memory does not grow), with
the result rounded to bfloat16. ``scaled_dot_product_attention`` on bfloat16 tensors likewise runs
in float32: PyTorch's CPU attention kernel took 2.3x longer in bfloat16 (17% of a decode step),
more than converting the step's keys and values costs. Products of bfloat16 values are exact in
float32 and PyTorch's bfloat16 kernels accumulate in float32 too, so the result is what a native
bfloat16 product gives, up to summation order. Measured, interleaved, on a loaded 2-core AVX2
machine: a batch-32 decode step of SmolLM2 in bfloat16 went from 1.1 s of CPU to 0.42 s with the
float32 products and to about 0.31 s with float32 attention as well (float32 weights: 0.27 s).
The mode is thread-local: training or any other thread using the same model object is
unaffected, and weight updates (in-place copies) are seen at the next step. float16 models are
left to PyTorch's own kernels.

On CPUs *with* bfloat16 units the engine enters ``PackedMatmul`` instead: PyTorch's eager
``linear`` hands oneDNN the plain row-major weight on every call, and oneDNN reorders it into its
blocked layout each time. ``PackedMatmul`` reorders every weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and calls ``torch.ops.mkldnn._linear_pointwise``
with the packed copy: the same kernel, bit-identical results (tested), without the per-call
reorder. The packed copies cost as much memory again as the bfloat16 linear weights. They are
rebuilt when a weight changes: ``invalidate()`` after a weight update (the engine calls it), and a
weight replaced by another tensor or changed in place by an autograd-visible op (its version
counter moves) is packed afresh on its next use. Measured on a loaded 2-core AVX512-BF16 machine,
SmolLM2-135M, 32 rows, decode steps alternated between the two settings in one run: 1.10-1.12x
faster steps than PyTorch's own path.

``PackedMatmul`` also computes sibling projections in one product: the query, key and value
projections of a Llama-style attention layer, and the gate and up projections of a gated MLP,
are bias-free linear layers applied to the same input one after another; the first call computes
all of them with one packed copy of their concatenated weights and hands the others their slice
when they are called with that same input. The logits are bit-identical (tested); decode steps
of SmolLM2 (32 rows, one thread) took 1.8% less CPU (median of 80 alternated steps, loaded
machine; 4-5% for these products alone in isolation).

``decode_attention`` (two float32 batched products for the attention of one query position per
row) is used only when ``PackedMatmul(attention=True)``. On an earlier install it measured 5-7x
faster than PyTorch's CPU flash kernel at that shape in bfloat16 (in-process batches of 32 chats
x 64 tokens of SmolLM2: 360 tokens/s against 172). With torch 2.13 and transformers 5.25 it is
not: transformers hands a grouped-query model's decode step to ``scaled_dot_product_attention``
with the query heads of each key-value head packed as query rows (``pack_gqa``), which the flash
kernel runs fast (0.3-0.5 ms per layer for 32 rows at 60-110 cached positions) and which
``decode_attention`` does not take, and for one query position per head (a model without
grouped queries) the flash kernel measured 3.5-4.6x faster than ``decode_attention`` (32 rows,
9 heads, 80 and 400 positions, one thread, loaded 2-core AVX512-BF16 machine). So by default
attention is left to PyTorch.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuMatmul",
    "Float32Matmul",
    "decode_attention",
    "is_placeholder",
    "keep_plain_weights",
    "plain_weight",
    "PackedMatmul",
    "cpu_matmul_mode",
    "native_bf16_matmul",
    "use_float32_matmul",
]

CpuMatmul = Literal["auto", "native", "packed", "float32"]
_CHOICES = ("auto", "native", "packed", "float32")
_LINEAR = {F.linear, torch._C._nn.linear}
_ATTENTION = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (oneDNN with AVX512-BF16 or AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is None:
        return True  # cannot tell: keep PyTorch's own path
    try:
        return bool(check())
    except Exception:
        return True


@functools.cache
def packed_matmul_available() -> bool:
    """Whether oneDNN's packed-weight bfloat16 linear (``PackedMatmul``) runs here: this PyTorch
    build has it, and this CPU can (oneDNN's bfloat16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    an AVX2-only CPU refuses the reorder). Tried once, on a tiny weight."""
    ops = torch.ops.mkldnn
    try:
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        weight = torch.ones(8, 8, dtype=torch.bfloat16)
        packed = ops._reorder_linear_weight(weight, 1)
        out = ops._linear_pointwise(torch.ones(1, 8, dtype=torch.bfloat16), packed, None, "none", [], "")
        return bool(out.shape == (1, 8))
    except Exception:  # noqa: BLE001 - RuntimeError from oneDNN on a CPU it cannot use
        return False


def cpu_matmul_mode(choice: str, model: torch.nn.Module) -> str | None:
    """The mode the engine enters around forward passes of ``model``: "float32", "packed" or None
    (PyTorch's own kernels); see ``EngineConfig.cpu_matmul``."""
    if choice not in _CHOICES:
        raise ValueError(f"cpu_matmul must be one of {', '.join(_CHOICES)}; got {choice!r}")
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.bfloat16:
        return None
    if choice == "auto":
        choice = "packed" if native_bf16_matmul() else "float32"
    if choice == "packed" and not packed_matmul_available():
        return None
    return None if choice == "native" else choice


def use_float32_matmul(choice: str, model: torch.nn.Module) -> bool:
    """Whether the engine should enter ``Float32Matmul`` for ``model`` (see ``EngineConfig.cpu_matmul``)."""
    return cpu_matmul_mode(choice, model) == "float32"


_KEEP_PLAIN = [True]


def keep_plain_weights(keep: bool) -> None:
    """Whether ``PackedMatmul`` modes made from now on keep the plain copy of each linear weight
    beside its packed one (the default) or turn it into a placeholder once packed (see
    ``PackedMatmul``'s ``release_plain``). ``agentbolt demo`` turns it off: nothing there reads
    the engine's weights except its own forward passes and weight updates."""
    _KEEP_PLAIN[0] = keep


def make_matmul_mode(
    mode: str | None, batch_hint: int = 32, model: torch.nn.Module | None = None
) -> TorchFunctionMode | None:
    if mode == "float32":
        return Float32Matmul()
    if mode == "packed":
        release = () if model is None or _KEEP_PLAIN[0] else releasable_weights(model)
        return PackedMatmul(
            batch_hint, fuse=sibling_projections(model) if model is not None else (), release_plain=release
        )
    return None


def releasable_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of ``model``'s linear layers that no embedding shares (a tied output layer's
    weight is the embedding table, which lookups read)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [
        m.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in embedded and m.weight.dim() == 2
    ]


def is_placeholder(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a placeholder left by ``PackedMatmul(release_plain=...)`` (its values
    live only in the packed copy; :func:`plain_weight` gets them back)."""
    return weight.dim() == 2 and weight.numel() > 1 and weight.stride() == (0, 0)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s values as a plain tensor: ``weight`` itself, or for a placeholder a fresh
    copy read back from the packed copy (exact: see ``PackedMatmul``)."""
    if not is_placeholder(weight):
        return weight.detach()
    ref = getattr(weight, "_agentbolt_packed_by", None)
    mode = ref() if ref is not None else None
    if mode is None:
        raise RuntimeError("this weight's values were released and its packed copy is gone")
    return mode.plain(weight)


_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_projections(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Bias-free linear layers that a module applies to one input one after another, in call
    order: Llama-style attention (q, k, v) and gated MLPs (gate, up)."""
    groups: list[list[torch.nn.Linear]] = []
    for module in model.modules():
        for names in _SIBLINGS:
            layers = [getattr(module, n, None) for n in names]
            linears = [la for la in layers if isinstance(la, torch.nn.Linear)]
            if len(linears) == len(names) and all(la.bias is None for la in linears):
                groups.append(linears)
    return groups


class PackedMatmul(TorchFunctionMode):
    """Computes bfloat16 CPU ``linear`` calls with weights packed once for oneDNN (module docstring).

    ``release_plain``: weights (linear layers' own, never an embedding table) whose plain copy is
    turned into a placeholder once packed: a zero-stride tensor of the same shape and dtype
    (2 bytes), so only the packed copy holds the values. :func:`plain_weight` reads them back
    exactly, as the product of an identity matrix with the packed copy (every output is one
    weight times 1 plus zeros, summed in float32). A placeholder is written by assigning a new
    tensor to ``.data`` (``agentbolt.engine.weights`` does), which is packed (and released) at
    its next use; placeholders not written keep their packed copy through ``invalidate()``.
    On SmolLM2-135M bfloat16 this frees the plain copy of the linear weights (0.21 GB): the peak
    of ``agentbolt demo --steps 3 --val-tasks 8`` (whole process tree, PSS) went from 2.41 GB to
    2.13 GB.
    """

    def __init__(
        self,
        batch_hint: int = 32,
        fuse: Sequence[Sequence[torch.nn.Linear]] = (),
        attention: bool = False,
        release_plain: Sequence[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self.batch_hint, self.attention = batch_hint, attention
        self._packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}
        self._groups: dict[int, list[torch.nn.Linear]] = {}  # id(first weight) -> the group
        self._later: set[int] = set()  # ids of the other weights of a group
        self._group_of: dict[int, list[torch.nn.Linear]] = {}  # id(any weight of a group) -> the group
        for group in fuse:
            self._groups[id(group[0].weight)] = list(group)
            self._later.update(id(la.weight) for la in group[1:])
            self._group_of.update((id(la.weight), list(group)) for la in group)
        self._fused: dict[int, tuple[list[weakref.ref], list[int], list[int], torch.Tensor]] = {}
        self._ahead: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(weight) -> (x, version, out)
        self._release = {id(w) for w in release_plain}
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """Forget every packed weight (call after changing weights through ``.data``), except
        those of placeholders: their packed copy is where their values are."""
        with self._lock:
            self._packed = {k: e for k, e in self._packed.items() if _holds_placeholder([e[0]])}
            self._fused = {k: e for k, e in self._fused.items() if _holds_placeholder(e[0])}
            self._ahead.clear()

    def plain(self, weight: torch.Tensor) -> torch.Tensor:
        """The values of ``weight`` (a placeholder of this mode's) as a fresh plain tensor."""
        with self._lock:
            entry = self._packed.get(id(weight))
            if entry is not None and entry[0]() is weight:
                return _unpack(entry[3], weight.shape[1], weight.dtype).contiguous()
            group = self._group_of.get(id(weight))
            fused = self._fused.get(id(group[0].weight)) if group is not None else None
            if group is not None and fused is not None:
                weights = [r() for r in fused[0]]
                if any(w is weight for w in weights):
                    full = _unpack(fused[3], weight.shape[1], weight.dtype)
                    start = 0
                    for w in weights:
                        assert w is not None
                        if w is weight:
                            return full[start : start + w.shape[0]].contiguous()
                        start += w.shape[0]
        raise RuntimeError("no packed copy holds this placeholder's values")

    def _values(self, weight: torch.Tensor) -> torch.Tensor:
        return self.plain(weight) if is_placeholder(weight) else weight.detach()

    def _released(self, weights: list[torch.Tensor]) -> list[int]:
        """Turns those of ``weights`` that may be released into placeholders; their data_ptrs."""
        for w in weights:
            if id(w) in self._release and not is_placeholder(w):
                w.data = torch.zeros(1, dtype=w.dtype).expand(w.shape)
                w._agentbolt_packed_by = weakref.ref(self)  # type: ignore[attr-defined]
        return [w.data_ptr() for w in weights]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            x, weight, bias = _linear_args(args, kwargs)
            if _packable(x, weight, bias):
                if bias is None and (id(weight) in self._groups or id(weight) in self._later):
                    out = self._sibling_linear(x, weight)
                    if out is not None:
                        return out
                return torch.ops.mkldnn._linear_pointwise(x, self._pack(weight), bias, "none", [], "")
        elif func in _ATTENTION and self.attention:
            out = decode_attention(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def project(self, x: torch.Tensor, layers: Sequence[Any]) -> list[torch.Tensor] | None:
        """``[layer(x) for layer in layers]`` as this mode computes them, called directly: one
        product for a registered group of sibling projections, else one layer's. Skips the module
        call, ``F.linear``'s dispatch and this mode's ``__torch_function__`` (about 10 us of Python
        per layer call); None where the layers are not plain ``nn.Linear`` modules without hooks
        (LoRA wrappers, for one) or the call is not one this mode packs (the caller then calls
        the layers)."""
        if not all(
            type(la) is torch.nn.Linear and not (la._forward_hooks or la._forward_pre_hooks) for la in layers
        ):
            return None
        if not all(_packable(x, la.weight, la.bias) for la in layers):
            return None
        if len(layers) == 1:
            weight, bias = layers[0].weight, layers[0].bias
            if id(weight) in self._group_of:
                return None  # packed with its group only
            return [torch.ops.mkldnn._linear_pointwise(x, self._pack(weight), bias, "none", [], "")]
        group = self._groups.get(id(layers[0].weight))
        if (
            group is None
            or len(group) != len(layers)
            or any(la is not g for la, g in zip(layers, group, strict=True))
        ):
            return None
        return self._group_product(x, [la.weight for la in layers])

    def _group_product(self, x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The products of ``x`` with each of a group's bias-free ``weights``, as one product of
        their packed concatenation, split; None where a weight's shape does not fit ``x``."""
        if any(not (_is_cpu_bf16(w) and w.dim() == 2 and w.shape[1] == x.shape[-1]) for w in weights):
            return None
        out = torch.ops.mkldnn._linear_pointwise(x, self._pack_group(weights), None, "none", [], "")
        return list(out.split([w.shape[0] for w in weights], dim=-1))

    def _sibling_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The first layer of a group computes every layer's product of ``x`` in one call; the
        others then take theirs if they are applied to the same, unchanged ``x``."""
        ahead = self._ahead.pop(id(weight), None)
        if ahead is not None and ahead[0] is x and ahead[1] == _version_of(x):
            return ahead[2]
        group = self._groups.get(id(weight))
        if group is None or group[0].weight is not weight:
            return None
        weights = [la.weight for la in group]
        parts = self._group_product(x, weights)
        if parts is None:
            return None
        for w, part in zip(weights[1:], parts[1:], strict=True):
            self._ahead[id(w)] = (x, _version_of(x), part)
        return parts[0]

    def _pack_group(self, weights: list[torch.Tensor]) -> torch.Tensor:
        entry = self._fused.get(id(weights[0]))
        if (
            entry is not None
            and all(r() is w for r, w in zip(entry[0], weights, strict=True))
            and entry[1] == [w._version for w in weights]
            and entry[2] == [w.data_ptr() for w in weights]
        ):
            return entry[3]
        packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.cat([self._values(w) for w in weights]), self.batch_hint
        )
        with self._lock:
            ptrs = self._released(weights)
            self._fused[id(weights[0])] = (
                [weakref.ref(w) for w in weights],
                [w._version for w in weights],
                ptrs,
                packed,
            )
        return packed

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if (
            entry is not None
            and entry[0]() is weight
            and entry[1] == weight._version
            and entry[2] == weight.data_ptr()
        ):
            return entry[3]
        if len(self._packed) > 4096:  # weights replaced many times over: drop the stale entries
            self._packed = {k: e for k, e in self._packed.items() if e[0]() is not None}
        packed = torch.ops.mkldnn._reorder_linear_weight(self._values(weight), self.batch_hint)
        with self._lock:
            if id(weight) in self._group_of:  # its group's packed copy keeps its values too
                ptr = weight.data_ptr()
            else:
                ptr = self._released([weight])[0]
            self._packed[id(weight)] = (weakref.ref(weight), weight._version, ptr, packed)
        return packed


class Float32Matmul(TorchFunctionMode):
    """Computes bfloat16 CPU ``linear`` (and attention) calls in float32 (see the module docstring)."""

    def __init__(self, scratch_elements: int = 4 * 2**20) -> None:
        super().__init__()
        self._scratch = torch.empty(0)
        self._scratch_elements = scratch_elements

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            x, weight, bias = _linear_args(args, kwargs)
            if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2:
                return self._linear(x, weight, bias)
        elif func in _ATTENTION and args and _is_cpu_bf16(args[0]):
            # PyTorch's CPU attention kernel is ~2x slower in bfloat16 than in float32 here
            up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            mask = kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.is_floating_point():
                kwargs = {**kwargs, "attn_mask": mask.float()}
            return func(*up, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n_out, n_in = weight.shape
        x_MK = x.reshape(-1, n_in).float()
        rows = max(1, min(n_out, self._scratch_elements // n_in))
        if self._scratch.numel() < rows * n_in:
            self._scratch = torch.empty(rows * n_in)
        if rows == n_out:
            block = self._scratch[: weight.numel()].view(n_out, n_in)
            block.copy_(weight)
            out_MN = x_MK @ block.T
        else:
            out_MN = x_MK.new_empty(x_MK.shape[0], n_out)
            for start in range(0, n_out, rows):
                stop = min(n_out, start + rows)
                block = self._scratch[: (stop - start) * n_in].view(stop - start, n_in)
                block.copy_(weight[start:stop])
                out_MN[:, start:stop] = x_MK @ block.T
        if bias is not None:
            out_MN += bias.float()
        return out_MN.to(torch.bfloat16).view(*x.shape[:-1], n_out)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def decode_attention(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``scaled_dot_product_attention`` of one bfloat16 CPU query position per row (a decode step)
    as two float32 batched products, or None for any other call (left to PyTorch).

    On an earlier install PyTorch's CPU flash kernel was slow at one query position in bfloat16:
    2.1 ms against 0.29 ms here for 32 rows, 9 query / 3 key-value heads, 80 cached positions
    (9.8 ms against 1.7 ms at 400 positions, 104 ms against 15-20 ms at 4000), one thread of a
    loaded 2-core AVX512-BF16 machine; with torch 2.13 the flash kernel is the faster one (module
    docstring), so ``PackedMatmul`` calls this only when asked to. Rows go in chunks (``_DECODE_CHUNK``). Queries, keys
    and values are converted to float32 (bfloat16 -> float32 is exact), so scores and softmax are
    float32 as in the flash kernel, and the result is rounded to bfloat16 once: its error against a
    float64 reference is no larger than the flash kernel's (tested). Query heads that share a
    key-value head (``enable_gqa``) are the rows of one product, so keys are not repeated.
    """
    bound = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
    q, k, v, mask = bound.get("query"), bound.get("key"), bound.get("value"), bound.get("attn_mask")
    if not (_is_cpu_bf16(q) and _is_cpu_bf16(k) and _is_cpu_bf16(v)):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        return None
    if bound.get("dropout_p", 0.0) or bound.get("is_causal", False) or torch.is_grad_enabled():
        return None
    b, h, _, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    if v.shape[:3] != k.shape[:3] or k.shape[0] != b or k.shape[3] != d or h % kv:
        return None
    if kv != h and not bound.get("enable_gqa", False):
        return None
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() <= 4):
        return None
    scale = bound.get("scale")
    scale = d**-0.5 if scale is None else float(scale)
    out = q.new_empty(b, h, 1, v.shape[3])
    rows = max(1, _DECODE_CHUNK // (kv * length * d))  # float32 copies that stay in the CPU cache
    for i in range(0, b, rows):
        part = mask[i : i + rows] if mask is not None and mask.dim() == 4 and mask.shape[0] == b else mask
        out[i : i + rows] = _attend(q[i : i + rows], k[i : i + rows], v[i : i + rows], part, scale)
    return out


_DECODE_CHUNK = 1 << 18
"""Elements of float32 keys per chunk of rows in ``decode_attention``: converting the whole
cache at once fell out of the CPU cache at long contexts (at 4000 positions, 32 rows: as slow as
the flash kernel, against 5x faster in chunks)."""


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    b, h, _, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    q_bgd = q.reshape(b, kv, h // kv, d).float()  # the query heads of one key-value head as rows
    scores = torch.matmul(q_bgd, k.float().transpose(-1, -2)).mul_(scale)  # b, kv, h/kv, length
    if mask is not None:
        per_head = scores.view(b, h, 1, length)
        if mask.dtype == torch.bool:
            per_head.masked_fill_(~mask, float("-inf"))
        else:
            per_head.add_(mask.float())
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).reshape(b, h, 1, v.shape[3]).to(q.dtype)


def _unpack(packed: torch.Tensor, n_in: int, dtype: torch.dtype) -> torch.Tensor:
    """The plain (out, in) weight of a packed copy: the identity times its transpose, exactly."""
    eye = torch.eye(n_in, dtype=dtype)
    return torch.ops.mkldnn._linear_pointwise(eye, packed, None, "none", [], "").T


def _holds_placeholder(refs: list[weakref.ref]) -> bool:
    return any((w := r()) is not None and is_placeholder(w) for r in refs)


def _version_of(t: torch.Tensor) -> int:
    """The in-place version counter; inference-mode tensors have none (-1)."""
    return -1 if t.is_inference() else t._version


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``PackedMatmul`` computes ``linear(x, weight, bias)``: bfloat16 CPU tensors, a 2-D
    weight, and no gradient to record."""
    return (
        _is_cpu_bf16(weight)
        and weight.dim() == 2
        and _is_cpu_bf16(x)
        and (bias is None or _is_cpu_bf16(bias))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _is_cpu_bf16(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def _linear_args(
    args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs[n] for n in names[len(args) :] if n in kwargs]
    x, weight = values[0], values[1]
    bias = values[2] if len(values) > 2 else None
    return x, weight, bias
