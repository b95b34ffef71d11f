"""Several LoRA adapters served at once over one base model, each batch row with its own.

vLLM's multi-LoRA serving (``/v1/load_lora_adapter``, a request naming the adapter as its
``model``), on the engine's own forward pass: the base weights stay as they are, and every linear
product an adapter touches adds, for the rows of that adapter, ``x @ A.T @ B.T * scale`` (what
punica and S-LoRA batch on GPUs; here two small products per layer for all the adapters of the
batch together, see :class:`RowAdapters`). Rows of the base model add nothing. With no adapter
in the batch the forward pass is untouched.

Loading, replacing or unloading an adapter leaves the others serving, and the sequences running
on it finish on it: a sequence holds its adapter from start to end. The kept prompt prefix
(:mod:`agentbolt.engine.prefix`) belongs to one adapter: keys and values computed under one are
never reused under another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Adapter", "LoraPair", "RowAdapters"]


@dataclass(frozen=True)
class LoraPair:
    """One adapted linear layer: ``delta(x) = (x @ a.T) @ b.T``, the scale folded into ``b``; in
    float32 (the products are small, and bfloat16 ones are slow on CPUs without bfloat16 units)."""

    a: torch.Tensor  # rank x in
    b: torch.Tensor  # out x rank


@dataclass(eq=False)
class Adapter:
    """A loaded adapter. A sequence holds the one it started with: replacing or unloading the
    name serves new requests otherwise, while running sequences finish on theirs."""

    name: str
    pairs: dict[torch.nn.Module, LoraPair]


class RowAdapters:
    """The adapters loaded by name, and the rows of each in the forward pass being run.

    A layer's products for a batch are two, whatever the adapters in it: ``x`` times every
    adapter's ``a`` stacked (``h``: each row gets every adapter's rank columns), ``h`` masked to
    the row's own adapter's columns, times every ``b`` stacked. No rows are gathered or
    scattered; the extra work is the other adapters' few rank columns per row."""

    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        """Name -> adapter, for new requests (a whole-dict read or write is atomic)."""
        self._active: list[Adapter] = []
        self._row_index = torch.zeros(0, dtype=torch.long)
        self._key: tuple[int, ...] = ()
        self._stacks: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None] = {}
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def select(self, rows: Sequence[Adapter | None]) -> None:
        """The adapter of each row of the next forward pass (None: the base model)."""
        self._active = list(dict.fromkeys(r for r in rows if r is not None))
        self._masks = {}
        if not self._active:
            return
        key = tuple(id(a) for a in self._active)
        if key != self._key:  # another set of adapters: stack their layers anew
            self._key, self._stacks = key, {}
        where = {id(a): i for i, a in enumerate(self._active)}
        self._row_index = torch.tensor([where[id(r)] if r is not None else -1 for r in rows])

    @property
    def active(self) -> bool:
        return bool(self._active)

    def _stack(self, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
        """The active adapters' ``a`` and ``b`` of ``layer`` stacked, and which adapter owns
        each rank column; None when none adapts it."""
        if layer not in self._stacks:
            pairs = [(i, a.pairs[layer]) for i, a in enumerate(self._active) if layer in a.pairs]
            self._stacks[layer] = (
                (
                    torch.cat([p.a for _, p in pairs]),
                    torch.cat([p.b for _, p in pairs], dim=1),
                    tuple(i for i, p in pairs for _ in range(p.a.shape[0])),
                )
                if pairs
                else None
            )
        return self._stacks[layer]

    def add_delta(self, layer: torch.nn.Module, x_BTI: torch.Tensor, out_BTO: torch.Tensor) -> torch.Tensor:
        """``out_BTO`` (the base layer's output for ``x_BTI``) plus each row's adapter delta."""
        stack = self._stack(layer)
        if stack is None:
            return out_BTO
        a, b, owners = stack
        mask = self._masks.get(owners)
        if mask is None:  # row r keeps the rank columns of its own adapter
            rows = self._row_index.to(a.device)[:, None]
            mask = (rows == torch.tensor(owners, device=a.device)[None, :]).to(a.dtype)[:, None, :]
            self._masks[owners] = mask
        h = (x_BTI.to(a.dtype) @ a.T) * mask
        return out_BTO + (h @ b.T).to(out_BTO.dtype)
