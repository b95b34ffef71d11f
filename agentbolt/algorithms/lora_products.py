"""LoRA layers computed with fewer passes over their activations.

peft computes a LoRA linear layer as ``base(x) + lora_B(lora_A(x)) * scaling``: besides the
three products, a multiplication and an addition over the whole ``(tokens x out)`` output, and
under autocast the input cast to bfloat16 twice (once for the base product, once for
``lora_A``). On a CPU these passes over memory are a large share of an update: profiled on
SmolLM2-135M (32 rows, 1,973 tokens, activation checkpointing, bfloat16 autocast, 2 cores),
matrix products were 31% of the update's CPU time, casts 19% and elementwise multiplications
and additions 22%.

:func:`fuse_lora_products` gives every vanilla LoRA linear layer of a peft model a forward that
casts its input once for the base and LoRA products (and once for all the layers that take
the same input: q, k and v; gate and up), folds ``scaling`` into the small ``lora_B`` matrix and adds the LoRA
product onto the base output inside one ``addmm``: the same function (the sum is rounded once
instead of twice, so under bfloat16 the result differs from peft's by rounding only), with
gradients flowing to ``lora_A`` and ``lora_B`` as before. Whatever this does not cover falls
back to peft's own forward at call time: adapters disabled or merged, several active adapters,
per-call adapter names, LoRA variants (DoRA and others), dropout, extra arguments, or dtypes
that do not match without autocast.

Measured on SmolLM2-135M, 32 rows of GRPO's update (1,973 tokens, checkpointed, bfloat16
autocast, one thread, machine loaded by other jobs), alternating peft's forward and this one in
one process, 3 rounds: 15.9-16.7 s with peft's forward, 13.7-14.9 s with one cast per layer
and the ``addmm``, 13.5-14.4 s with the cast shared by sibling layers too (about 15% less).
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["fuse_lora_products", "fused_layers", "is_peft"]

_FUSED = "_agentbolt_fused_forward"


def is_peft(model: object) -> TypeGuard[PeftModel]:
    """Whether ``model`` is a peft model, without importing peft (2-3 s of CPU): a model cannot be
    one unless peft is already imported, so every process that never uses LoRA skips it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def fuse_lora_products(model: nn.Module) -> int:
    """Give each vanilla LoRA linear layer of ``model`` the fused forward; returns how many.
    Calling it again changes nothing."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency of training
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and isinstance(module.base_layer, nn.Linear):
            if not getattr(module, _FUSED, False):
                module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
                setattr(module, _FUSED, True)
            count += 1
    return count


def fused_layers(model: nn.Module) -> int:
    """How many layers of ``model`` have the fused forward."""
    return sum(1 for m in model.modules() if getattr(m, _FUSED, False))


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    cls = type(self)
    if args or kwargs or self.disable_adapters or self.merged:
        return cls.forward(self, x, *args, **kwargs)
    active = self.active_adapters
    if len(active) != 1 or active[0] not in self.lora_A or active[0] in self.lora_variant:
        return cls.forward(self, x, *args, **kwargs)
    name = active[0]
    if not isinstance(self.lora_dropout[name], nn.Identity):
        return cls.forward(self, x, *args, **kwargs)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    if torch.is_autocast_enabled(x.device.type):
        x = _cast_once(x, torch.get_autocast_dtype(x.device.type))
    elif not x.dtype == self.base_layer.weight.dtype == a.dtype == b.dtype:
        return cls.forward(self, x)  # mixed dtypes without autocast: peft's own way, before any product
    result = self.base_layer(x)
    xa = F.linear(x, a)
    b_scaled = b * self.scaling[name]
    shape = result.shape
    out = torch.addmm(result.reshape(-1, shape[-1]), xa.reshape(-1, xa.shape[-1]), b_scaled.t())
    return out.view(shape)


_last_cast = threading.local()


def _cast_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, reused while the next layer gets the very same input: the query, key and
    value projections (and the gate and up projections) all take one tensor, which autocast
    would cast once per product and once more for each ``lora_A``. Keyed by the tensor itself
    (a weak reference), its version counter (an in-place change makes a new cast) and whether
    gradients are on (a cast made without them has no autograd history). The last cast is held
    until the next one: one activation's size, in bfloat16."""
    grad = torch.is_grad_enabled()
    last = getattr(_last_cast, "value", None)
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == dtype and last[3] == grad:
        return last[4]
    cast = x.to(dtype)
    _last_cast.value = (weakref.ref(x), x._version, dtype, grad, cast)
    return cast
