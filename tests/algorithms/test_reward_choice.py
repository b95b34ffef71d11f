"""Which reward an algorithm reads: resolution (a name, weights), pending never read as zero,
the counts, what rollouts await, and the wait for rewards still pending."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from agentbolt.algorithms.base import BatchResult
from agentbolt.algorithms.rewards import (
    ResolvedReward,
    RewardPlan,
    awaited_for,
    check_choice,
    parse_choice,
    resolve,
    tally,
    wait_for_rewards,
)
from agentbolt.errors import ConfigError
from agentbolt.schemas import (
    AwaitedReward,
    RewardScale,
    RewardSlot,
    RewardSource,
    RewardState,
    Rollout,
    RolloutStatus,
    Task,
    WaitResult,
)
from tests.conftest import finished_rollout

STARS = RewardScale(low=1, high=5, step=1)


def slot(
    name: str, score: float | None = None, *, error: bool = False, scale: RewardScale | None = None
) -> RewardSlot:
    """A slot as the store returns it: pending without a score, scored with one, or an error."""
    scale = scale or RewardScale()
    state = RewardState.ERROR if error else RewardState.PENDING if score is None else RewardState.SCORED
    source = RewardSource.REVIEWER if scale == STARS else RewardSource.EVALUATOR
    return RewardSlot(
        name=name,
        source=source,
        scale=scale,
        state=state,
        revision=0 if state == RewardState.PENDING else 1,
        score=score,
        value=scale.normalise(score) if score is not None else None,
        error="timed out" if error else None,
        updated_at=0.0,
    )


def rollout(
    rid: str,
    reward: float | None = None,
    *slots: RewardSlot,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
) -> Rollout:
    return finished_rollout(
        rid, task=Task(id="t"), status=status, reward=reward, rewards={s.name: s for s in slots}
    )


# ---------------------------------------------------------------------------- resolution


def test_agent_is_the_rollouts_own_reward() -> None:
    assert resolve(rollout("a", 0.7)) == ResolvedReward(0.7, "ok")
    assert resolve(rollout("a", None)) == ResolvedReward(None, "missing")
    # a judge's slot does not change the agent's reward
    assert resolve(rollout("a", 0.2, slot("judge", 0.9)), "agent").value == 0.2


def test_a_named_reward_is_its_slots_value_on_0_1() -> None:
    r = rollout("a", 1.0, slot("human", 4.0, scale=STARS), slot("judge", 0.3))
    assert resolve(r, "human") == ResolvedReward(0.75, "ok")  # 4 stars of 1-5
    assert resolve(r, "judge") == ResolvedReward(0.3, "ok")
    assert resolve(r, "other") == ResolvedReward(None, "missing")


def test_pending_and_error_have_no_value_never_zero() -> None:
    r = rollout("a", 1.0, slot("human", scale=STARS), slot("judge", error=True))
    assert resolve(r, "human") == ResolvedReward(None, "pending")
    assert resolve(r, "judge") == ResolvedReward(None, "error")
    assert not resolve(r, "human").ok


def test_weights_are_a_weighted_sum_of_values_all_scored() -> None:
    r = rollout("a", 1.0, slot("judge", 0.5), slot("human", 2.0, scale=STARS))
    assert resolve(r, {"agent": 0.5, "judge": 0.5}).value == pytest.approx(0.75)
    assert resolve(r, {"judge": 2.0, "human": -1.0}).value == pytest.approx(2 * 0.5 - 0.25)
    # one part not scored: no value at all (not the sum of the others)
    waiting = rollout("b", 1.0, slot("judge", 0.5), slot("human", scale=STARS))
    assert resolve(waiting, {"agent": 0.5, "human": 0.5}) == ResolvedReward(None, "pending")
    # an error or a missing part decides over a pending one: waiting will not mend it
    broken = rollout("c", None, slot("judge", error=True), slot("human", scale=STARS))
    assert resolve(broken, {"judge": 1, "human": 1}).state == "error"
    assert resolve(broken, {"agent": 1, "human": 1}).state == "missing"


def test_tally_counts_succeeded_rollouts_only() -> None:
    rollouts = [
        rollout("ok", 1.0, slot("human", 5.0, scale=STARS)),
        rollout("p1", 1.0, slot("human", scale=STARS)),
        rollout("p2", 1.0, slot("human", scale=STARS)),
        rollout("e", 1.0, slot("human", error=True)),
        rollout("m", 1.0),
        rollout("f", None, slot("human", scale=STARS), status=RolloutStatus.FAILED),
    ]
    counts = tally(rollouts, "human")
    assert (counts.ok, counts.pending, counts.errors, counts.missing) == (1, 2, 1, 1)
    assert counts.metrics() == {"reward_pending": 2, "reward_errors": 1}


def test_batch_mean_and_counts_use_the_chosen_reward() -> None:
    rollouts = [
        rollout("a", 0.0, slot("judge", 1.0)),
        rollout("b", 0.0, slot("judge", 0.5)),
        rollout("c", 0.0, slot("judge")),  # pending: left out, not a zero
        rollout("d", 0.0, slot("judge", error=True)),
    ]
    assert BatchResult(rollouts, 0).mean_reward == 0.0  # the agent's own, as before
    judged = BatchResult(rollouts, 0, reward="judge")
    assert judged.mean_reward == pytest.approx(0.75)
    assert (judged.reward_pending, judged.reward_errors) == (1, 1)
    assert [r.id for r in judged.scored] == ["a", "b"]
    assert BatchResult(rollouts[2:], 0, reward="judge").mean_reward is None


# ---------------------------------------------------------------------------- the choice


def test_choices_are_checked_and_parsed() -> None:
    assert parse_choice("judge") == "judge"
    assert parse_choice("agent=0.5, judge=0.5") == {"agent": 0.5, "judge": 0.5}
    for bad in ("", "two words", "a=", "a=x", "=1"):
        with pytest.raises(ConfigError, match="reward"):
            parse_choice(bad)
    for wrong in ({}, {"judge": float("nan")}, {"judge": True}, {"bad name": 1.0}):
        with pytest.raises(ConfigError, match="reward"):
            check_choice(wrong)
    with pytest.raises(ConfigError, match="reward_wait"):
        RewardPlan(wait=-1)


class _Evaluator:
    """What the algorithms need of an evaluator: its awaited reward and whether it runs here."""

    def __init__(self, name: str, source: RewardSource, scale: RewardScale, automatic: bool) -> None:
        self.name, self.automatic = name, automatic
        self._awaited = AwaitedReward(name=name, source=source, scale=scale)

    def awaited(self) -> AwaitedReward:
        return self._awaited


def test_awaited_lists_every_evaluator_and_names_given_elsewhere() -> None:
    judge = _Evaluator("judge", RewardSource.EVALUATOR, RewardScale(), automatic=True)
    human = _Evaluator("human", RewardSource.REVIEWER, STARS, automatic=False)
    awaited = awaited_for({"agent": 0.2, "judge": 0.4, "ranker": 0.4}, [judge, human])  # type: ignore[list-item]
    assert [(a.name, a.source, a.scale) for a in awaited] == [
        ("judge", RewardSource.EVALUATOR, RewardScale()),
        ("human", RewardSource.REVIEWER, STARS),
        ("ranker", RewardSource.EVALUATOR, RewardScale()),  # from a worker outside the run
    ]
    assert awaited_for("agent") == []
    with pytest.raises(ConfigError, match="same reward name"):
        awaited_for("agent", [judge, judge])  # type: ignore[list-item]


# ---------------------------------------------------------------------------- waiting


class _Store:
    """A stand-in for the client's ``wait``: final rollouts whose slots a 'reviewer' thread
    scores meanwhile (the real server is exercised in the algorithms' own tests)."""

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        self.rollouts = {r.id: r for r in rollouts}
        self.reads = 0
        self.lock = threading.Lock()

    def wait(self, ids: Sequence[str], timeout: float = 0.0) -> WaitResult:
        with self.lock:
            self.reads += 1
            return WaitResult(rollouts=[self.rollouts[i] for i in ids], done=True)

    def score(self, rid: str, name: str, score: float) -> None:
        with self.lock:
            r = self.rollouts[rid]
            scored = slot(name, score, scale=r.rewards[name].scale)
            self.rollouts[rid] = r.model_copy(update={"rewards": {**r.rewards, name: scored}})


def test_wait_returns_once_the_pending_rewards_arrive() -> None:
    store = _Store([rollout(f"r{i}", 1.0, slot("human", scale=STARS)) for i in range(3)])
    timers = [threading.Timer(0.3 + 0.2 * i, store.score, (f"r{i}", "human", 5.0)) for i in range(3)]
    for t in timers:
        t.start()
    client: Any = store
    got = wait_for_rewards(client, list(store.rollouts.values()), ["human"], timeout=10, poll=0.1)
    assert [resolve(r, "human").value for r in got] == [1.0, 1.0, 1.0]
    assert store.reads >= 2


def test_wait_gives_up_at_the_timeout_and_rereads_once_at_zero() -> None:
    store = _Store([rollout("a", 1.0, slot("human", scale=STARS)), rollout("b", 1.0, slot("judge"))])
    client: Any = store
    before = list(store.rollouts.values())
    store.score("b", "judge", 0.4)  # scored after the batch was read: a zero wait still sees it
    got = wait_for_rewards(client, before, ["human", "judge"], timeout=0)
    assert [resolve(r, n).state for r, n in zip(got, ["human", "judge"], strict=True)] == ["pending", "ok"]
    assert store.reads == 1
    got = wait_for_rewards(client, before, ["human"], timeout=0.3, poll=0.1)
    assert resolve(got[0], "human").state == "pending"


def test_the_agent_only_plan_reads_nothing_more() -> None:
    store = _Store([rollout("a", 1.0)])
    client: Any = store
    plan = RewardPlan()
    assert plan.is_agent_only and plan.awaited() == []
    rollouts, report = plan.settle(client, list(store.rollouts.values()), None)
    assert rollouts[0].reward == 1.0 and report is None
    assert store.reads == 0


def test_grpo_success_leaves_pending_out_of_the_denominator() -> None:
    from agentbolt.algorithms.grpo import success_rate

    rollouts = [
        rollout("a", None, slot("judge", 1.0)),
        rollout("b", None, slot("judge", 0.2)),
        rollout("c", None, slot("judge")),  # pending: no outcome yet
        rollout("d", None, slot("judge", error=True)),  # no outcome either
        rollout("f", None, slot("judge"), status=RolloutStatus.FAILED),  # a failure, as before
    ]
    assert success_rate(BatchResult(rollouts, 0, reward="judge"), 0.5) == pytest.approx(1 / 3)
    # the agent's own reward: none given, so no success, every rollout counted (as before)
    assert success_rate(BatchResult(rollouts, 0), 0.5) == 0.0
    assert success_rate(BatchResult(rollouts[2:4], 0, reward="judge"), 0.5) == 0.0
