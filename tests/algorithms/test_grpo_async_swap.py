"""A sample generated across a weight swap: single-version when the engine drains (the default),
flagged mixed when the drain times out, and asynchronous GRPO counts its oldest version."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from agentbolt.algorithms.importance import behaviour_version
from agentbolt.engine import ModelEngine, tiny_model_dir
from agentbolt.schemas import Event, EventSource
from agentbolt.server.openai_format import CHAT, extract


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model_dir(tmp_path_factory.mktemp("tiny-swap"))
    with ModelEngine.from_pretrained(str(path), dtype="float32") as e:
        yield e


def _request(engine: ModelEngine) -> dict[str, Any]:
    return {
        "model": engine.name,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": True,
    }


def _generate_across_a_swap(
    engine: ModelEngine, version: int, drain_timeout_s: float | None
) -> dict[str, Any]:
    """A long generation; once it runs, new weights are asked for (with ``drain_timeout_s``)."""
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    body: dict[str, Any] = {}

    def generate() -> None:
        body.update(asyncio.run(engine.chat(_request(engine))))

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while engine.stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.stats()["running"] == 1
    assert (
        engine.update_weights(state_dict=weights, version=version, drain_timeout_s=drain_timeout_s) == version
    )
    thread.join(60)
    return body


def _event(body: dict[str, Any]) -> Event:
    """The ``llm_call`` event's data as the gateway records it (its model version as text)."""
    prompt_ids, choices = extract(CHAT, body)
    data = {"prompt_token_ids": prompt_ids, "choices": choices, "model_version": str(body["model_version"])}
    if body.get("model_version_mixed"):
        data["model_version_mixed"] = True
    return Event(
        id=1,
        rollout_id="r",
        attempt_id="a",
        sequence=None,
        type="llm_call",
        timestamp=0.0,
        data=data,
        source=EventSource.GATEWAY,
    )


def test_a_drained_swap_leaves_the_running_sample_on_one_version(engine) -> None:
    before = engine.version
    body = _generate_across_a_swap(engine, version=101, drain_timeout_s=None)  # the default drain
    assert body["model_version"] == before and "model_version_mixed" not in body
    assert "model_versions" not in body["choices"][0]
    assert len(body["choices"][0]["token_ids"]) == 400
    assert behaviour_version([_event(body)]) == before
    after = asyncio.run(engine.chat({**_request(engine), "max_tokens": 4}))
    assert after["model_version"] == 101


def test_a_swap_past_the_drain_deadline_flags_the_sample_mixed_and_counts_its_oldest_version(engine) -> None:
    before = engine.version
    body = _generate_across_a_swap(engine, version=102, drain_timeout_s=0.0)
    assert body["model_version_mixed"] is True
    versions = body["choices"][0]["model_versions"]
    assert versions[0] == before and versions[-1] == 102
    event = _event(body)
    assert event.data["choices"][0]["model_versions"] == versions  # the gateway keeps them
    # staleness is measured from the oldest weights that generated any of the sample's tokens
    assert behaviour_version([event]) == before
