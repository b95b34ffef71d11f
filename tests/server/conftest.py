"""Gateway fixtures: the upstream test double and a real server on 127.0.0.1 whose resources
point an ``LLM`` at it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.schemas import LLM, Claim, Event, RolloutCreate, Task
from agentbolt.server import ServerConfig, ServerThread

sys.path.insert(0, str(Path(__file__).parent))
from upstream_double import UpstreamDouble  # noqa: E402


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamDouble]:
    with UpstreamDouble() as double:
        yield double


@pytest.fixture(autouse=True)
def _reset_upstream(request: pytest.FixtureRequest) -> None:
    if "upstream" in request.fixturenames:
        double = request.getfixturevalue("upstream")
        double.calls.clear()
        double.adapters.clear()
        double.fail_next.clear()
        double.delay_next.clear()
        double.strict, double.model_version, double.delay = False, "7", 0.0


@dataclass
class Rig:
    server: ServerThread
    client: Client
    upstream: UpstreamDouble

    def claim(self, model: str = "double", api_key: str | None = None, base_url: str | None = None) -> Claim:
        """Publish an LLM resource, enqueue one rollout and claim it: the claim's LLM points
        at the gateway."""
        llm = LLM(base_url=base_url or self.upstream.base_url, model=model, api_key=api_key)
        self.client.publish_resources({"llm": llm})
        self.client.enqueue([RolloutCreate(task=Task(data={"q": "hi"}))])
        claim = self.client.dequeue("w1")
        assert claim is not None
        return claim

    def llm_calls(self, rollout_id: str) -> list[Event]:
        return [e for e in self.client.all_events(rollout_id) if e.type == "llm_call"]


@pytest.fixture
def rig(tmp_path, upstream) -> Iterator[Rig]:
    config = ServerConfig(db=str(tmp_path / "store.db"), upstream_timeout=5.0)
    with ServerThread(config) as server, Client(server.url) as client:
        yield Rig(server, client, upstream)
