"""Truncated importance sampling of asynchronous GRPO, on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from agentbolt.algorithms.importance import behaviour_version, importance_weights, version_number
from agentbolt.algorithms.losses import PolicyLoss, TrainRow, clipped_policy_loss, pad_batch, token_logprobs
from agentbolt.schemas import Event, EventSource

LN = math.log


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # row 0: tokens 1 and 2 trained; row 1: tokens 1, 2 and 3 trained; position 0 never
    prox = torch.tensor([[0.0, LN(0.5), LN(0.4), LN(0.9)], [0.0, LN(0.3), LN(0.6), LN(0.2)]])
    behaviour = torch.tensor([[0.0, LN(0.25), LN(0.8), LN(0.01)], [0.0, LN(0.3), LN(0.2), LN(0.4)]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    return prox, behaviour, mask


def test_token_weights_are_the_ratio_truncated_at_the_cap() -> None:
    prox, behaviour, mask = _tensors()
    w, truncated = importance_weights(prox, behaviour, mask, "token", cap=2.5)
    expected = {(0, 1): 2.0, (0, 2): 0.5, (1, 1): 1.0, (1, 2): 2.5, (1, 3): 0.5}  # (1, 2): 3.0 cut to 2.5
    for (b, t), value in expected.items():
        assert w[b, t].item() == pytest.approx(value, rel=1e-6)
    assert truncated[mask.bool()].tolist() == [False, False, False, True, False]
    # a masked token (0, 3) has ratio 90: ignored, neither truncated nor weighted
    assert w[0, 3].item() == pytest.approx(1.0) and not truncated[0, 3]


def test_token_weights_below_the_cap_are_not_truncated() -> None:
    prox, behaviour, mask = _tensors()
    w, truncated = importance_weights(prox, behaviour, mask, "token", cap=4.0)
    assert w[1, 2].item() == pytest.approx(3.0, rel=1e-6)
    assert not truncated[mask.bool()].any()


def test_sequence_weights_are_one_per_row_over_its_model_tokens() -> None:
    prox, behaviour, mask = _tensors()
    # row 0: 2.0 * 0.5 = 1.0 (the masked 90x token left out); row 1: 1.0 * 3.0 * 0.5 = 1.5
    w, truncated = importance_weights(prox, behaviour, mask, "sequence", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0] * 4, rel=1e-6)
    assert w[1].tolist() == pytest.approx([1.5] * 4, rel=1e-6)
    assert not truncated.any()
    w, truncated = importance_weights(prox, behaviour, mask, "sequence", cap=1.2)
    assert w[1].tolist() == pytest.approx([1.2] * 4, rel=1e-6)
    assert truncated[1].all() and not truncated[0].any()


def test_sequence_weights_do_not_overflow_on_long_rows() -> None:
    prox, behaviour = torch.zeros(1, 500), torch.full((1, 500), -5.0)
    w, truncated = importance_weights(prox, behaviour, torch.ones(1, 500), "sequence", cap=2.0)
    assert torch.isfinite(w).all() and w[0, 0].item() == pytest.approx(2.0) and truncated.all()


def test_off_weighs_every_token_one() -> None:
    prox, behaviour, mask = _tensors()
    w, truncated = importance_weights(prox, behaviour, mask, "off", cap=2.0)
    assert (w == 1).all() and not truncated.any()


def test_an_unknown_mode_is_refused() -> None:
    prox, behaviour, mask = _tensors()
    with pytest.raises(ValueError, match="importance must be one of"):
        importance_weights(prox, behaviour, mask, "tokens", 2.0)  # type: ignore[arg-type]


def test_the_loss_weighs_each_tokens_surrogate_and_reports_the_weights() -> None:
    prox, behaviour, mask = _tensors()
    new = prox.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = clipped_policy_loss(
        new, new.detach(), adv, mask, behaviour_logprobs_BT=behaviour, importance="token", importance_cap=2.5
    )
    # ratio 1 everywhere: per token -w * A; weights 2, 0.5 (A=1) and 1, 2.5, 0.5 (A=-1), over 5 tokens
    assert loss.item() == pytest.approx((-(2.0 + 0.5) + (1.0 + 2.5 + 0.5)) / 5, rel=1e-6)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 1].item() == pytest.approx(-2.0 / 5, rel=1e-6)  # d/dnew of -w * exp(new - prox) * A
    assert new.grad[0, 3].item() == 0.0  # masked
    assert metrics["is_weight_mean"] == pytest.approx(6.5 / 5)
    assert metrics["is_weight_min"] == pytest.approx(0.5)
    assert metrics["is_weight_max"] == pytest.approx(2.5)
    assert metrics["is_clipped_fraction"] == pytest.approx(1 / 5)


def test_with_behaviour_equal_to_the_current_policy_async_equals_sync(tiny_llama, one_thread) -> None:
    """The proximal loss on fresh samples is the synchronous loss: same value, same gradient."""
    model = tiny_llama()
    rows = [
        TrainRow((1, 5, 7, 9, 11), (0, 0, 1, 1, 1), advantage=1.0),
        TrainRow((1, 5, 8, 2), (0, 0, 1, 1), advantage=-0.5),
    ]
    fresh = pad_batch(rows)
    with torch.no_grad():
        current = token_logprobs(model, fresh.input_ids_BT, fresh.attention_mask_BT) * fresh.loss_mask_BT
    batch = pad_batch(
        [
            TrainRow(r.input_ids, r.loss_mask, tuple(current[i, : len(r.input_ids)].tolist()), r.advantage)
            for i, r in enumerate(rows)
        ]
    )

    def run(loss_fn: PolicyLoss) -> tuple[float, list[torch.Tensor], dict[str, float]]:
        model.zero_grad()
        loss, metrics = loss_fn(model, batch, float(batch.num_tokens))
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None], metrics

    sync_loss, sync_grads, _ = run(PolicyLoss(share_prefix=False))
    for mode in ("token", "sequence"):
        async_loss, async_grads, metrics = run(PolicyLoss(share_prefix=False, proximal=True, importance=mode))  # type: ignore[arg-type]
        assert async_loss == pytest.approx(sync_loss, rel=1e-5, abs=1e-7)
        for a, b in zip(async_grads, sync_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert metrics["is_clipped_fraction"] == 0.0


def _call(version: object, versions: list[object] | None = None) -> Event:
    choice: dict[str, object] = {"index": 0, "token_ids": [1]}
    if versions is not None:
        choice["model_versions"] = versions
    return Event(
        id=1,
        rollout_id="r",
        attempt_id="a",
        sequence=None,
        type="llm_call",
        timestamp=0.0,
        data={"model_version": version, "choices": [choice]},
        source=EventSource.GATEWAY,
    )


def test_the_behaviour_version_is_the_oldest_among_the_calls_and_their_tokens() -> None:
    assert behaviour_version([_call("3"), _call("4")]) == 3
    # a call generated across a swap reports its first version at the top and all per token
    assert behaviour_version([_call("5"), _call("4", [4, 4, 5])]) == 4
    assert behaviour_version([_call(None)]) is None
    assert behaviour_version([_call("policy-step-2")]) is None  # a remote server's adapter name
    assert version_number(True) is None and version_number(7) == 7 and version_number("12") == 12


def test_a_row_without_logprobs_leaves_the_others_corrected(tiny_llama, one_thread) -> None:
    """Behaviour logprobs for one row of two: that row is corrected (its weights are the ratio
    of the current policy to them), the other weighs 1; the whole micro-batch used to weigh 1."""
    model = tiny_llama()
    recorded = TrainRow((1, 5, 7, 9, 11), (0, 0, 1, 1, 1), advantage=1.0)
    missing = TrainRow((1, 5, 8, 2), (0, 0, 1, 1), advantage=-0.5)
    fresh = pad_batch([recorded, missing])
    with torch.no_grad():
        current = token_logprobs(model, fresh.input_ids_BT, fresh.attention_mask_BT) * fresh.loss_mask_BT
    behaviour = tuple((current[0, :5] - 0.1 * fresh.loss_mask_BT[0, :5]).tolist())  # 0.1 nats less likely
    both = [TrainRow(recorded.input_ids, recorded.loss_mask, behaviour, 1.0), missing]
    batch = pad_batch(both)
    assert batch.recorded_B is not None and batch.recorded_B.tolist() == [True, False]
    _, metrics = PolicyLoss(share_prefix=False, proximal=True)(model, batch, float(batch.num_tokens))
    # 3 tokens weigh exp(0.1), 2 weigh 1
    assert metrics["is_weight_max"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert metrics["is_weight_min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["is_weight_mean"] == pytest.approx((3 * math.exp(0.1) + 2) / 5, rel=1e-4)
    assert pad_batch([missing, missing]).old_logprobs_BT is None  # none recorded: as before


def test_the_update_counts_the_rows_without_logprobs(tiny_llama, one_thread) -> None:
    from agentbolt.algorithms.grpo_config import GRPOConfig
    from agentbolt.algorithms.grpo_update import update
    from agentbolt.algorithms.train_state import TrainConfig, make_train_state

    config = GRPOConfig(model="unused", lora=False, bf16=False, device="cpu")
    state = make_train_state(tiny_llama(), TrainConfig(lora=False))
    rows = [
        TrainRow((1, 5, 7, 9), (0, 0, 1, 1), (0.0, 0.0, -2.0, -2.0), 1.0),
        TrainRow((1, 5, 8, 2), (0, 0, 1, 1), None, -1.0),
        TrainRow((1, 6, 8, 3), (0, 0, 1, 1), None, 0.5),
    ]
    metrics = update(config, state, rows, proximal=True)
    assert metrics["rows_without_logprobs"] == 2.0 and metrics["num_tokens"] == 6.0
