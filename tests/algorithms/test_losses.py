from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from agentbolt.adapters import TrajectoryRow
from agentbolt.algorithms.credit import grouped_advantages
from agentbolt.algorithms.losses import (
    PolicyLoss,
    TrainRow,
    clipped_policy_loss,
    group_advantages,
    micro_batches,
    pad_batch,
    sft_loss,
    shared_prefix_len,
    token_logprobs,
)
from agentbolt.algorithms.train_state import TrainConfig, make_train_state, make_trainable, optimizer_step

pytestmark = pytest.mark.usefixtures("one_thread")

TinyLlama = Callable[..., LlamaForCausalLM]


def traj(
    rollout: str, reward: float | None, group: str | None = "g", ids: tuple[int, ...] = (1, 2)
) -> TrajectoryRow:
    return TrajectoryRow(rollout, "at", 0, ids, (0, 1), None, reward, (), group_id=group)


# ---------------------------------------------------------------------------- advantages


def test_group_advantages() -> None:
    rewards_G = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert group_advantages(rewards_G, eps=0.0).tolist() == [-1.0, 1.0, 1.0, -1.0]
    assert group_advantages(rewards_G, normalize_std=False).tolist() == [-0.5, 0.5, 0.5, -0.5]


def test_grouped_advantages_skip_zero_spread_and_count_samples_once() -> None:
    rows = [
        traj("a", 1.0),
        traj("a", 1.0, ids=(1, 2, 3)),  # a second segment of rollout a: same sample
        traj("b", 0.0),
        traj("c", 0.0),
        traj("d", 1.0, group="same"),
        traj("e", 1.0, group="same"),
        traj("f", 0.5, group=None),  # alone in its group
        traj("h", None),
    ]
    out, stats = grouped_advantages(rows, eps=0.0)
    assert (stats.groups, stats.zero_spread_groups, stats.no_reward_rows, stats.rows) == (3, 2, 1, 4)
    assert stats.samples == 6 and all(r.advantages is None for r in out)
    assert [r.advantage for r in out] == pytest.approx([math.sqrt(2)] * 2 + [-math.sqrt(2) / 2] * 2)
    assert out[1].input_ids == (1, 2, 3)


# ---------------------------------------------------------------------------- batching


def test_pad_batch_right_pads_and_keeps_the_logprobs_rows_have() -> None:
    rows = [
        TrainRow((5, 6, 7), (0, 1, 1), (0.0, -1.0, -2.0), 1.0),
        TrainRow((5, 6), (0, 1), (0.0, -3.0), -1.0),
    ]
    batch = pad_batch(rows, pad_token_id=9)
    assert batch.input_ids_BT.tolist() == [[5, 6, 7], [5, 6, 9]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.old_logprobs_BT is not None and batch.old_logprobs_BT.tolist() == [[0, -1, -2], [0, -3, 0]]
    assert batch.advantages_B.tolist() == [1.0, -1.0] and batch.num_tokens == 3
    assert batch.recorded_B is None  # every row recorded
    # a row without logprobs: the others' are kept, and which rows have them is said
    partial = pad_batch([rows[0], TrainRow((1,), (0,))])
    assert partial.old_logprobs_BT is not None and partial.old_logprobs_BT.tolist() == [
        [0, -1, -2],
        [0, 0, 0],
    ]
    assert partial.recorded_B is not None and partial.recorded_B.tolist() == [True, False]
    assert pad_batch([TrainRow((1,), (0,))]).old_logprobs_BT is None
    assert pad_batch(rows, max_len=2).input_ids_BT.shape == (2, 2)


def test_micro_batches() -> None:
    rows = [TrainRow((1,) * n, (1,) * n) for n in (4, 4, 8, 2, 20)]
    assert [[len(r.input_ids) for r in mb] for mb in micro_batches(rows, max_tokens=16)] == [
        [4, 4],
        [8, 2],
        [20],
    ]
    assert [len(mb) for mb in micro_batches(rows, micro_batch_size=2)] == [2, 2, 1]


# ---------------------------------------------------------------------------- log-probs and losses


def test_token_logprobs_align_and_ignore_right_padding(tiny_llama: TinyLlama) -> None:
    model = tiny_llama().eval()
    ids_BT = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 0]])
    mask_BT = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        logprobs_BT = token_logprobs(model, ids_BT, mask_BT)
        logits_TV = model(input_ids=ids_BT[:1]).logits[0]
    expected = torch.log_softmax(logits_TV, -1)[torch.arange(3), ids_BT[0, 1:]]
    assert logprobs_BT[:, 0].tolist() == [0.0, 0.0]
    assert torch.allclose(logprobs_BT[0, 1:], expected, atol=1e-5)
    assert torch.allclose(logprobs_BT[1, :3], logprobs_BT[0, :3], atol=1e-5)


