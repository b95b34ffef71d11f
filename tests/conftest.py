"""Shared fixtures: a real server on 127.0.0.1 (in a thread) and a client for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentbolt.client import Client
from agentbolt.schemas import Mode, RewardSlot, Rollout, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread

IN_CI = os.environ.get("CI", "").lower() == "true"


def need(condition: bool, reason: str) -> None:
    """Skip when a service is missing — except under CI=true, where it is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


def finished_rollout(
    rid: str,
    *,
    task: Task,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    reward: float | None = None,
    group_id: str | None = None,
    rewards: dict[str, RewardSlot] | None = None,
) -> Rollout:
    """A rollout as the store would return it once ended, for tests of what reads rollouts."""
    return Rollout(
        id=rid,
        task=task,
        mode=Mode.TRAIN,
        status=status,
        resources_version=1,
        timeout_seconds=None,
        max_attempts=1,
        attempts=1,
        reward=reward,
        group_id=group_id,
        created_at=0.0,
        updated_at=0.0,
        rewards=rewards or {},
    )


def tiny_grpo(model: str, **overrides: Any) -> Any:
    """GRPO settings for the tiny random test models (2 layers, width 64) on CPU: one step of
    2 tasks x 4 rollouts in float32, no validation, checkpoints or plot unless ``overrides``
    ask for them."""
    from agentbolt.algorithms.grpo import GRPO

    settings: dict[str, Any] = dict(
        model=model,
        steps=1,
        tasks_per_step=2,
        group_size=4,
        lr=1e-3,
        val_every=0,
        checkpoint_every=0,
        engine_dtype="float32",
        bf16=False,
        step_timeout=120,
        plot=False,
    )
    return GRPO(**{**settings, **overrides})


@pytest.fixture
def server(tmp_path) -> Iterator[ServerThread]:
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=30.0, sweep_interval=0.1)
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def smollm2_path() -> str:
    """The bundled SmolLM2's folder; the test is skipped without it (failed under CI=true)."""
    from agentbolt.engine import ModelNotFoundError, ensure_model

    try:
        return str(ensure_model("smollm2"))
    except ModelNotFoundError as exc:
        need(False, f"the bundled SmolLM2: {exc}")
        raise


@contextmanager
def serve_smollm2(**engine_options: Any) -> Iterator[Any]:
    """The bundled SmolLM2 in the embedded engine on CPU, served over HTTP (an ``EngineServer``:
    ``.base_url``); the engine's batcher is stopped afterwards."""
    from agentbolt.engine import EngineServer, ModelEngine

    engine = ModelEngine.from_pretrained(smollm2_path(), device="cpu", name="smollm2", **engine_options)
    try:
        with EngineServer(engine) as served:
            yield served
    finally:
        engine.close()


# The suite runs on pytest-xdist's workers (scripts/test.sh). The longest tests, measured with
# --durations, are handed out first, so no worker starts a minute-long test near the end while
# the others stand idle. Only the order changes: every test still runs.
LONG_FIRST = (
    "tests/tasks/test_chain_with_smollm2.py",
    "tests/tasks/test_external_with_smollm2.py",
    "tests/tasks/test_external.py",
    "tests/evaluators/test_judge_smollm2.py",
    "tests/examples/test_program_examples.py",
    "tests/algorithms/test_distributed_fsdp.py",
    "tests/algorithms/test_distributed.py",
    "tests/engine/test_engine_idle_memory.py",
    "tests/scale/test_fuzz.py",
    "tests/server/test_agents_sdk_smollm2.py",
    "tests/engine/test_engine_smollm2.py",
    "tests/engine/test_engine_serve_command.py",
    "tests/evaluators/test_evaluator_worker.py",
    "tests/examples/test_program_grpo.py",
    "tests/scale/test_ray_runners.py",
    "tests/scale/test_chaos.py",
    "tests/scale/test_scale_sim.py",
    "tests/runner/test_kubernetes_launcher.py",
    "tests/cli/test_train.py",
    "tests/test_trainer_scripts.py",
    "tests/cli/test_demo.py",
    "tests/algorithms/test_apo.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(str(item.path.relative_to(root)), len(rank)))
