"""The program examples end to end against the bundled SmolLM2: an unmodified Python script on
``openai.OpenAI()`` and a Node.js agent on the official ``openai`` npm package, each run by a
runner as a :class:`Program` (a child process given the standard variables), through the
server's per-attempt gateway and the embedded engine. Every model call the program made must be
recorded once, with its prompt and completion token ids, and the rollout must end with the
reward the program reported."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.engine import EngineServer
from agentbolt.runner.program import Program
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread
from tests.conftest import need, serve_smollm2

pytestmark = pytest.mark.model

EXAMPLES = Path(__file__).parents[2] / "examples"
NODE_AGENT = EXAMPLES / "node_agent"
TASK = {"question": "What is 6*7?", "answer": "42"}
# The reward event each example's reward arrives as: the Python script writes the result file,
# the Node.js agent posts to the events URL.
SOURCE = {"python": "result_file", "node": "program"}


@pytest.fixture(scope="module")
def smollm2() -> Iterator[EngineServer]:
    with serve_smollm2(dtype="float32", max_batch=8) as served:
        yield served


@pytest.fixture
def client(tmp_path, smollm2) -> Iterator[Client]:
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server, Client(server.url) as c:
        c.publish_resources({"llm": LLM(base_url=smollm2.base_url, model="smollm2")})
        yield c


def python_command() -> list[str]:
    return [sys.executable, str(EXAMPLES / "program_openai_env.py")]


def node_command() -> list[str]:
    need(shutil.which("node") is not None, "node is not installed")
    need(
        (NODE_AGENT / "node_modules" / "openai" / "package.json").exists(),
        "the openai npm package: npm ci --prefix examples/node_agent",
    )
    return ["node", str(NODE_AGENT / "agent.mjs")]


def assert_recorded(client: Client, rollout_id: str, source: str) -> tuple[dict, list[dict]]:
    """The rollout succeeded with the reward its program printed (with its answer and how many
    model calls it made), recorded as the reward event of ``source``, and each of those calls
    is recorded with token ids. Returns what the program printed and the calls' data."""
    [rollout] = client.wait([rollout_id], 10).rollouts
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    events = client.all_events(rollout_id)
    [stdout] = [e.data["content"] for e in events if e.type == "message" and e.data["role"] == "stdout"]
    reported = json.loads(stdout)
    assert rollout.reward == reported["reward"]
    rewards = [e.data for e in events if e.type == "reward"]
    assert {r["name"]: r["value"] for r in rewards if "name" in r} == {source: reported["reward"]}
    assert [r["value"] for r in rewards if r.get("final")] == [reported["reward"]]
    calls = [e.data for e in events if e.type == "llm_call"]
    assert len(calls) == reported["calls"] > 0  # each call the program made, recorded once
    for call in calls:
        assert call["error"] is None and call["upstream_status"] == 200
        assert call["prompt_token_ids"], call["request"]
        assert all(choice["token_ids"] for choice in call["choices"]), call["choices"]
    assert reported["answer"] == calls[-1]["choices"][0]["message"]["content"]
    return reported, calls


@pytest.mark.parametrize("language", ["python", "node"])
def test_example_run_by_a_runner(language, client, tmp_path):
    command = python_command() if language == "python" else node_command()
    [rollout] = client.enqueue([RolloutCreate(task=Task(data=TASK))])
    runner = Runner(Program(command, timeout=120), client.url, max_rollouts=1, flush_interval=0.1)
    asyncio.run(asyncio.wait_for(runner.run(), 180))
    reported, calls = assert_recorded(client, rollout.id, SOURCE[language])
    assert TASK["question"] in json.dumps(calls[0]["request"]["messages"])
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "calculator"
    assert reported["reward"] == 1.0  # greedy SmolLM2 states 6*7 = 42


def test_node_agent_run_by_the_runner_command(client, tmp_path):
    """What a user who writes no Python runs: ``agentbolt runner --command``."""
    command = node_command()
    rollouts = client.enqueue([RolloutCreate(task=Task(data=TASK)) for _ in range(2)])
    cli = Path(sys.executable).parent / "agentbolt"
    argv = [str(cli), "runner", "--command", shlex.join(command), "--server", client.url]
    done = subprocess.run(
        [*argv, "--concurrency", "2", "--max-rollouts", "2", "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rollout in rollouts:
        reported, calls = assert_recorded(client, rollout.id, SOURCE["node"])
        assert reported["reward"] in (0.0, 1.0) and calls[0]["request"]["model"] == "smollm2"


def test_node_agent_evaluated_by_agentbolt_train(client, tmp_path):
    """``agentbolt train evaluate --command``: tasks from a JSON-lines file, the program run by the
    trainer's runner process, the summary printed."""
    command = node_command()
    tasks = [TASK, {"question": "What is 12+30?", "answer": "42"}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cli = Path(sys.executable).parent / "agentbolt"
    done = subprocess.run(
        [str(cli), "train", "evaluate", "--command", shlex.join(command), "--val", "tasks.jsonl"]
        + ["--server", client.url, "--runners", "1", "--concurrency", "2", "--run-dir", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rollouts = list(client.pages(client.list_rollouts))
    assert sorted(r.task.data["question"] for r in rollouts) == sorted(t["question"] for t in tasks)
    rewards = [assert_recorded(client, r.id, SOURCE["node"])[0]["reward"] for r in rollouts]
    # the summary table: val, count 2, succeeded 2, failed 0, the mean of what the program reported
    row = re.search(r"val\W+2\W+2\W+0\W+([\d.]+)", done.stdout)
    assert row is not None, done.stdout
    assert float(row.group(1)) == pytest.approx(sum(rewards) / len(rewards), abs=1e-3)
