"""The Trainer's wiring: its embedded server, its runner processes and the token they share.
(tests/test_trainer_scripts.py: fit from every kind of main program, and runners that end with
their parent.)"""

from __future__ import annotations

import pickle
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentbolt import LitAgent, Task, Trainer, rollout
from agentbolt.algorithms.base import Algorithm, TrainContext
from agentbolt.algorithms.evaluate import EvalSummary, Evaluate
from agentbolt.client import Client, RequestError
from agentbolt.errors import ConfigError
from agentbolt.runner.travel import AgentByName


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


def test_the_embedded_server_has_a_random_token_by_default(tmp_path: Path) -> None:
    algo = EvaluateAndLook()
    trainer = Trainer(algo, n_runners=1, run_dir=tmp_path, lease_seconds=10)
    summary = trainer.fit(doubles, [{"id": "t0", "x": 1, "y": 2}])
    token = algo.seen["token"]
    assert isinstance(token, str) and len(token) >= 24 and token == trainer.token
    assert algo.seen["anonymous_status"] == 401  # roles and agent keys are in force
    assert summary.succeeded == 1
    assert Trainer(Evaluate()).token not in (None, token)
    assert Trainer(Evaluate(), server_url="http://127.0.0.1:9").token is None  # that server's own


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
    """A forked runner hung when another thread of the parent was alive; runners are fresh
    interpreters sent the agent, whatever threads the parent has."""
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
    assert trainer.start_method == "subprocess"
    assert (summary.count, summary.succeeded, summary.mean_reward) == (4, 4, 1.0)


def test_closures_are_sent_by_value(tmp_path: Path) -> None:
    factor = 2

    @rollout
    def closure(task: Task) -> float:
        return 1.0 if task.data["x"] * factor == task.data["y"] else 0.0

    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path)
    summary = trainer.fit(closure, [{"id": "a", "x": 1, "y": 2}, {"id": "b", "x": 1, "y": 3}])
    assert trainer.start_method == "subprocess"
    assert (summary.count, summary.succeeded, summary.mean_reward) == (2, 2, 0.5)


class _HoldsALock(LitAgent):
    """An agent that does not pickle, even with cloudpickle (it holds a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def execute_rollout(self, task: Task) -> float:
        with self.lock:
            return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0


def test_agents_that_do_not_pickle_fall_back_to_fork(tmp_path: Path) -> None:
    from agentbolt.runner.travel import how_to_start

    assert how_to_start(_HoldsALock())[0] == "fork"
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path)
    summary = trainer.fit(_HoldsALock(), [{"id": "a", "x": 1, "y": 2}, {"id": "b", "x": 1, "y": 3}])
    assert trainer.start_method == "fork"
    assert (summary.count, summary.succeeded, summary.mean_reward) == (2, 2, 0.5)


def test_a_runner_that_never_registers_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentbolt.local_runners as local_runners

    monkeypatch.setattr(
        local_runners, "how_to_start", lambda agent: ("subprocess", pickle.dumps(_NeverStarts()))
    )
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path, runner_start_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"runner 1 of 1 \(pid \d+, started with subprocess\) did not register"
    ) as raised:
        trainer.fit(doubles, [{"id": "a", "x": 1, "y": 2}])
    assert time.monotonic() - started < 30  # the timeout, plus starting and stopping the server
    pid = int(re.search(r"pid (\d+)", str(raised.value)).group(1))  # type: ignore[union-attr]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert trainer._runners is not None and trainer._runners.children == []  # it was stopped


def test_a_runner_that_fails_to_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agentbolt.local_runners as local_runners

    monkeypatch.setattr(local_runners, "how_to_start", lambda agent: ("subprocess", b"not a pickle"))
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path, runner_start_timeout=60)
    with pytest.raises(
        ConfigError, match=r"runner 1 of 1 \(pid \d+, started with subprocess\) exited with code 1 before"
    ):
        trainer.fit(doubles, [{"id": "a", "x": 1, "y": 2}])


def test_runner_start_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="runner_start_timeout"):
        Trainer(Evaluate(), runner_start_timeout=0)


def test_an_agent_loaded_from_a_file_path_is_sent_where_runners_cannot_import_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--agent path/agent.py:agent``: a child interpreter finds that module only when its folder
    is on sys.path; otherwise the module's code goes with the agent, by value."""
    from agentbolt.runner.travel import how_to_start, modules_of
    from agentbolt.runner.worker import load_agent

    folder = tmp_path / "agents"
    folder.mkdir()
    (folder / "file_agent_mod.py").write_text(
        "from agentbolt import rollout\n\nFACTOR = 2\n\n\n@rollout\n"
        "def agent(task):\n    return 1.0 if task.data['x'] * FACTOR == task.data['y'] else 0.0\n"
    )
    monkeypatch.delitem(sys.modules, "file_agent_mod", raising=False)
    agent = load_agent(f"{folder}/file_agent_mod.py:agent")
    method, payload = how_to_start(agent)
    assert method == "subprocess" and "file_agent_mod" not in modules_of(payload)
    trainer = Trainer(Evaluate(timeout=60), n_runners=1, run_dir=tmp_path / "run")
    summary = trainer.fit(agent, [{"id": "a", "x": 1, "y": 2}, {"id": "b", "x": 1, "y": 3}])
    assert (summary.count, summary.succeeded, summary.mean_reward) == (2, 2, 0.5)

    monkeypatch.syspath_prepend(str(folder))
    method, payload = how_to_start(load_agent(f"{folder}/file_agent_mod.py:agent"))
    assert method == "subprocess" and pickle.loads(payload) == AgentByName("file_agent_mod", "agent")


def _plain(task: Task) -> float:
    return 1.0


renamed = rollout(_plain)  # a global under another name than its function's


def test_a_function_of_an_importable_module_is_sent_by_reference() -> None:
    """Its module is imported in the runner (its other globals, a client, need not pickle)."""
    from agentbolt.runner.travel import how_to_start

    method, payload = how_to_start(renamed)
    assert method == "subprocess" and pickle.loads(payload).fn is _plain


def test_an_agent_of_the_main_script_is_sent_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner is never handed the user's main module to import (a script without an ``if
    __name__ == "__main__":`` guard would train again there): what the agent needs of
    ``__main__`` goes by value."""
    from agentbolt.runner.travel import how_to_start, modules_of

    main = sys.modules["__main__"]

    @rollout
    def main_agent(task: Any) -> float:
        return 1.0

    main_agent.__module__ = "__main__"  # type: ignore[attr-defined]
    main_agent.fn.__module__ = "__main__"
    vars(main_agent)["__qualname__"] = "main_agent"
    monkeypatch.setattr(main, "main_agent", main_agent, raising=False)
    method, payload = how_to_start(main_agent)
    assert method == "subprocess" and "__main__" not in modules_of(payload)
    assert pickle.loads(payload).fn(None) == 1.0


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
