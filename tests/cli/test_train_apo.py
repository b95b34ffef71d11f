"""``agentbolt train apo --method bootstrap`` end to end on the bundled model, as a user runs it
offline: a task spec and nothing else (the spec's agent plays, its system prompt is the seed,
the bundled model is served for the run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.server import ServerConfig, ServerThread

pytestmark = pytest.mark.model

SPEC = "reasoning_gym:isomorphic_strings"


def test_bootstrap_from_the_command_line_on_the_bundled_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    argv = [
        *("train", "apo", "--method", "bootstrap"),
        *("--train", f"{SPEC}?size=12", "--val", f"{SPEC}?size=6"),
        *("--bootstrap-tasks", "12", "--bootstrap-rounds", "1", "--trials", "1"),
        *("--run-dir", str(run)),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "agentbolt", *argv], capture_output=True, text=True, timeout=900, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "serving the bundled model (smollm2)" in out and "best prompt" in out
    with ServerThread(ServerConfig(db=str(run / "agentbolt.db"))) as server, Client(server.url) as client:
        versions = client.list_resources(limit=100).items
        latest = client.latest_resources()
    seed = min(versions, key=lambda v: v.version)
    seed_prompt = seed.resources["system_prompt"].template  # type: ignore[union-attr]
    assert "llm" in seed.resources and seed_prompt  # the spec's own prompt and the served model
    scored = [v for v in versions if v.metadata.get("stage") == "scored"]
    assert scored and all(v.trial for v in scored)
    best = max(scored, key=lambda v: v.metadata["scores"]["val"] or 0.0)
    assert latest is not None and not latest.trial and latest.metadata["stage"] == "best"
    assert latest.metadata["scores"]["val"] == best.metadata["scores"]["val"]
    # the examples are chat turns of the LLM resource: the prompt stays the seed's
    assert latest.resources["system_prompt"].template == seed_prompt  # type: ignore[union-attr]
    for v in scored:
        demos = v.metadata.get("demos")
        turns = v.resources["llm"].examples  # type: ignore[union-attr]
        # every trial's examples are whole recorded conversations: each holds the model's reply
        assert demos is None or [t.role for t in turns] == ["user", "assistant"] * len(demos)
        assert v.resources["system_prompt"].template == seed_prompt  # type: ignore[union-attr]