def test_clipped_policy_loss_hand_computed() -> None:
    # position 0 is masked and carries junk; position 1: ratios 1.5, 1.5, 0.5, 0.5
    new_BT = torch.log(torch.tensor([[9.0, 1.5], [9.0, 1.5], [9.0, 0.5], [9.0, 0.5]])).requires_grad_()
    old_BT = torch.zeros(4, 2)
    adv_B = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask_BT = torch.tensor([[0.0, 1.0]] * 4)
    loss, metrics = clipped_policy_loss(new_BT, old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.28)
    # per token: -min(1.5, 1.28) = -1.28 (clipped), -min(-1.5, -1.28) = 1.5, -0.5, -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    assert new_BT.grad is not None
    assert new_BT.grad[:, 0].tolist() == [0.0] * 4  # masked: no gradient
    assert new_BT.grad[:, 1].tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])  # clipped: none
    symmetric, _ = clipped_policy_loss(new_BT, old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.2)
    assert symmetric.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)


def test_kl_term_is_zero_at_the_reference_and_positive_away() -> None:
    new_BT, mask_BT, adv_B = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([0.0])
    _, at_ref = clipped_policy_loss(new_BT, new_BT, adv_B, mask_BT, ref_logprobs_BT=new_BT, kl_coef=0.1)
    loss, away = clipped_policy_loss(
        new_BT, new_BT, adv_B, mask_BT, ref_logprobs_BT=new_BT - 0.5, kl_coef=0.1
    )
    assert at_ref["kl"] == 0.0
    assert away["kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1) and loss.item() == pytest.approx(
        0.1 * away["kl"]
    )


def _logit_grads(model: LlamaForCausalLM, loss_of_model) -> torch.Tensor:
    captured: list[torch.Tensor] = []

    def keep(_module, _inputs, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    handle = model.model.norm.register_forward_hook(keep)  # the hidden states the head reads
    loss_of_model(model).backward()
    handle.remove()
    return captured[0].grad.abs().sum(-1)  # type: ignore[union-attr]


@pytest.mark.parametrize("loss_name", ["policy", "sft"])
def test_masked_tokens_get_no_gradient(loss_name: str, tiny_llama: TinyLlama) -> None:
    model = tiny_llama()
    row = TrainRow((1, 2, 3, 4, 5, 6), (0, 0, 1, 0, 1, 1), None, advantage=1.0)
    batch = pad_batch([row, TrainRow((1, 2, 3), (0, 1, 1), None, -1.0)])
    old = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT).detach() - 0.1
    batch = pad_batch([TrainRow(row.input_ids, row.loss_mask, tuple(old[0].tolist()), 1.0)])
    loss_fn = PolicyLoss() if loss_name == "policy" else sft_loss
    grads_T = _logit_grads(model, lambda m: loss_fn(m, batch, batch.num_tokens)[0])[0]
    # logits at t predict token t + 1: gradient only where token t + 1 is model-generated
    assert (grads_T > 0).tolist() == [False, True, False, True, True, False]


# ---------------------------------------------------------------------------- learning


