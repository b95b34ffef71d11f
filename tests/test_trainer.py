"""The Trainer's wiring: its embedded server, forked runners and the token they share."""

from __future__ import annotations

import sys
import threading
import time
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


# ---------------------------------------------------------------------------- starting runners


class _NeverStarts:
    """Unpickles, in the runner process, into a wait that outlasts any test: a runner that
    never registers."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _hang, ()


def _hang() -> None:
    threading.Event().wait(600)


def test_runners_start_while_another_thread_of_the_process_is_alive(tmp_path: Path) -> None:
    """A forked runner hung when another thread of the parent was alive; a module-level agent
    now starts its runners with forkserver, whatever threads the parent has."""
    release = threading.Event()
    bystander = threading.Thread(target=release.wait, name="bystander")
    bystander.start()
    try:
        tasks = [{"id": f"t{i}", "x": i, "y": 2 * i} for i in range(4)]
        trainer = Trainer(Evaluate(timeout=60), n_runners=2, run_dir=tmp_path, runner_start_timeout=60)
        summary = trainer.fit(doubles, tasks)
        assert bystander.is_alive()
    finally:
        release.set()
        bystander.join()
    assert trainer.start_method == "forkserver"
    assert (summary.count, summary.succeeded, summary.mean_reward) == (4, 4, 1.0)


def test_agents_that_do_not_pickle_fall_back_to_fork(tmp_path: Path) -> None:
    factor = 2

    @rollout
    def closure(task: Task) -> float:
        return 1.0 if task.data["x"] * factor == task.data["y"] else 0.0

    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path)
    summary = trainer.fit(closure, [{"id": "a", "x": 1, "y": 2}, {"id": "b", "x": 1, "y": 3}])
    assert trainer.start_method == "fork"
    assert (summary.count, summary.succeeded, summary.mean_reward) == (2, 2, 0.5)


def test_a_runner_that_never_registers_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentbolt.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "_how_to_start", lambda agent: ("forkserver", _NeverStarts()))
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path, runner_start_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"runner 1 of 1 \(pid \d+, started with forkserver\) did not register"
    ):
        trainer.fit(doubles, [{"id": "a", "x": 1, "y": 2}])
    assert time.monotonic() - started < 30  # the timeout, plus starting and stopping the server
    assert trainer._procs == []  # the stuck runner was stopped


def test_runner_start_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="runner_start_timeout"):
        Trainer(Evaluate(), runner_start_timeout=0)


def test_an_agent_loaded_from_a_file_path_starts_its_runners_where_they_can_import_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--agent path/agent.py:agent``: a child interpreter finds that module only when its folder
    is on sys.path; otherwise the runners fork (they would fail to import it)."""
    from agentbolt.runner.worker import load_agent
    from agentbolt.trainer import _how_to_start

    folder = tmp_path / "agents"
    folder.mkdir()
    (folder / "file_agent_mod.py").write_text(
        "from agentbolt import rollout\n\n\n@rollout\ndef agent(task):\n    return 1.0\n"
    )
    monkeypatch.delitem(sys.modules, "file_agent_mod", raising=False)
    assert _how_to_start(load_agent(f"{folder}/file_agent_mod.py:agent"))[0] == "fork"
    monkeypatch.syspath_prepend(str(folder))
    assert _how_to_start(load_agent(f"{folder}/file_agent_mod.py:agent"))[0] in ("forkserver", "spawn")


def test_an_agent_of_the_main_script_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh interpreter would run the script's top level again (an unguarded
    ``Trainer(...).fit(...)`` as in the README's quick start would train twice): fork."""
    from agentbolt.trainer import _how_to_start

    main = sys.modules["__main__"]

    @rollout
    def main_agent(task: Any) -> float:
        return 1.0

    main_agent.__module__ = "__main__"  # type: ignore[attr-defined]
    vars(main_agent)["__qualname__"] = "main_agent"
    monkeypatch.setattr(main, "main_agent", main_agent, raising=False)
    assert _how_to_start(main_agent)[0] == "fork"


# ---------------------------------------------------------------------------- runner start-up imports
@rollout
def sees_openai_without_importing_it(task: Task) -> float:
    """1.0 when the runner process has imported the OpenAI SDK on its own (this agent never does)."""
    deadline = time.monotonic() + 30
    while "openai" not in sys.modules:
        if time.monotonic() > deadline:
            return 0.0
        time.sleep(0.05)
    return 1.0


def test_runners_import_the_openai_sdk_at_start_up_not_in_the_first_rollout(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path, lease_seconds=60)
    summary = trainer.fit(sees_openai_without_importing_it, [{"id": "t0"}])
    assert (summary.count, summary.mean_reward) == (1, 1.0)
