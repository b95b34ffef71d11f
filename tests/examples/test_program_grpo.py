"""GRPO for two steps on a program agent (a child process that only knows the standard
variables), with the tiny random model: server, runner, gateway, engine and trainer for real.
The update must change the weights the engine serves. Synchronous: the runs after it are sampled
from them. Asynchronous (the default): a run is sampled from the weights its resources version
names or newer ones (the engine swapped while it was queued), never older."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentbolt import Trainer
from agentbolt.client import Client
from agentbolt.engine import tiny_model_dir
from agentbolt.runner.program import Program
from agentbolt.schemas import ModelWeights, RolloutStatus
from agentbolt.server import ServerConfig, ServerThread
from tests.conftest import tiny_grpo

PROGRAM = [sys.executable, str(Path(__file__).parent / "vowel_program.py")]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_grpo_two_steps_on_a_program_agent_changes_the_served_weights(tmp_path, asynchronous):
    model = str(tiny_model_dir(tmp_path / "tiny"))
    algo = tiny_grpo(model, steps=2, asynchronous=asynchronous)
    train = [{"id": f"t{i}", "q": f"say something {i}"} for i in range(4)]
    config = ServerConfig(db=str(tmp_path / "store.db"))
    with ServerThread(config) as server, Client(server.url) as client:
        result = Trainer(
            algo, n_runners=1, runner_concurrency=8, server_url=server.url, run_dir=tmp_path / "run"
        ).fit(Program(PROGRAM, timeout=120), train)
        steps = [h for h in result.history if h["step"] > 0]
        assert [h["step"] for h in steps] == [1, 2]
        assert all(h["rollouts"] == 8 and h["failed"] == 0 for h in steps), steps
        assert all(h["train_tokens"] > 0 for h in steps), steps  # both steps updated the policy

        versions = sorted(client.pages(client.list_resources), key=lambda v: v.version)
        weights = [v.resources["policy_weights"] for v in versions if "policy_weights" in v.resources]
        assert all(isinstance(w, ModelWeights) for w in weights)
        # step 0 publishes the base weights, each update the engine's next weight version
        assert [w.metadata["step"] for w in weights] == [0, 1, 2]
        paths = [w.path for w in weights]  # engine://<name>@<the engine's weight version>
        assert len(set(paths)) == 3 and all(p.startswith("engine://") for p in paths), paths

        engine_version = {
            v.version: v.resources["policy_weights"].path.rpartition("@")[2]
            for v in versions
            if "policy_weights" in v.resources
        }
        rollouts = list(client.pages(client.list_rollouts, limit=100))
        assert len(rollouts) == 16 and all(r.status == RolloutStatus.SUCCEEDED for r in rollouts)
        order = [w.path.rpartition("@")[2] for w in weights]  # the engine's versions, oldest first
        served: dict[int, set[str]] = {}
        for rollout in rollouts:
            events = client.all_events(rollout.id)
            [stdout] = [
                e.data["content"] for e in events if e.type == "message" and e.data["role"] == "stdout"
            ]
            named = {
                e.data["name"]: e.data["value"] for e in events if e.type == "reward" and "name" in e.data
            }
            # the reward trained on is the one the program wrote
            assert named == {"result_file": json.loads(stdout)["reward"]} == {"result_file": rollout.reward}
            calls = [e.data for e in events if e.type == "llm_call"]
            assert len(calls) == 1, calls
            [call] = calls
            assert call["prompt_token_ids"] and call["choices"][0]["token_ids"]
            assert call["resources_version"] == rollout.resources_version
            named_weights = engine_version[rollout.resources_version]
            if asynchronous:  # the weights its resources version names, or newer: never older
                assert order.index(str(call["model_version"])) >= order.index(named_weights)
            else:  # served by the very weights its resources version names
                assert str(call["model_version"]) == named_weights
            served.setdefault(rollout.resources_version, set()).add(str(call["model_version"]))
        if asynchronous:
            return  # which weights served which run depends on when each group finished
        # step 1 sampled the base weights, step 2 those its update swapped into the engine
        assert len(served) == 2 and all(len(v) == 1 for v in served.values()), served
        first, second = (served[k] for k in sorted(served))
        assert first != second, served
