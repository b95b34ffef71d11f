"""Credit assignment: which tokens of a group's trajectories get which advantage.

A *sample* is one attempt of one rollout (``rollout_id``, ``attempt_id``); a sample split into
several rows (prefix mismatches, see :mod:`agentbolt.adapters`) counts once, and its turns stay
in order across its rows. A *turn* is one model call: the :class:`~agentbolt.adapters.CallSpan`
``[start, end)`` of its row. Samples are grouped by ``group_id`` (else ``task_id``, else each
alone). For sample ``i`` with rollout reward ``R_i`` and turns ``t = 0..T_i-1`` with per-call
rewards ``s_t`` (0 when the call has none):

- reward of a turn: ``r_t = s_t``, plus ``R_i`` on the last turn;
- return of a turn: ``G_t = sum_{k >= t} gamma^(k - t) r_k``;
- episode return: ``E_i = R_i + sum_t s_t`` (``= G_0`` when ``gamma = 1``);
- ``norm(x; X) = (x - mean(X)) / (std(X) + eps)``, population std; with ``normalize_std=False``
  just ``x - mean(X)`` (the Dr. GRPO variant).

The three modes (:func:`compute_advantages`):

- ``rollout`` (GRPO, Shao et al. 2024): ``A_i = norm(E_i; E of the group)`` for every model
  token of the sample. Without per-call rewards ``E_i = R_i``: GRPO's advantage exactly.
- ``turn``: each turn is compared with the turns of the group that faced the same situation. A
  turn's *situation* is the exact prompt its call was given (the row's tokens before the call's
  completion, the whole history included), its *action* the completion's tokens. With ``S`` the
  group's turns in turn ``t``'s situation, ``V = mean(G; S)`` and ``Q = mean(G; the turns of
  S that took t's action)``: ``A_t = (Q - V) / (std(G; S) + eps)`` (``Q - V`` without
  ``normalize_std``). Identical calls thus get identical credit, whatever happened after them
  in their own episode, and only a turn that acted differently from the others in its
  situation is pushed up or down. A situation no other turn of the group shares (histories
  that diverged) falls back to the turns at the same turn index: ``S`` those, ``Q = G_t`` (one
  baseline per position, never pooled over positions). The tokens of turn ``t`` get ``A_t``.
  Per-turn credit is only as sound as those comparisons: past a divergence, a turn's return
  still carries its own episode's later outcome.
- ``gigpo`` (Feng et al. 2025, "Group-in-Group Policy Optimization"):
  ``A_t = A_episode(i) + step_weight * A_step(t)``, ``A_episode`` the ``rollout`` advantage and
  ``A_step(t) = norm(G_t; G of the group's turns declared in the same state as t)`` (the *anchor
  group* of t). A turn with no declared state, alone in its anchor group, or in an anchor group
  whose returns are all equal gets ``A_step = 0``.

Where this departs from GiGPO: the paper forms anchor groups from environment states that are
identical across the group's trajectories (it hashes the observation). Here the agent declares
each turn's state itself (:func:`agentbolt.emit_state`, a ``state`` event naming the call): the
rendered prompt of a multi-turn run carries its whole history and never repeats, so hashing it
finds no anchors. The discounted return ``G_t`` is the paper's; turns of one sample that share a
state (a loop) all join the anchor group, as in the paper.

Groups whose values all agree carry no signal and are skipped (and counted): ``rollout`` when
every ``E_i`` is equal, ``turn`` when every ``A_t`` is 0, ``gigpo`` when every ``E_i`` is and no
anchor group has a spread. Groups of a single sample are skipped in every mode. Rows whose
rollout reward is None are left out (and counted), as are the per-call rewards of calls that
the adapters skipped (no token ids).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from agentbolt.adapters import CallSpan, TrajectoryRow
from agentbolt.algorithms.batch import TrainRow
from agentbolt.algorithms.losses import group_advantages

__all__ = ["ADVANTAGE_MODES", "AdvantageMode", "CreditStats", "compute_advantages", "grouped_advantages"]

AdvantageMode = Literal["rollout", "turn", "gigpo"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)


@dataclass(frozen=True)
class CreditStats:
    """What :func:`compute_advantages` saw and produced."""

    groups: int = 0
    zero_spread_groups: int = 0
    """Groups skipped: every value equal, or a single sample."""
    rows: int = 0
    """Rows returned."""
    no_reward_rows: int = 0
    """Rows skipped because their reward is None."""
    samples: int = 0
    """Rewarded samples (attempts), skipped groups included."""
    turns: int = 0
    """Turns of those samples."""
    anchor_groups: int = 0
    """``gigpo``: anchor groups with at least two turns and a spread of returns."""
    step_reward_by_turn: tuple[float, ...] = ()
    """Mean per-call reward at each turn index (0 for a call without one), over the samples
    that reached that turn."""
    step_reward_mean: float = 0.0
    """Mean per-call reward over all turns (0 for a call without one)."""
    turn_adv_mean: float = 0.0
    """Mean advantage over the trained turns (``rollout``: the sample's, once per turn)."""
    turn_adv_std: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """The per-step metrics GRPO records."""
        return {
            "turns_mean": self.turns / self.samples if self.samples else 0.0,
            "step_reward_mean": self.step_reward_mean,
            "turn_adv_mean": self.turn_adv_mean,
            "turn_adv_std": self.turn_adv_std,
            "turn_reward_by_index": list(self.step_reward_by_turn),
            "anchor_groups": self.anchor_groups,
        }


@dataclass
class _Turn:
    row: int
    """Index of the row (within the sample) the turn's tokens are in."""
    span: CallSpan | None
    """None: a row without call spans counts as one turn covering all its tokens."""

    @property
    def step_reward(self) -> float:
        return (self.span.step_reward or 0.0) if self.span is not None else 0.0

    @property
    def state(self) -> str | None:
        return self.span.state if self.span is not None else None


@dataclass
class _Sample:
    rows: list[TrajectoryRow]
    reward: float
    turns: list[_Turn]

    @property
    def episode_return(self) -> float:
        return self.reward + sum(t.step_reward for t in self.turns)

    def situation(self, t: int) -> Any:
        """Turn ``t``'s situation: the exact prompt of its call (its row's tokens before the
        completion); a row without call spans is a situation of its own."""
        turn = self.turns[t]
        if turn.span is None:
            return ("row", id(self), t)
        return tuple(self.rows[turn.row].input_ids[: turn.span.start])

    def action(self, t: int) -> Any:
        """Turn ``t``'s action: its completion's tokens."""
        turn = self.turns[t]
        if turn.span is None:
            return ("row", id(self), t)
        return tuple(self.rows[turn.row].input_ids[turn.span.start : turn.span.end])

    def returns(self, gamma: float) -> list[float]:
        """``G_t`` of each turn: per-call rewards, the rollout reward on the last turn, discounted."""
        rewards = [t.step_reward for t in self.turns]
        rewards[-1] += self.reward
        out, running = [0.0] * len(rewards), 0.0
        for t in reversed(range(len(rewards))):
            running = rewards[t] + gamma * running
            out[t] = running
        return out


def _group_key(row: TrajectoryRow) -> str:
    return row.group_id or row.task_id or f"rollout:{row.rollout_id}"


def _samples(rows: Sequence[TrajectoryRow]) -> dict[str, list[_Sample]]:
    """Rewarded rows as samples, by group; a sample's rows in segment order."""
    by_sample: dict[str, dict[tuple[str, str], list[TrajectoryRow]]] = {}
    for row in rows:
        if row.reward is not None:
            key = (row.rollout_id, row.attempt_id)
            by_sample.setdefault(_group_key(row), {}).setdefault(key, []).append(row)
    groups: dict[str, list[_Sample]] = {}
    for group, samples in by_sample.items():
        for sample_rows in samples.values():
            ordered = sorted(sample_rows, key=lambda r: r.segment_index)
            turns = [_Turn(i, span) for i, row in enumerate(ordered) for span in (row.calls or (None,))]
            reward = ordered[0].reward
            assert reward is not None
            groups.setdefault(group, []).append(_Sample(ordered, reward, turns))
    return groups


def _norm(values: Sequence[float], eps: float, normalize_std: bool) -> list[float]:
    if not _spread(values):  # all equal: 0 each (not 0 / eps, nor 0 / 0 with eps 0)
        return [0.0] * len(values)
    return group_advantages(torch.tensor(values, dtype=torch.float64), eps, normalize_std).tolist()


def _spread(values: Sequence[float]) -> bool:
    return bool(values) and max(values) - min(values) > 0.0


def _turn_advantages(
    samples: list[_Sample],
    mode: AdvantageMode,
    gamma: float,
    step_weight: float,
    eps: float,
    normalize_std: bool,
) -> tuple[list[list[float]] | None, int]:
    """Each sample's per-turn advantages, or None when the group has no signal; and the number
    of anchor groups that gave one (``gigpo``)."""
    if len(samples) < 2:
        return None, 0
    episode = [s.episode_return for s in samples]
    if mode == "rollout":
        if not _spread(episode):
            return None, 0
        return [
            [a] * len(s.turns) for s, a in zip(samples, _norm(episode, eps, normalize_std), strict=True)
        ], 0
    returns = [s.returns(gamma) for s in samples]
    if mode == "turn":
        advantages = _situation_advantages(samples, returns, eps, normalize_std)
        if not any(a != 0.0 for turns in advantages for a in turns):
            return None, 0
        return advantages, 0
    anchors: dict[str, list[tuple[int, int]]] = {}
    for i, s in enumerate(samples):
        for t, turn in enumerate(s.turns):
            if turn.state is not None:
                anchors.setdefault(turn.state, []).append((i, t))
    step = [[0.0] * len(s.turns) for s in samples]
    anchor_groups = 0
    for members in anchors.values():
        values = [returns[i][t] for i, t in members]
        if len(members) < 2 or not _spread(values):
            continue
        anchor_groups += 1
        for (i, t), a in zip(members, _norm(values, eps, normalize_std), strict=True):
            step[i][t] = a
    if not _spread(episode) and not anchor_groups:
        return None, 0
    episode_adv = _norm(episode, eps, normalize_std)
    return [
        [e + step_weight * a for a in steps] for e, steps in zip(episode_adv, step, strict=True)
    ], anchor_groups


def _situation_advantages(
    samples: list[_Sample], returns: list[list[float]], eps: float, normalize_std: bool
) -> list[list[float]]:
    """``turn`` mode's advantages (see the module docstring): each turn against the turns of the
    group in the same situation, identical actions pooled; a situation no other turn shares
    against the turns at the same index."""
    keys = [[sample.situation(t) for t in range(len(sample.turns))] for sample in samples]
    actions = [[sample.action(t) for t in range(len(sample.turns))] for sample in samples]
    situations: dict[Any, list[tuple[int, int]]] = {}
    positions: dict[int, list[tuple[int, int]]] = {}
    for i, sample in enumerate(samples):
        for t in range(len(sample.turns)):
            situations.setdefault(keys[i][t], []).append((i, t))
            positions.setdefault(t, []).append((i, t))
    out = [[0.0] * len(s.turns) for s in samples]
    for i, sample in enumerate(samples):
        for t in range(len(sample.turns)):
            shared = situations[keys[i][t]]
            members = shared if len(shared) > 1 else positions[t]
            values = [returns[j][k] for j, k in members]
            if not _spread(values):
                continue
            if len(shared) > 1:
                same = [returns[j][k] for j, k in shared if actions[j][k] == actions[i][t]]
                q = sum(same) / len(same)
            else:
                q = returns[i][t]
            mean, std = _mean_std(values)
            out[i][t] = (q - mean) / (std + eps) if normalize_std else q - mean
    return out


def _train_rows(sample: _Sample, advantages: list[float], per_token: bool) -> list[TrainRow]:
    if not per_token:  # one advantage for the whole sample
        return [TrainRow.of(row, advantages[0] if advantages else 0.0) for row in sample.rows]
    per_row: list[list[float]] = [[0.0] * len(row.input_ids) for row in sample.rows]
    for turn, a in zip(sample.turns, advantages, strict=True):
        if turn.span is None:
            per_row[turn.row] = [a] * len(per_row[turn.row])
        else:
            per_row[turn.row][turn.span.start : turn.span.end] = [a] * (turn.span.end - turn.span.start)
    out = []
    for row, values in zip(sample.rows, per_row, strict=True):
        trained = [v for v, m in zip(values, row.loss_mask, strict=True) if m]
        summary = sum(trained) / len(trained) if trained else 0.0
        out.append(TrainRow.of(row, summary, tuple(values)))
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def compute_advantages(
    rows: Sequence[TrajectoryRow],
    mode: AdvantageMode = "rollout",
    gamma: float = 1.0,
    step_weight: float = 1.0,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> tuple[list[TrainRow], CreditStats]:
    """Train rows of the groups with a signal, with advantages by ``mode`` (see the module
    docstring for the formulas). ``rollout`` gives each row one scalar advantage; ``turn`` and
    ``gigpo`` give per-token advantages (``TrainRow.advantages``: turn ``t``'s tokens get
    ``A_t``, every other position 0). Rows come out by group and sample, a sample's rows in
    segment order."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode must be one of {', '.join(ADVANTAGE_MODES)}; got {mode!r}")
    groups = _samples(rows)
    out: list[TrainRow] = []
    zero_spread = anchor_groups = 0
    trained_advantages: list[float] = []
    for samples in groups.values():
        advantages, anchors = _turn_advantages(samples, mode, gamma, step_weight, eps, normalize_std)
        if advantages is None:
            zero_spread += 1
            continue
        anchor_groups += anchors
        for sample, sample_advantages in zip(samples, advantages, strict=True):
            out += _train_rows(sample, sample_advantages, per_token=mode != "rollout")
            trained_advantages += sample_advantages
    all_samples = [s for samples in groups.values() for s in samples]
    step_rewards = [[t.step_reward for t in s.turns] for s in all_samples]
    longest = max((len(r) for r in step_rewards), default=0)
    by_turn = tuple(_mean_std([r[t] for r in step_rewards if len(r) > t])[0] for t in range(longest))
    adv_mean, adv_std = _mean_std(trained_advantages)
    stats = CreditStats(
        groups=len(groups),
        zero_spread_groups=zero_spread,
        rows=len(out),
        no_reward_rows=sum(1 for r in rows if r.reward is None),
        samples=len(all_samples),
        turns=sum(len(s.turns) for s in all_samples),
        anchor_groups=anchor_groups,
        step_reward_by_turn=by_turn,
        step_reward_mean=_mean_std([x for r in step_rewards for x in r])[0],
        turn_adv_mean=adv_mean,
        turn_adv_std=adv_std,
    )
    return out, stats


def grouped_advantages(
    rows: Sequence[TrajectoryRow], eps: float = 1e-6, normalize_std: bool = True
) -> tuple[list[TrainRow], CreditStats]:
    """GRPO's per-sample advantages: :func:`compute_advantages` in ``rollout`` mode."""
    return compute_advantages(rows, "rollout", eps=eps, normalize_std=normalize_std)
