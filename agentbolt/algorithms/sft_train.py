"""The pure parts of SFT: which runs to keep, their rows, the training passes and the loss.

Small functions over rows and a :class:`~agentbolt.algorithms.train_state.TrainState`; no store and
no engine (those live in :mod:`agentbolt.algorithms.sft`).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agentbolt.adapters import TrajectoryRow
from agentbolt.algorithms import distributed
from agentbolt.algorithms.batch import TrainRow, micro_batches, pad_batch
from agentbolt.algorithms.losses import sft_loss
from agentbolt.algorithms.rewards import AGENT, RewardChoice, resolve
from agentbolt.algorithms.train_state import TrainState, optimizer_step
from agentbolt.schemas import Rollout, RolloutStatus

__all__ = ["TrainStats", "eval_loss", "select_rollouts", "sft_rows", "train_rows"]


# ---------------------------------------------------------------------------- selection and rows


def select_rollouts(
    rollouts: Sequence[Rollout],
    min_reward: float | None,
    top_fraction: float = 1.0,
    reward: RewardChoice = AGENT,
) -> list[Rollout]:
    """Succeeded rollouts whose chosen ``reward`` has a value >= ``min_reward`` and ranks within
    the best ``ceil(top_fraction * runs)`` of their task (all runs of the task counted, ties by
    order). A pending reward is no value: such a run is not kept (nor counted as a bad one)."""
    by_task: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_task.setdefault(r.task.id, []).append(r)
    kept: list[Rollout] = []
    for runs in by_task.values():
        valued = [
            (r, v)
            for r in runs
            if r.status == RolloutStatus.SUCCEEDED and (v := resolve(r, reward).value) is not None
        ]
        best = sorted(valued, key=lambda rv: -rv[1])[: math.ceil(top_fraction * len(runs))]
        kept += [r for r, v in best if min_reward is None or v >= min_reward]
    return kept


def sft_rows(rows: Sequence[TrajectoryRow]) -> tuple[list[TrainRow], int]:
    """Training rows (no logprobs, no advantage) without exact duplicates or rows with nothing
    to learn; returns the rows and how many duplicates were dropped."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out: list[TrainRow] = []
    duplicates = 0
    for row in rows:
        key = (row.input_ids, row.loss_mask)
        if key in seen:
            duplicates += 1
        elif row.num_model_tokens:
            seen.add(key)
            out.append(TrainRow(row.input_ids, row.loss_mask))
    return out, duplicates


# ---------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainStats:
    steps: int
    model_tokens: int
    """Loss-bearing (model-generated) tokens trained on, summed over epochs."""
    input_tokens: int
    """Every non-padding token passed forward and backward, summed over epochs."""
    seconds: float
    loss_first: float | None
    """Mean loss of the first epoch."""
    loss_last: float | None
    """Mean loss of the last epoch."""

    @property
    def tokens_per_s(self) -> float:
        return self.input_tokens / self.seconds if self.seconds else 0.0


def _epoch_batches(rows: Sequence[TrainRow], batch_size: int, rng: random.Random) -> list[list[TrainRow]]:
    order = list(rows)
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def train_rows(
    state: TrainState,
    rows: Sequence[TrainRow],
    *,
    epochs: int = 1,
    batch_size: int = 8,
    max_tokens: int = 4096,
    max_len: int | None = None,
    pad_id: int = 0,
    seed: int = 0,
    bf16: bool = False,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> TrainStats:
    """``epochs`` shuffled passes of SFT loss over ``rows``: one optimizer step per
    ``batch_size`` rows, accumulated over micro-batches of at most ``max_tokens`` padded tokens."""
    rng = random.Random(seed)
    losses: list[list[float]] = []
    steps = model_tokens = input_tokens = 0
    started = time.perf_counter()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    for _ in range(epochs):
        losses.append([])
        for chunk in _epoch_batches(rows, batch_size, rng):
            batches = [pad_batch(mb, pad_id, max_len) for mb in micro_batches(chunk, max_tokens=max_tokens)]
            if distributed.leading():  # rank 0 of several: the micro-batches go to every rank
                metrics = distributed.update(state, batches, sft_loss, bf16=bf16)
            else:
                with autocast:
                    metrics = optimizer_step(state, batches, sft_loss)
            steps += 1
            model_tokens += int(metrics["num_tokens"])
            input_tokens += sum(int(b.attention_mask_BT.sum()) for b in batches)
            if metrics["num_tokens"]:
                losses[-1].append(metrics["loss"])
            if on_step:
                on_step(metrics)
    mean = [sum(e) / len(e) if e else None for e in losses]
    seconds = time.perf_counter() - started
    return TrainStats(
        steps, model_tokens, input_tokens, seconds, mean[0] if mean else None, mean[-1] if mean else None
    )


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    rows: Sequence[TrainRow],
    max_tokens: int = 4096,
    pad_id: int = 0,
    max_len: int | None = None,
) -> float:
    """Mean next-token loss over the model tokens of ``rows`` (token-weighted), no gradient."""
    was_training = model.training
    model.eval()
    total = count = 0.0
    for mb in micro_batches(rows, max_tokens=max_tokens):
        batch = pad_batch(mb, pad_id, max_len)
        loss, _ = sft_loss(model, batch, num_tokens=1.0)  # a sum: divided once below
        total, count = total + float(loss), count + batch.num_tokens
    model.train(was_training)
    return total / max(count, 1.0)
