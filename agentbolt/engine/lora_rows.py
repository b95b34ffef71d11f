"""Several LoRA adapters served at once over one base model, each batch row with its own.

vLLM's multi-LoRA serving (``/v1/load_lora_adapter``, a request naming the adapter as its
``model``), on the engine's own forward pass: the base weights stay as they are, and every linear
product an adapter touches adds, for the rows of that adapter, ``x @ A.T @ B.T * scale`` (the
punica/S-LoRA way of batching different adapters, done here as one pair of small products per
adapter present in the batch). Rows of the base model add nothing. With no adapter loaded the
forward pass is untouched.

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
    """The adapters loaded by name, and the rows of each in the forward pass being run."""

    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        """Name -> adapter, for new requests (a whole-dict read or write is atomic)."""
        self._rows: list[tuple[Adapter, torch.Tensor]] = []

    def select(self, rows: Sequence[Adapter | None]) -> None:
        """The adapter of each row of the next forward pass (None: the base model)."""
        self._rows = [
            (adapter, torch.tensor([i for i, r in enumerate(rows) if r is adapter]))
            for adapter in dict.fromkeys(r for r in rows if r is not None)
        ]

    @property
    def active(self) -> bool:
        return bool(self._rows)

    def add_delta(self, layer: torch.nn.Module, x_BTI: torch.Tensor, out_BTO: torch.Tensor) -> torch.Tensor:
        """``out_BTO`` (the base layer's output for ``x_BTI``) plus each row's adapter delta."""
        for adapter, rows in self._rows:
            pair = adapter.pairs.get(layer)
            if pair is None:
                continue
            whole = len(rows) == x_BTI.shape[0]
            x = (x_BTI if whole else x_BTI.index_select(0, rows)).to(pair.a.dtype)
            delta = (x @ pair.a.T) @ pair.b.T
            delta = delta.to(out_BTO.dtype)
            out_BTO = out_BTO + delta if whole else out_BTO.index_add(0, rows, delta)
        return out_BTO
