"""From a GRPO step's finished rollouts to what it trains on and reports: the groups that are
big enough, their rollouts' token rows with advantages (:mod:`agentbolt.adapters` turns each
rollout's ``llm_call`` events into rows with the gateway's exact ids and masks,
:mod:`agentbolt.algorithms.credit` gives them advantages), in asynchronous mode without the
samples too stale to train on, and the reward columns of the step's row."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentbolt.adapters import STATE_EVENT, AdapterStats, TrajectoryRow, latest_attempt, to_trajectories
from agentbolt.algorithms.async_grpo import InFlightGroup, version_lag
from agentbolt.algorithms.base import BatchResult
from agentbolt.algorithms.batch import TrainRow
from agentbolt.algorithms.claims import CLAIM_EVENTS, claim_counts
from agentbolt.algorithms.credit import compute_advantages
from agentbolt.algorithms.grpo_config import GRPOConfig
from agentbolt.algorithms.importance import behaviour_version
from agentbolt.algorithms.rewards import tally
from agentbolt.algorithms.roles import role_calls
from agentbolt.client import Client
from agentbolt.schemas import Event, Rollout, Task

__all__ = ["StepRows", "fresh_rows", "groups", "reward_stats", "rows_of", "step_rows", "success_rate"]

# the events a rollout's training rows are built from
_TRAINING_EVENTS = ["llm_call", "reward", STATE_EVENT, *CLAIM_EVENTS]


@dataclass
class StepRows:
    """What one step trains on (``rows``), the model tokens its rollouts generated, and the
    columns of the step's row that describe them (``data``)."""

    rows: list[TrainRow]
    gen_tokens: int
    data: dict[str, Any]


def groups(batch: BatchResult, min_group_size: int) -> dict[str, list[Rollout]]:
    """The succeeded rollouts with a chosen reward (none pending or in error) of each group
    that has at least ``min_group_size`` of them."""
    finished: dict[str, list[Rollout]] = defaultdict(list)
    for r in batch.scored:
        if r.group_id:
            finished[r.group_id].append(r)
    return {g: rs for g, rs in finished.items() if len(rs) >= min_group_size}


def _events(client: Client, kept: dict[str, list[Rollout]]) -> dict[str, list[Event]]:
    return client.events_of([r.id for rs in kept.values() for r in rs], type=_TRAINING_EVENTS)


def step_rows(config: GRPOConfig, client: Client, batch: BatchResult, tasks: Sequence[Task]) -> StepRows:
    """Synchronous mode: the rows of every group of ``tasks`` big enough to train on."""
    kept = groups(batch, config.min_group_size)
    out = rows_of(config, kept, batch, _events(client, kept))
    out.data["dropped_groups"] = len(tasks) - len(kept)
    return out


def rows_of(
    config: GRPOConfig, kept: dict[str, list[Rollout]], batch: BatchResult, events: dict[str, list[Event]]
) -> StepRows:
    """The rows of the ``kept`` groups' rollouts, with the advantages ``config`` asks for;
    ``skipped_no_ids`` counts their model calls recorded without token ids (nothing to train
    on: :class:`~agentbolt.adapters.AdapterStats`)."""
    traj_rows: list[TrajectoryRow] = []
    gen_tokens = other_roles = 0
    adapter = AdapterStats()
    for rollouts in kept.values():
        for r in rollouts:
            # Only the attempt that finished: a retried rollout's lost attempt may have made
            # model calls too, and its reward is not theirs. Only this policy's role's calls.
            own, left_out = role_calls(latest_attempt(events[r.id]), config.llm_resource)
            other_roles += left_out
            rows, stats = to_trajectories(own, reward=batch.value(r), group_id=r.group_id, task_id=r.task.id)
            traj_rows += rows
            adapter += stats
            gen_tokens += sum(row.num_model_tokens for row in rows)
    train_rows, adv = compute_advantages(traj_rows, config.advantage, config.gamma, config.step_weight)
    data = {
        "samples": len({(row.rollout_id, row.attempt_id) for row in traj_rows}),
        "groups": adv.groups,
        "zero_spread_groups": adv.zero_spread_groups,
        "prefix_mismatches": adapter.prefix_mismatches,
        "skipped_no_ids": adapter.skipped_no_ids,
        "other_roles_calls": other_roles,
        **adv.metrics(),
        # the program's own grade against the reward trained on: a reward-hacking signal
        **claim_counts({r.id: events[r.id] for rs in kept.values() for r in rs}),
    }
    return StepRows(train_rows, gen_tokens, data)


def fresh_rows(
    config: GRPOConfig, client: Client, batch: BatchResult, taken: list[InFlightGroup], synced: list[int]
) -> StepRows:
    """Asynchronous mode: the rows of the taken groups without their stale samples. A sample's
    lag is the number of policy versions served after its behaviour version (the oldest that
    generated any of its tokens; the group's version at enqueue time when its calls reported
    none); a sample lagging more than ``max_staleness`` is dropped."""
    finished = groups(batch, config.min_group_size)
    events = _events(client, finished)
    enqueued_at = {g.group_id: g.policy_version for g in taken}
    lags: Counter[int] = Counter()
    fresh: dict[str, list[Rollout]] = {}
    for group_id, rollouts in finished.items():
        for r in rollouts:
            seen = behaviour_version(role_calls(latest_attempt(events[r.id]), config.llm_resource)[0])
            lag = version_lag(synced, seen if seen is not None else enqueued_at.get(group_id, synced[-1]))
            lags[lag] += 1
            if lag <= config.max_staleness:
                fresh.setdefault(group_id, []).append(r)
    kept = {g: rs for g, rs in fresh.items() if len(rs) >= config.min_group_size}
    out = rows_of(config, kept, batch, events)
    out.data.update(dropped_groups=len(taken) - len(kept), **_staleness(lags, config.max_staleness))
    return out


def _staleness(lags: Counter[int], max_staleness: int) -> dict[str, Any]:
    return {
        "stale_dropped": sum(n for lag, n in lags.items() if lag > max_staleness),
        "staleness_hist": {str(lag): n for lag, n in sorted(lags.items())},
        "staleness_mean": sum(lag * n for lag, n in lags.items()) / max(1, sum(lags.values())),
    }


# ---------------------------------------------------------------------------- reward columns


def success_rate(batch: BatchResult, threshold: float) -> float:
    """Share of rollouts (failed ones included) whose chosen reward reached ``threshold``; those
    whose reward is pending or could not be given are left out (no outcome yet, not a failure)."""
    counts = tally(batch.rollouts, batch.reward)
    judged = len(batch.rollouts) - counts.pending - counts.errors
    if not judged:
        return 0.0
    ok = sum(1 for v in batch.values if v >= threshold)
    return ok / judged


def reward_stats(batch: BatchResult, threshold: float) -> dict[str, Any]:
    """The step row's columns about the batch's rewards and rollouts."""
    rewards = batch.values
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
    return {
        "reward_mean": mean,
        "reward_std": std,
        "success": success_rate(batch, threshold),
        "rollouts": len(batch.rollouts),
        "failed": len(batch.failed),
        "timed_out": batch.timed_out,
        "retried": sum(1 for r in batch.rollouts if r.attempts > 1),
        **tally(batch.rollouts, batch.reward).metrics(),
        **batch.evaluation_metrics(),
    }
