"""The rows GRPO and SFT train on and the padded tensors they become: :class:`TrainRow`,
:class:`Batch`, :func:`pad_batch`, :func:`micro_batches` and :func:`to_device`. Data only: the
log-probs and losses computed over a batch are :mod:`agentbolt.algorithms.losses`.

Shapes are in the names: ``B`` batch, ``T`` tokens. ``loss_mask_BT`` is 1 on model-generated
tokens, aligned with ``input_ids_BT`` (see :mod:`agentbolt.algorithms.losses`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from agentbolt.adapters import TrajectoryRow

__all__ = ["Batch", "TrainRow", "micro_batches", "pad_batch", "to_device"]


@dataclass(frozen=True)
class TrainRow:
    """One sequence to train on."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    old_logprobs: tuple[float, ...] | None = None
    advantage: float = 0.0
    """The sequence's advantage; with per-token ``advantages`` only a summary (their mean over
    the model tokens), the loss uses those."""
    advantages: tuple[float, ...] | None = None
    """Per token, aligned with ``input_ids`` (per-turn credit); None: ``advantage`` everywhere."""

    @classmethod
    def of(
        cls, row: TrajectoryRow, advantage: float = 0.0, advantages: tuple[float, ...] | None = None
    ) -> TrainRow:
        return cls(row.input_ids, row.loss_mask, row.logprobs, advantage, advantages)


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors of a list of :class:`TrainRow`."""

    input_ids_BT: Tensor
    attention_mask_BT: Tensor
    loss_mask_BT: Tensor
    """float, 0 on padding"""
    old_logprobs_BT: Tensor | None
    """None when no row has recorded logprobs: the loss then uses the current policy's."""
    advantages_B: Tensor
    ref_logprobs_BT: Tensor | None = None
    """Reference-policy logprobs for the KL term, see
    :func:`~agentbolt.algorithms.losses.reference_logprobs`."""
    advantages_BT: Tensor | None = None
    """Per-token advantages (0 on padding) when any row has them; the loss then uses these
    instead of ``advantages_B``."""
    recorded_B: Tensor | None = None
    """Which rows' ``old_logprobs_BT`` were recorded (bool), when only some were: the others
    hold 0 there, and the loss takes the current policy's for them alone."""

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask_BT.sum().item())


def _pad(seqs: Sequence[Sequence[float]], length: int, value: float, dtype: torch.dtype) -> Tensor:
    return torch.tensor([list(s[:length]) + [value] * (length - len(s[:length])) for s in seqs], dtype=dtype)


def pad_batch(rows: Sequence[TrainRow], pad_token_id: int = 0, max_len: int | None = None) -> Batch:
    """Right-pad rows to the longest (cut to ``max_len`` tokens, keeping the start)."""
    if not rows:
        raise ValueError("pad_batch needs at least one row")
    T = max(len(r.input_ids) for r in rows)
    T = min(T, max_len) if max_len else T
    # recorded logprobs where rows have them (and which rows, when not all do)
    recorded = [r.old_logprobs is not None for r in rows]
    old = [r.old_logprobs or () for r in rows]
    per_token = [r.advantages or (r.advantage,) * len(r.input_ids) for r in rows]
    any_per_token = any(r.advantages is not None for r in rows)
    return Batch(
        input_ids_BT=_pad([r.input_ids for r in rows], T, pad_token_id, torch.long),
        attention_mask_BT=_pad([[1] * len(r.input_ids) for r in rows], T, 0, torch.long),
        loss_mask_BT=_pad([r.loss_mask for r in rows], T, 0, torch.float32),
        old_logprobs_BT=_pad(old, T, 0.0, torch.float32) if any(recorded) else None,
        advantages_B=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        advantages_BT=_pad(per_token, T, 0.0, torch.float32) if any_per_token else None,
        recorded_B=torch.tensor(recorded) if any(recorded) and not all(recorded) else None,
    )


def micro_batches(
    rows: Sequence[TrainRow], max_tokens: int | None = None, micro_batch_size: int | None = None
) -> list[list[TrainRow]]:
    """Split rows, in order, so that each padded micro-batch has at most ``max_tokens`` tokens
    (B x longest) and ``micro_batch_size`` rows; a row longer than ``max_tokens`` goes alone."""
    out: list[list[TrainRow]] = []
    longest = 0
    for row in rows:
        n = len(row.input_ids)
        full = bool(out) and (
            (max_tokens is not None and (len(out[-1]) + 1) * max(longest, n) > max_tokens)
            or (micro_batch_size is not None and len(out[-1]) >= micro_batch_size)
        )
        if not out or full:
            out.append([])
            longest = 0
        out[-1].append(row)
        longest = max(longest, n)
    return out


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every tensor on ``device`` (the trainer's; rows are padded on the CPU)."""
    tensors = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, Tensor)})
