"""Held-out problems are disjoint from training by construction, for every built-in task."""

from __future__ import annotations

import pytest

from agentbolt.tasks import TASKS, get_task, split_of


@pytest.mark.parametrize("name", sorted(TASKS))
def test_heldout_never_meets_training_whatever_the_seeds(name: str) -> None:
    task = TASKS[name]
    train = {t.id for seed in range(4) for t in task.make_tasks(256, seed, "train")}
    heldout = {t.id for seed in range(4) for t in task.make_tasks(96, seed, "heldout")}
    assert train and heldout
    assert not train & heldout
    # the ids name the problem (its content hash), so equal ids are equal problems and back
    train_data = {
        repr(sorted(t.data.items())) for seed in range(4) for t in task.make_tasks(256, seed, "train")
    }
    heldout_data = {
        repr(sorted(t.data.items())) for seed in range(4) for t in task.make_tasks(96, seed, "heldout")
    }
    assert not train_data & heldout_data


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_distinct_and_reproducible(name: str) -> None:
    task = TASKS[name]
    first, again = task.heldout_tasks(96, seed=2), task.heldout_tasks(96, seed=2)
    assert [t.id for t in first] == [t.id for t in again]
    assert len({t.id for t in first}) == 96


def test_split_is_a_stable_hash() -> None:
    # sha256, not Python's salted hash: the same in every process
    assert split_of("23 + 19") == split_of("23 + 19")
    shares = [split_of(str(i)) for i in range(4000)]
    assert 0.2 < shares.count("heldout") / len(shares) < 0.3


def test_asking_for_more_problems_than_exist_is_an_error() -> None:
    from agentbolt.tasks.base import make_split

    with pytest.raises(ValueError, match="distinct"):
        make_split(50, 0, "train", lambda rng: (str(rng.randint(0, 9)), {}), "tiny")


def test_unknown_task_names_the_choices() -> None:
    with pytest.raises(ValueError, match="calculator, chain, guess"):
        get_task("chess")
