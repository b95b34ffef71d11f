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
from typing import Any

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

    The products for a batch do not depend on how many adapters it mixes: ``x`` times every
    adapter's ``a`` stacked, for the layers that share ``x`` at once (``h``: each row gets every
    adapter's rank columns), ``h`` masked to the row's own adapter's columns, times each layer's
    ``b`` stacked. No rows are gathered or scattered; the extra work is the other adapters' few
    rank columns per row."""

    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        """Name -> adapter, for new requests (a whole-dict read or write is atomic)."""
        self._active: list[Adapter] = []
        self._row_index = torch.zeros(0, dtype=torch.long)
        self._key: tuple[int, ...] = ()
        self._stacks: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None] = {}
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._groups: dict[tuple[torch.nn.Module, ...], Any] = {}

    def select(self, rows: Sequence[Adapter | None]) -> None:
        """The adapter of each row of the next forward pass (None: the base model)."""
        self._active = list(dict.fromkeys(r for r in rows if r is not None))
        self._masks = {}
        if not self._active:
            return
        key = tuple(id(a) for a in self._active)
        if key != self._key:  # another set of adapters: stack their layers anew
            self._key, self._stacks, self._groups = key, {}, {}
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

    def add_deltas(
        self, layers: Sequence[torch.nn.Module], x_BTI: torch.Tensor, outs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``outs`` (the base layers' outputs for the same ``x_BTI``: a layer's q, k and v, or
        gate and up) plus each row's adapter deltas: one product for every ``a`` of the layers
        together, then one per layer for its ``b``."""
        key = tuple(layers)
        group = self._groups.get(key)
        if group is None:
            stacks = [(i, st) for i, layer in enumerate(layers) if (st := self._stack(layer)) is not None]
            edges = [0]
            for _, (a, _b, _o) in stacks:
                edges.append(edges[-1] + a.shape[0])
            group = self._groups[key] = (
                (
                    torch.cat([a for _, (a, _b, _o) in stacks]),
                    stacks,
                    edges,
                    sum((o for _, (_a, _b, o) in stacks), ()),
                )
                if stacks
                else None
            )
        if group is None:
            return outs
        a_all, stacks, edges, owners = group
        mask = self._masks.get(owners)
        if mask is None:  # row r keeps the rank columns of its own adapter
            rows = self._row_index.to(a_all.device)[:, None]
            mask = (rows == torch.tensor(owners, device=a_all.device)[None, :]).to(a_all.dtype)[:, None, :]
            self._masks[owners] = mask
        h = (x_BTI.to(a_all.dtype) @ a_all.T) * mask
        outs = list(outs)
        for n, (i, (_a, b, _o)) in enumerate(stacks):
            outs[i] = outs[i] + (h[..., edges[n] : edges[n + 1]] @ b.T).to(outs[i].dtype)
        return outs
