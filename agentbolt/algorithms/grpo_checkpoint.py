"""GRPO's checkpoints: what a run saves every ``checkpoint_every`` steps (weights, optimizer,
step and the history of step rows, :func:`~agentbolt.algorithms.train_state.save_checkpoint`)
and how ``resume`` continues from the last one exactly, cancelling first what the interrupted
run had left queued or running."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from agentbolt.algorithms import distributed
from agentbolt.algorithms.base import TrainContext
from agentbolt.algorithms.metrics import jsonable
from agentbolt.algorithms.policy import PolicyServer
from agentbolt.algorithms.train_state import TrainState, load_checkpoint, save_checkpoint
from agentbolt.client import Client
from agentbolt.errors import InvalidTransition
from agentbolt.schemas import Mode, RolloutStatus

__all__ = ["cancel_unfinished", "resume", "save"]


def _folder(ctx: TrainContext) -> Path:
    return ctx.run_dir / "checkpoint"


def save(ctx: TrainContext, state: TrainState, step: int, history: list[dict[str, Any]]) -> None:
    save_checkpoint(_folder(ctx), state.model, state.optimizer, step, extra={"history": jsonable(history)})


def resume(ctx: TrainContext, state: TrainState, policy: PolicyServer) -> tuple[int, list[dict[str, Any]]]:
    """The step and history of the run's last checkpoint, loaded into ``state`` (on every rank)
    and served by ``policy``; ``(0, [])`` when there is none."""
    path = _folder(ctx)
    if not (path / "state.json").exists():
        return 0, []
    ckpt = load_checkpoint(path, state.model, state.optimizer)
    state.step = ckpt.step
    distributed.share_state(state)  # a full state: any number of ranks resumes from it
    policy.sync(state.model, ckpt.step)
    ctx.console.print(f"resumed from {path} at step {ckpt.step}")
    training, validation = cancel_unfinished(ctx.client, ctx.run_dir.name)
    if training or validation:
        ctx.console.print(
            f"cancelled {training} training and {validation} validation rollout(s) the "
            "interrupted run had left queued or running"
        )
    return ckpt.step, list(ckpt.extra.get("history", []))


def cancel_unfinished(client: Client, run: str) -> tuple[int, int]:
    """Cancel the queued and running rollouts the run named ``run`` (its folder's name) enqueued
    before it was interrupted: training rollouts whose group id starts with ``run:`` and
    validation rollouts whose metadata names the run (:func:`~agentbolt.algorithms.base.validate`).
    Nothing would read them once it resumes (it enqueues its groups and validation afresh), but
    runners would still claim and run them, ahead of the new ones. Rollouts of other runs on a
    shared server, and validation rollouts that name no run (enqueued by a release before it
    named them), are left alone. Returns how many of each were cancelled; one that ends
    meanwhile is skipped."""
    live = [RolloutStatus.QUEUED, RolloutStatus.RUNNING]
    training = [
        r.id
        for r in client.pages(client.list_rollouts, status=live, mode=Mode.TRAIN, limit=1000)
        if (r.group_id or "").startswith(f"{run}:")
    ]
    validation = [
        r.id
        for r in client.pages(client.list_rollouts, status=live, mode=Mode.VAL, limit=1000)
        if r.metadata.get("run") == run
    ]
    return _cancel(client, training), _cancel(client, validation)


def _cancel(client: Client, ids: list[str]) -> int:
    cancelled = 0
    for rollout_id in ids:
        with contextlib.suppress(InvalidTransition):  # it succeeded or failed since the listing
            client.cancel(rollout_id)
            cancelled += 1
    return cancelled
