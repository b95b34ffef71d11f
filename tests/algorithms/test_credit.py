"""Credit assignment on hand-made trajectories: every expected advantage is worked out here."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import LlamaForCausalLM

from agentbolt.adapters import CallSpan, TrajectoryRow
from agentbolt.algorithms.credit import compute_advantages
from agentbolt.algorithms.grpo import GRPO
from agentbolt.algorithms.losses import PolicyLoss, TrainRow, pad_batch, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

_event_ids = itertools.count(1)

Turn = tuple[float | None, str | None]
"""(per-call reward, declared state) of one turn."""


def row(
    rollout: str,
    reward: float | None,
    turns: Sequence[Turn],
    group: str = "g",
    segment: int = 0,
    tokens_per_turn: int = 2,
) -> TrajectoryRow:
    """A prompt token 1, then per turn: one context token 2 and ``tokens_per_turn`` model tokens."""
    ids, mask, spans = [1], [0], []
    for step_reward, state in turns:
        ids.append(2)
        mask.append(0)
        start = len(ids)
        ids += [10 + len(spans)] * tokens_per_turn
        mask += [1] * tokens_per_turn
        spans.append(CallSpan(next(_event_ids), 0, start, len(ids), reward, step_reward, state))
    return TrajectoryRow(rollout, "at", segment, tuple(ids), tuple(mask), None, reward, tuple(spans), group)


def turn_values(train_row: TrainRow, source: TrajectoryRow) -> list[float]:
    """The advantage each turn's tokens got (all of a turn's tokens must agree)."""
    assert train_row.advantages is not None and len(train_row.advantages) == len(source.input_ids)
    out = []
    for span in source.calls:
        values = set(train_row.advantages[span.start : span.end])
        assert len(values) == 1, values
        out.append(values.pop())
    # every token outside the turns is 0
    inside = {i for s in source.calls for i in range(s.start, s.end)}
    assert all(a == 0.0 for i, a in enumerate(train_row.advantages) if i not in inside)
    return out


# ---------------------------------------------------------------------------- rollout mode


def test_rollout_mode_is_grpo_on_the_episode_return() -> None:
    rows = [
        row("a", 1.0, [(None, None), (None, None)]),
        row("b", 0.0, [(None, None)]),
        row("c", 0.0, [(0.25, None), (0.25, None)]),  # episode return 0 + 0.25 + 0.25 = 0.5
    ]
    out, stats = compute_advantages(rows, "rollout", eps=0.0)
    # returns 1, 0, 0.5: mean 0.5, population std sqrt((0.25 + 0.25 + 0) / 3) = sqrt(1/6)
    std = math.sqrt(1 / 6)
    assert [r.advantage for r in out] == pytest.approx([0.5 / std, -0.5 / std, 0.0])
    assert all(r.advantages is None for r in out)  # one scalar per sample
    assert [r.input_ids for r in out] == [r.input_ids for r in rows]
    assert (stats.groups, stats.zero_spread_groups, stats.samples, stats.turns) == (1, 0, 3, 5)
    # per-turn-index mean step reward: turn 0 (0 + 0 + 0.25) / 3, turn 1 (0 + 0.25) / 2
    assert stats.step_reward_by_turn == pytest.approx((0.25 / 3, 0.125))
    assert stats.step_reward_mean == pytest.approx(0.5 / 5)
    # turn advantages, once per turn: a's twice, b's once, c's twice
    per_turn = [0.5 / std] * 2 + [-0.5 / std] + [0.0] * 2
    assert stats.turn_adv_mean == pytest.approx(sum(per_turn) / 5)
    metrics = stats.metrics()
    assert metrics["turns_mean"] == pytest.approx(5 / 3) and metrics["anchor_groups"] == 0


def test_rollout_mode_without_step_rewards_equals_the_former_grouped_advantages() -> None:
    # the former grouped_advantages: group_advantages over each sample's reward, eps 1e-6
    rows = [row(x, r, [(None, None)]) for x, r in (("a", 0.0), ("b", 1.0), ("c", 1.0), ("d", 0.0))]
    out, _ = compute_advantages(rows, "rollout")
    k = 0.5 / (0.5 + 1e-6)  # mean 0.5, population std 0.5
    assert [r.advantage for r in out] == pytest.approx([-k, k, k, -k], rel=1e-12)


# ---------------------------------------------------------------------------- turn mode


def test_turn_mode_discounted_returns_against_the_group_baseline() -> None:
    a = row("a", 1.0, [(0.5, None), (None, None), (None, None)])  # rewards per turn 0.5, 0, 0 + 1
    b = row("b", 0.0, [(None, None), (0.5, None)])  # 0, 0.5 + 0
    out, stats = compute_advantages([a, b], "turn", gamma=1.0, eps=0.0)
    # gamma 1: G_a = [1.5, 1, 1], G_b = [0.5, 0.5]; mean 4.5 / 5 = 0.9
    # deviations 0.6, 0.1, 0.1, -0.4, -0.4; variance (0.36 + 0.01 + 0.01 + 0.16 + 0.16) / 5 = 0.14
    std = math.sqrt(0.14)
    assert turn_values(out[0], a) == pytest.approx([0.6 / std, 0.1 / std, 0.1 / std])
    assert turn_values(out[1], b) == pytest.approx([-0.4 / std, -0.4 / std])
    # the scalar is a summary: mean over the row's model tokens (2 per turn)
    assert out[0].advantage == pytest.approx((0.6 + 0.1 + 0.1) / 3 / std)
    assert stats.turn_adv_mean == pytest.approx(0.0, abs=1e-9)
    assert stats.turn_adv_std == pytest.approx(1.0)

    out, _ = compute_advantages([a, b], "turn", gamma=0.5, eps=0.0)
    # gamma 0.5: G_a2 = 1, G_a1 = 0 + 0.5 * 1 = 0.5, G_a0 = 0.5 + 0.5 * 0.5 = 0.75
    #            G_b1 = 0.5, G_b0 = 0 + 0.5 * 0.5 = 0.25
    # mean (0.75 + 0.5 + 1 + 0.25 + 0.5) / 5 = 0.6; deviations 0.15, -0.1, 0.4, -0.35, -0.1
    # variance (0.0225 + 0.01 + 0.16 + 0.1225 + 0.01) / 5 = 0.065
    std = math.sqrt(0.065)
    assert turn_values(out[0], a) == pytest.approx([0.15 / std, -0.1 / std, 0.4 / std])
    assert turn_values(out[1], b) == pytest.approx([-0.35 / std, -0.1 / std])


def test_turn_mode_gamma_1_without_step_rewards_has_the_signs_of_rollout_mode() -> None:
    rows = [row("a", 1.0, [(None, None)] * 3), row("b", 0.0, [(None, None)] * 2)]
    out, _ = compute_advantages(rows, "turn")
    # G_a = [1, 1, 1], G_b = [0, 0]: mean 0.6, std sqrt((3 * 0.16 + 2 * 0.36) / 5) = sqrt(0.24)
    std = math.sqrt(0.24) + 1e-6
    assert turn_values(out[0], rows[0]) == pytest.approx([0.4 / std] * 3)
    assert turn_values(out[1], rows[1]) == pytest.approx([-0.6 / std] * 2)


def test_turn_mode_sees_the_turn_that_earned_where_rollout_mode_sees_a_tie() -> None:
    a = row("a", 0.0, [(1.0, None), (None, None)])  # episode 1, earned on turn 0: G = [1, 0]
    b = row("b", 1.0, [(None, None), (None, None)])  # episode 1, at the end: G = [1, 1]
    out, stats = compute_advantages([a, b], "rollout")
    assert out == [] and stats.zero_spread_groups == 1
    out, stats = compute_advantages([a, b], "turn", eps=0.0)
    # G = [1, 0, 1, 1]: mean 0.75, variance (3 * 0.0625 + 0.5625) / 4 = 0.1875
    std = math.sqrt(0.1875)
    assert turn_values(out[0], a) == pytest.approx([0.25 / std, -0.75 / std])
    assert turn_values(out[1], b) == pytest.approx([0.25 / std] * 2)
    assert stats.zero_spread_groups == 0


def test_a_sample_split_over_two_rows_keeps_its_turns_in_order() -> None:
    # sample a: its first row holds turn 0 (step reward 1), the second (a prefix mismatch) turns 1, 2
    a0 = row("a", 0.0, [(1.0, None)], segment=0)
    a1 = row("a", 0.0, [(None, None), (None, None)], segment=1)
    b = row("b", 0.0, [(None, None), (None, None)])
    out, stats = compute_advantages([a1, b, a0], "turn", eps=0.0)  # a's rows out of order
    # r_a = [1, 0, 0] -> G_a = [1, 0, 0]; G_b = [0, 0]; mean 0.2
    # variance (0.64 + 4 * 0.04) / 5 = 0.16, std 0.4
    assert [r.input_ids for r in out] == [a0.input_ids, a1.input_ids, b.input_ids]
    assert turn_values(out[0], a0) == pytest.approx([0.8 / 0.4])
    assert turn_values(out[1], a1) == pytest.approx([-0.2 / 0.4] * 2)
    assert turn_values(out[2], b) == pytest.approx([-0.2 / 0.4] * 2)
    assert (stats.samples, stats.turns, stats.rows) == (2, 5, 3)
    # rollout mode sums the step rewards of both rows: E_a = 0 + 1, E_b = 0 -> +-1 on every row
    out, _ = compute_advantages([a0, a1, b], "rollout", eps=0.0)
    assert [r.advantage for r in out] == pytest.approx([1.0, 1.0, -1.0])


# ---------------------------------------------------------------------------- gigpo


def test_gigpo_episode_plus_step_advantage_over_anchor_states() -> None:
    s1 = row("s1", 1.0, [(None, "A"), (None, "B")])  # G = [1, 1], E = 1
    s2 = row("s2", 0.0, [(None, "A"), (None, None)])  # G = [0, 0], E = 0; turn 1 has no state
    s3 = row("s3", 0.0, [(None, "A"), (0.5, "B"), (None, "D")])  # r = [0, 0.5, 0]: G = [0.5, 0.5, 0]
    out, stats = compute_advantages([s1, s2, s3], "gigpo", gamma=1.0, step_weight=0.5, eps=0.0)
    # episode: E = [1, 0, 0.5], mean 0.5, std sqrt(1/6) -> A_E = [+k, -k, 0], k = 0.5 / sqrt(1/6)
    k = 0.5 / math.sqrt(1 / 6)
    # anchor A: G = [1, 0, 0.5] -> the same numbers: [+k, -k, 0]
    # anchor B: G = [1 (s1), 0.5 (s3)]: mean 0.75, std 0.25 -> [+1, -1]
    # anchor D: one turn -> 0; s2's second turn: no state -> 0
    assert turn_values(out[0], s1) == pytest.approx([k + 0.5 * k, k + 0.5 * 1.0])
    assert turn_values(out[1], s2) == pytest.approx([-k - 0.5 * k, -k])
    assert turn_values(out[2], s3) == pytest.approx([0.0, 0.5 * -1.0, 0.0], abs=1e-12)
    assert stats.anchor_groups == 2 and stats.metrics()["anchor_groups"] == 2


def test_gigpo_keeps_a_group_whose_episodes_tie_when_an_anchor_has_a_spread() -> None:
    s1 = row("s1", 1.0, [(0.5, "A"), (None, "B")])  # E = 1.5
    s2 = row("s2", 1.5, [(None, "A"), (None, "B")])  # E = 1.5
    out, stats = compute_advantages([s1, s2], "gigpo", gamma=0.5, eps=0.0)
    # gamma 0.5: G_s1 = [0.5 + 0.5 * 1, 1] = [1, 1]; G_s2 = [0 + 0.5 * 1.5, 1.5] = [0.75, 1.5]
    # A_E = 0 (a tie); anchor A: [1, 0.75] -> [+1, -1]; anchor B: [1, 1.5] -> [-1, +1]
    assert turn_values(out[0], s1) == pytest.approx([1.0, -1.0])
    assert turn_values(out[1], s2) == pytest.approx([-1.0, 1.0])
    assert stats.anchor_groups == 2 and stats.zero_spread_groups == 0


def test_groups_without_a_spread_are_skipped_in_every_mode() -> None:
    tie = [
        row("a", 1.0, [(None, "A"), (None, "B")], group="tie"),
        row("b", 1.0, [(None, "A"), (None, "B")], group="tie"),
    ]
    alone = [row("c", 1.0, [(1.0, "A"), (None, "B")], group="alone")]  # one sample: no baseline
    spread = [row("d", 1.0, [(None, None)], group="spread"), row("e", 0.0, [(None, None)], group="spread")]
    no_reward = [row("f", None, [(None, None)], group="spread")]
    for mode in ("rollout", "turn", "gigpo"):
        out, stats = compute_advantages(tie + alone + spread + no_reward, mode)  # type: ignore[arg-type]
        assert (stats.groups, stats.zero_spread_groups, stats.no_reward_rows) == (3, 2, 1), mode
        assert [r.input_ids for r in out] == [spread[0].input_ids, spread[1].input_ids], mode


def test_an_unknown_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match="rollout, turn, gigpo"):
        compute_advantages([], "episode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout, turn, gigpo"):
        GRPO(advantage="per-token")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma"):
        GRPO(advantage="turn", gamma=1.5)


# ---------------------------------------------------------------------------- batches and the loss


def test_pad_batch_builds_per_token_advantages_with_zero_padding() -> None:
    per_token = TrainRow((5, 6, 7), (0, 1, 1), None, 0.5, (0.0, 1.0, -2.0))
    scalar = TrainRow((5, 6), (0, 1), None, 0.5)
    batch = pad_batch([per_token, scalar])
    assert batch.advantages_BT is not None
    assert batch.advantages_BT.tolist() == [[0.0, 1.0, -2.0], [0.5, 0.5, 0.0]]
    assert pad_batch([scalar, scalar]).advantages_BT is None
    assert pad_batch([per_token, scalar], max_len=2).advantages_BT.tolist() == [[0.0, 1.0], [0.5, 0.5]]  # type: ignore[union-attr]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_raises_positive_and_lowers_negative_advantage_tokens(
    sign: float, tiny_llama: Callable[..., LlamaForCausalLM]
) -> None:
    """Per-token advantages of both signs in one sequence (and the pattern flipped): after one
    small SGD step each model token's log-prob moved the way its own advantage says."""
    model = tiny_llama(vocab=64)
    advantages = tuple(sign * a for a in (0.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0))
    train_row = TrainRow((1, 20, 21, 22, 23, 24, 25), (0, 1, 1, 1, 1, 1, 1), None, 0.0, advantages)
    batch = pad_batch([train_row])
    before_T = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT).detach()[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    loss, _ = PolicyLoss(entropy=False)(model, batch, float(batch.num_tokens))
    loss.backward()
    optimizer.step()
    after_T = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT).detach()[0]
    change = (after_T - before_T).tolist()
    assert change[0] == 0.0
    assert [c > 0 for c in change[1:]] == [a > 0 for a in advantages[1:]], change
