"""The program examples end to end against the bundled SmolLM2: an unmodified Python script on
``openai.OpenAI()`` and a Node.js agent on the official ``openai`` npm package, each started as
a child process with only the standard variables set, through the server's per-attempt gateway
and the embedded engine. Every model call must be recorded with its prompt and completion token
ids, and the rollout must end with the reward the program reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.engine import EngineServer, ModelEngine, ModelNotFoundError, ensure_model
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread
from tests.conftest import need

pytestmark = pytest.mark.model

EXAMPLES = Path(__file__).parents[2] / "examples"
NODE_AGENT = EXAMPLES / "node_agent"
TASK = {"question": "What is 6*7?", "answer": "42"}


@pytest.fixture(scope="module")
def smollm2() -> Iterator[EngineServer]:
    try:
        path = ensure_model("smollm2")
    except ModelNotFoundError as exc:
        need(False, f"the bundled SmolLM2: {exc}")
        raise
    engine = ModelEngine.from_pretrained(path, device="cpu", dtype="float32", name="smollm2", max_batch=8)
    with EngineServer(engine) as served:
        yield served
    engine.close()


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


def run_by_hand(client: Client, command: list[str], folder: Path) -> tuple[str, dict]:
    """Claim one rollout and run ``command`` for it with what a runner gives a program: the
    gateway and its key in the standard variables, the task in a file, a result file to write.
    Finish the attempt with the reward the program wrote; return the rollout id and that
    result."""
    [rollout] = client.enqueue([RolloutCreate(task=Task(data=TASK))])
    claim = client.dequeue("by-hand")
    assert claim is not None and claim.resources is not None
    llm = claim.resources.resources["llm"]
    assert isinstance(llm, LLM) and "/gateway/" in llm.base_url
    task_file, result_file = folder / "task.json", folder / "result.json"
    task_file.write_text(json.dumps(claim.rollout.task.data))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(folder),
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": llm.api_key or "",
        "OPENAI_MODEL": llm.model,
        "AGENTBOLT_TASK_FILE": str(task_file),
        "AGENTBOLT_RESULT_FILE": str(result_file),
    }
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, reward=result["reward"], worker_id="by-hand")
    return rollout.id, result | {"stdout": done.stdout}


def assert_recorded(client: Client, rollout_id: str, reward: float) -> list[dict]:
    [rollout] = client.wait([rollout_id], 10).rollouts
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    assert rollout.reward == reward
    calls = [e.data for e in client.all_events(rollout_id) if e.type == "llm_call"]
    assert calls, "no model call was recorded"
    for call in calls:
        assert call["error"] is None and call["upstream_status"] == 200
        assert call["prompt_token_ids"], call["request"]
        assert all(choice["token_ids"] for choice in call["choices"]), call["choices"]
    return calls


@pytest.mark.parametrize("language", ["python", "node"])
def test_example_run_by_hand_through_the_gateway(language, client, tmp_path):
    command = python_command() if language == "python" else node_command()
    rollout_id, result = run_by_hand(client, command, tmp_path)
    calls = assert_recorded(client, rollout_id, result["reward"])
    assert TASK["question"] in json.dumps(calls[0]["request"]["messages"])
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "calculator"
    # what the program printed as its answer is the text of the last recorded call
    printed = json.loads(result["stdout"])
    assert printed["answer"] == calls[-1]["choices"][0]["message"]["content"]
    assert len(calls) == printed["calls"]  # each call the program made, recorded once
    # greedy SmolLM2 states 6*7 = 42, so the program scores its answer 1
    assert result["reward"] == 1.0