def sample(model: LlamaForCausalLM, prompt: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids_BT = torch.tensor([prompt] * n)
    with torch.no_grad():
        for _ in range(length):
            probs_BV = torch.softmax(model(input_ids=ids_BT).logits[:, -1].float(), -1)
            ids_BT = torch.cat([ids_BT, torch.multinomial(probs_BV, 1, generator=generator)], 1)
    return ids_BT[:, len(prompt) :].tolist()


def success_rate(model: LlamaForCausalLM, prompt: list[int]) -> float:
    model.eval()
    return sum(7 in c for c in sample(model, prompt, 200, 6, seed=123)) / 200


def test_grpo_steps_raise_the_rewarded_behaviour(tiny_llama: TinyLlama) -> None:
    prompt = [1, 2, 3]
    state = make_train_state(tiny_llama(vocab=32), TrainConfig(lr=2e-2))
    before = success_rate(state.model, prompt)
    for step in range(8):
        state.model.eval()
        completions = sample(state.model, prompt, 16, 6, seed=step)
        rows = [
            TrajectoryRow(
                f"r{i}", "at", 0, tuple(prompt + c), (0, 0, 0) + (1,) * 6, None, float(7 in c), (), "g"
            )
            for i, c in enumerate(completions)
        ]
        train_rows, stats = grouped_advantages(rows)
        batches = [pad_batch(mb) for mb in micro_batches(train_rows, micro_batch_size=8)]
        metrics = optimizer_step(state, batches, PolicyLoss())
        assert stats.zero_spread_groups == 0 and metrics["num_tokens"] == 16 * 6
    after = success_rate(state.model, prompt)
    assert after > before + 0.2, (before, after)  # measured: 0.16 -> 0.43


def sft_rows() -> list[TrainRow]:
    return [TrainRow((1 + i, 2, 3, 10 + i, 20 + i, 30 + i), (0, 0, 0, 1, 1, 1)) for i in range(4)]


def test_sft_loss_falls(tiny_llama: TinyLlama) -> None:
    # full fine-tuning: a random tiny model's output layer (std 0.02, not a LoRA target) caps
    # how far LoRA alone can move its logits
    state = make_train_state(tiny_llama(), TrainConfig(lora=False, lr=1e-2))
    batch = pad_batch(sft_rows())
    losses = [optimizer_step(state, [batch], sft_loss)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] * 0.5, losses
    assert state.step == 8


@pytest.mark.parametrize("per_token", [False, True])
def test_shared_prefix_pass_equals_the_plain_pass_in_values_and_gradients(tmp_path, per_token: bool):
    """The prefix computed once and expanded gives the same log-probs and LoRA gradients, with
    one advantage per row or one per token (per-turn credit: aligned with input_ids)."""
    from transformers import AutoModelForCausalLM

    from agentbolt.engine import tiny_model_dir

    torch.manual_seed(0)
    model = make_trainable(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "m")), TrainConfig(lora_r=4)
    )
    with torch.no_grad():  # LoRA B starts at zero; give it values so its gradients are non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prefix = list(range(5, 25))
    rows = [
        TrainRow(tuple(prefix + tail), tuple([0] * 21 + [1] * (len(tail) - 1)), None, adv)
        for tail, adv in (([30, 31, 32, 33], 1.0), ([40, 41], -1.0), ([50, 51, 52], 0.5))
    ]
    if per_token:  # a different advantage on every token (those on masked tokens must not matter)
        rows = [
            replace(r, advantages=tuple((-1) ** t * (t + b) / 10 for t in range(len(r.input_ids))))
            for b, r in enumerate(rows)
        ]
    batch = pad_batch(rows)
    assert shared_prefix_len(batch) == 20
    assert (batch.advantages_BT is not None) == per_token

    def run(share: bool):
        model.zero_grad()
        loss, metrics = PolicyLoss(share_prefix=share)(model, batch, float(batch.num_tokens))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), metrics, grads

    loss_a, metrics_a, grads_a = run(False)
    loss_b, metrics_b, grads_b = run(True)
    # no old logprobs: the ratio is 1, so the loss is minus the mean advantage over model tokens
    adv_BT = batch.advantages_BT if per_token else batch.advantages_B[:, None].expand_as(batch.loss_mask_BT)
    assert adv_BT is not None
    expected = -(adv_BT * batch.loss_mask_BT).sum() / batch.num_tokens
    assert loss_a.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    assert abs(metrics_a["entropy"] - metrics_b["entropy"]) < 1e-4
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5), name
