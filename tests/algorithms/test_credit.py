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

Turn = tuple[float | None, str | None] | tuple[float | None, str | None, int]
"""(per-call reward, declared state[, the token the model answered with]) of one turn."""


def row(
    rollout: str,
    reward: float | None,
    turns: Sequence[Turn],
    group: str = "g",
    segment: int = 0,
    tokens_per_turn: int = 2,
) -> TrajectoryRow:
    """A prompt token 1, then per turn: one context token 2 and ``tokens_per_turn`` model tokens
    (the turn's own token, else ``10 + its index``: the same answer in every row)."""
    ids, mask, spans = [1], [0], []
    for step_reward, state, *answer in turns:
        ids.append(2)
        mask.append(0)
        start = len(ids)
        ids += [answer[0] if answer else 10 + len(spans)] * tokens_per_turn
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


def test_turn_mode_never_blames_a_correct_turn_for_a_later_mistake() -> None:
    """Seven perfect five-turn episodes and one that fails only at its final answer (its four
    calls the same as the others'): every turn of the perfect ones gets >= 0, the failed one's
    four calls the same credit as the identical calls elsewhere, and only its answer is pushed
    down. (One baseline pooled over every turn, as this mode had, gave the perfect episodes'
    last turn -0.21 and the failed episode's correct calls -1.9 to -2.7.)"""
    calls = [(0.1, None, 10 + t) for t in range(4)]
    perfect = [row(f"p{i}", 1.0, [*calls, (None, None, 20)]) for i in range(7)]
    failed = row("f", 0.0, [*calls, (None, None, 66)])
    out, stats = compute_advantages([*perfect, failed], "turn", gamma=1.0, eps=0.0)
    values = [turn_values(r, source) for r, source in zip(out, [*perfect, failed], strict=True)]
    for turns in values[:7]:
        assert turns[:4] == [0.0] * 4 and turns[4] > 0
    assert values[7][:4] == values[0][:4]
    # the answer's situation: 8 turns, returns 1 (x7) and 0: mean 7/8, std sqrt(7)/8
    std = math.sqrt(7) / 8
    assert values[0][4] == pytest.approx((1 - 7 / 8) / std) and values[7][4] == pytest.approx(-7 / 8 / std)
    assert stats.zero_spread_groups == 0


def test_turn_mode_pools_identical_answers_and_falls_back_to_the_turn_index() -> None:
    a = row("a", 1.0, [(None, None, 10), (None, None, 11)])
    b = row("b", 0.0, [(None, None, 20), (None, None, 21)])
    c = row("c", 0.0, [(None, None, 10), (None, None, 31)])  # a's first answer, then its own
    out, _ = compute_advantages([a, b, c], "turn", eps=0.0)
    # turn 0: one situation (the opening), G = 1, 0, 0; a and c answered alike: Q = 0.5 for both,
    # Q = 0 for b; V = 1/3, std sqrt(2)/3
    std0 = math.sqrt(2) / 3
    assert [turn_values(r, x)[0] for r, x in zip(out, [a, b, c], strict=True)] == pytest.approx(
        [(0.5 - 1 / 3) / std0, -1 / 3 / std0, (0.5 - 1 / 3) / std0]
    )
    # turn 1: a and c share their history (the same first answer), then answered differently:
    # G 1 and 0, +-1; b's history is its own: against every turn at index 1 (G 1, 0, 0), Q = its G
    assert [turn_values(r, x)[1] for r, x in zip(out, [a, b, c], strict=True)] == pytest.approx(
        [1.0, -1 / 3 / std0, -1.0]
    )
    out, _ = compute_advantages([a, b, c], "turn", normalize_std=False)
    assert turn_values(out[0], a) == pytest.approx([0.5 - 1 / 3, 0.5])


def test_turn_mode_discounts_the_returns_and_compares_one_position_with_itself() -> None:
    a = row("a", 1.0, [(0.5, None, 10), (None, None, 11), (None, None, 12)])  # 0.5, 0, 0 + 1
    b = row("b", 0.0, [(None, None, 20), (0.5, None, 21)])  # 0, 0.5 + 0
    out, _ = compute_advantages([a, b], "turn", gamma=0.5, eps=0.0)
    # G_a = [0.5 + 0.5 * 0.25, 0 + 0.5 * 1, 1] = [0.75, 0.5, 1]; G_b = [0 + 0.5 * 0.5, 0.5] = [0.25, 0.5]
    # turn 0 (one situation): 0.75 against 0.25, +-1; turn 1 (histories differ, index 1): 0.5 and
    # 0.5, no spread; turn 2: a alone at its index, 0 (a pooled baseline would have put a's turn 2
    # above and its turn 1 below the group's mean for their positions alone)
    assert turn_values(out[0], a) == pytest.approx([1.0, 0.0, 0.0])
    assert turn_values(out[1], b) == pytest.approx([-1.0, 0.0])


def test_turn_mode_with_one_answer_everywhere_has_no_signal() -> None:
    rows = [row("a", 1.0, [(None, None)] * 3), row("b", 0.0, [(None, None)] * 3)]
    # identical prompts and answers at every turn, yet different outcomes: nothing to tell them
    # apart by, so nothing is trained (rollout mode would still push a's tokens up)
    out, stats = compute_advantages(rows, "turn")
    assert out == [] and stats.zero_spread_groups == 1
    out, _ = compute_advantages(rows, "rollout")
    assert [r.advantage for r in out] == pytest.approx([1.0, -1.0], rel=1e-5)


def test_a_sample_split_over_two_rows_keeps_its_turns_in_order() -> None:
    # sample a: its first row holds turn 0 (step reward 1), the second (a prefix mismatch) turns 1, 2
    a0 = row("a", 0.0, [(1.0, None, 10)], segment=0)
    a1 = row("a", 0.0, [(None, None, 11), (None, None, 12)], segment=1)
    b = row("b", 0.0, [(None, None, 20), (None, None, 21)])
    out, stats = compute_advantages([a1, b, a0], "turn", eps=0.0)  # a's rows out of order
    # r_a = [1, 0, 0] -> G_a = [1, 0, 0]; G_b = [0, 0]. The second row re-renders its prompt
    # (tokens 1 2), so a's turn 1 shares the opening's situation with a's and b's turn 0:
    # G 1, 0, 0, every answer different: V 1/3, std sqrt(2)/3. a's turn 2 and b's turn 1 have
    # histories of their own: against their turn index (0 and 0, 0): no spread, 0
    std = math.sqrt(2) / 3
    assert [r.input_ids for r in out] == [a0.input_ids, a1.input_ids, b.input_ids]
    assert turn_values(out[0], a0) == pytest.approx([(2 / 3) / std])
    assert turn_values(out[1], a1) == pytest.approx([-1 / 3 / std, 0.0])
    assert turn_values(out[2], b) == pytest.approx([-1 / 3 / std, 0.0])
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
    spread = [
        row("d", 1.0, [(None, None, 10)], group="spread"),
        row("e", 0.0, [(None, None, 11)], group="spread"),  # another answer
    ]
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
