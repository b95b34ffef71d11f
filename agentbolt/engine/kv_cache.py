"""The batch's KV cache: a ``DynamicCache`` whose rows can be merged, dropped and trimmed.

Rows are left-padded to one length. ``transformers``' ``DynamicLayer`` concatenates every new
token onto the whole cache (a full copy per layer per step: 14% of a decode step for 32 sequences
here); ``GrowingLayer`` writes into a buffer with spare room instead and hands out a view. Any
outside change to ``keys``/``values`` (row selection, merging, trimming) replaces the tensors; the
next ``update`` sees that they are no longer a view of its buffer and starts a new one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = [
    "GrowingLayer",
    "append_column",
    "cache_with_prefix",
    "cut_left",
    "merge_rows",
    "new_cache",
    "row_columns",
    "select_rows",
]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place into a buffer grown by 1.5x when full."""

    keys: torch.Tensor  # set by lazy_initialization before use
    values: torch.Tensor
    _buf_k: torch.Tensor | None = None
    _buf_v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.numel() else 0
        new = old + key_states.shape[-2]
        if not self._owns_buffer(key_states, new):
            self._regrow(key_states, value_states, old, new)
        assert self._buf_k is not None and self._buf_v is not None
        self._buf_k[:, :, old:new].copy_(key_states)
        self._buf_v[:, :, old:new].copy_(value_states)
        self.keys, self.values = self._buf_k[:, :, :new], self._buf_v[:, :, :new]
        return self.keys, self.values

    def append_column(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Room for one more column, for a caller that writes it itself (the engine's decode-step
        kernel): the whole key and value buffers and the column to write; ``keys``/``values``
        already include it. None before the first ``update``."""
        if not self.is_initialized or not self.keys.numel():
            return None
        old = self.keys.shape[-2]
        if not self._owns_buffer(self.keys, old + 1):
            self._regrow(self.keys, self.values, old, old + 1)
        assert self._buf_k is not None and self._buf_v is not None
        self.keys, self.values = self._buf_k[:, :, : old + 1], self._buf_v[:, :, : old + 1]
        return self._buf_k, self._buf_v, old

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole key and value buffers (rows x heads x capacity x dim) that ``keys`` and
        ``values`` are the first columns of, or None when they are not (yet) such views."""
        buf_k, buf_v = self._buf_k, self._buf_v
        if buf_k is None or buf_v is None or self.keys.data_ptr() != buf_k.data_ptr():
            return None
        if self.keys.stride() != buf_k.stride() or self.values.data_ptr() != buf_v.data_ptr():
            return None
        return buf_k, buf_v

    def _owns_buffer(self, key_states: torch.Tensor, needed: int) -> bool:
        buf = self._buf_k
        if buf is None or buf.shape[-2] < needed or buf.shape[:2] != key_states.shape[:2]:
            return False
        return self.keys.numel() == 0 or (
            self.keys.data_ptr() == buf.data_ptr() and self.keys.stride() == buf.stride()
        )

    def _regrow(self, key_states: torch.Tensor, value_states: torch.Tensor, old: int, new: int) -> None:
        capacity = max(new + 32, new * 3 // 2)
        b, h, _, d = key_states.shape
        # zeros, not empty: whole-buffer attention (agentbolt.engine.forward) multiplies the
        # columns past the end by a zero weight, which must not meet NaN or inf
        self._buf_k = key_states.new_zeros(b, h, capacity, d)
        self._buf_v = value_states.new_zeros(b, h, capacity, value_states.shape[-1])
        if old:
            self._buf_k[:, :, :old].copy_(self.keys)
            self._buf_v[:, :, :old].copy_(self.values)


def new_cache() -> Any:
    cache = DynamicCache()
    if hasattr(cache, "layer_class_to_replicate"):  # otherwise: plain DynamicLayers, still correct
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def cache_with_prefix(prefix: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> Any:
    """A cache of ``rows`` rows that all start with the same keys and values (one row per layer)."""
    cache = new_cache()
    for keys, values in prefix:
        layer = GrowingLayer()
        layer.lazy_initialization(keys, values)
        layer.keys = keys.expand(rows, -1, -1, -1)  # copied into the layer's buffer at its first update
        layer.values = values.expand(rows, -1, -1, -1)
        cache.layers.append(layer)
    return cache


def row_columns(cache: Any, row: int, columns: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one row's keys and values at ``columns``, per layer (a prefix to reuse)."""
    return [
        (layer.keys[row : row + 1, :, columns].clone(), layer.values[row : row + 1, :, columns].clone())
        for layer in cache.layers
    ]


def append_column(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``GrowingLayer.append_column`` of layer ``i``, or None where the cache holds no such layer yet."""
    layers = getattr(cache, "layers", [])
    layer = layers[i] if i < len(layers) else None
    return layer.append_column() if isinstance(layer, GrowingLayer) else None


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    cache.batch_select_indices(rows)


def merge_rows(cache: Any, other: Any, width: int) -> None:
    """Append ``other``'s rows to ``cache``, both left-padded to ``width`` positions."""
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        mine.keys = torch.cat([pad_left(mine.keys, width), pad_left(theirs.keys, width)])
        mine.values = torch.cat([pad_left(mine.values, width), pad_left(theirs.values, width)])


def cut_left(cache: Any, columns: int) -> None:
    """Drop the first ``columns`` positions of every row (padding no row uses any more)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]


def pad_left(t_BHLD: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t_BHLD, (0, 0, width - t_BHLD.shape[2], 0))
