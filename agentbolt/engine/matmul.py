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
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CpuMatmul", "Float32Matmul", "native_bf16_matmul", "use_float32_matmul"]

CpuMatmul = Literal["auto", "native", "float32"]
_CHOICES = ("auto", "native", "float32")
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


def use_float32_matmul(choice: str, model: torch.nn.Module) -> bool:
    """Whether the engine should enter ``Float32Matmul`` for ``model`` (see ``EngineConfig.cpu_matmul``)."""
    if choice not in _CHOICES:
        raise ValueError(f"cpu_matmul must be one of {', '.join(_CHOICES)}; got {choice!r}")
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.bfloat16:
        return False
    if choice == "auto":
        return not native_bf16_matmul()
    return choice == "float32"


class Float32Matmul(TorchFunctionMode):
    """Computes bfloat16 CPU ``linear`` (and attention) calls in float32 (see the module docstring)."""

    def __init__(self, scratch_elements: int = 4 * 2**20) -> None:
        super().__init__()
        self._scratch = torch.empty(0)
        self._scratch_elements = scratch_elements

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
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
