"""The Trainer's wiring: its embedded server, forked runners and the token they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentbolt import Task, Trainer, rollout
from agentbolt.algorithms.base import Algorithm, TrainContext
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate
from agentbolt.client import Client, RequestError
from agentbolt.errors import ConfigError


@rollout
def doubles(task: Task) -> float:
    return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0


@dataclass
class EvaluateAndLook(Algorithm):
    """Evaluate, and note the token the algorithm was handed and what a tokenless client gets."""

    seen: dict[str, Any] = field(default_factory=dict)

    def run(self, ctx: TrainContext) -> EvalSummary:
        self.seen["token"] = ctx.token
        with Client(ctx.server_url, token=None) as anonymous:
            try:
                anonymous.stats()
            except RequestError as exc:
                self.seen["anonymous_status"] = exc.status_code
        return Evaluate(timeout=60).run(ctx)


def test_auto_token_is_random_and_runners_use_it(tmp_path: Path) -> None:
    algo = EvaluateAndLook()
    tasks = [{"id": f"t{i}", "x": i, "y": 2 * i} for i in range(4)]
    trainer = Trainer(algo, token="auto", n_runners=1, run_dir=tmp_path, lease_seconds=10)
    summary = trainer.fit(doubles, tasks)
    token = algo.seen["token"]
    assert isinstance(token, str) and token != "auto" and len(token) >= 24
    assert algo.seen["anonymous_status"] == 401  # the server does require it
    # every rollout ran: the runner authenticated with the same token
    assert (summary.count, summary.succeeded, summary.mean_reward) == (4, 4, 1.0)
    assert Trainer(Evaluate(), token="auto").token != token


def test_auto_token_needs_the_embedded_server() -> None:
    with pytest.raises(ConfigError, match='token="auto"'):
        Trainer(Evaluate(), token="auto", server_url="http://127.0.0.1:9")
