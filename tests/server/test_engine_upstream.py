"""The gateway in front of the real embedded engine (a tiny random Llama, greedy decoding):
what is recorded is exactly what the engine answers for the same request, and every
integration example runs end to end against it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from agentbolt.engine import EngineServer, ModelEngine, tiny_model_dir
from agentbolt.runner.worker import Runner, load_agent
from agentbolt.schemas import LLM, PromptTemplate, RolloutCreate, RolloutStatus, Task

EXAMPLES = Path(__file__).parents[2] / "examples"
GREEDY = {"max_tokens": 8, "temperature": 0.0}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory) -> Iterator[EngineServer]:
    path = tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048
    )  # room for tools
    engine = ModelEngine.from_pretrained(path, device="cpu", dtype="float32", name="tiny", max_batch=8)
    with EngineServer(engine) as server:
        yield server
    engine.close()


def _replay(engine_server, endpoint: str, request: dict) -> dict:
    """The engine's own answer to a recorded request (not streamed, with every extra)."""
    body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    body |= {"return_token_ids": True, "logprobs": True if endpoint == "chat.completions" else 1}
    path = "chat/completions" if endpoint == "chat.completions" else "completions"
    return httpx.post(f"{engine_server.base_url}/{path}", json=body, timeout=60).json()


def _assert_exact(call: dict, truth: dict) -> None:
    prompt = truth.get("prompt_token_ids") or truth["choices"][0].get("prompt_token_ids")
    assert call["prompt_token_ids"] == prompt
    for rec, ref in zip(call["choices"], truth["choices"], strict=True):
        assert rec["token_ids"] == ref["token_ids"] and len(rec["token_ids"]) > 0
        ref_logprobs = ref["logprobs"]
        values = (
            [t["logprob"] for t in ref_logprobs["content"]]
            if "content" in ref_logprobs
            else ref_logprobs["token_logprobs"]
        )
        assert rec["logprobs"] == pytest.approx(values, abs=1e-4)


@pytest.fixture
def engine_claim(rig, engine_server):
    def claim():
        rig.client.publish_resources({"llm": LLM(base_url=engine_server.base_url, model="tiny")})
        rig.client.enqueue([RolloutCreate(task=Task())])
        claim = rig.client.dequeue("w")
        llm = claim.resources.resources["llm"]
        return claim, openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)

    return claim


def test_chat_and_completions_recorded_exactly(rig, engine_server, engine_claim):
    claim, client = engine_claim()
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, **GREEDY)
    assert answer.choices[0].logprobs is None and "prompt_token_ids" not in (answer.model_extra or {})
    client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY)
    chat, completion = (e.data for e in rig.llm_calls(claim.rollout.id))
    _assert_exact(chat, _replay(engine_server, "chat.completions", chat["request"]))
    _assert_exact(completion, _replay(engine_server, "completions", completion["request"]))
    assert chat["model_version"] is not None and chat["usage"]["completion_tokens"] == 16


def test_stream_completion_ids_recorded_exactly(rig, engine_server, engine_claim):
    claim, client = engine_claim()
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY)
        if c.choices
    )
    [call] = (e.data for e in rig.llm_calls(claim.rollout.id))
    truth = _replay(engine_server, "chat.completions", call["request"])
    assert call["stream"] is True and call["choices"][0]["message"]["content"] == text
    assert call["choices"][0]["token_ids"] == truth["choices"][0]["token_ids"]
    assert call["choices"][0]["logprobs"] == pytest.approx(
        [t["logprob"] for t in truth["choices"][0]["logprobs"]["content"]], abs=1e-4
    )


def test_stream_prompt_ids_recorded(rig, engine_server, engine_claim):
    claim, client = engine_claim()
    list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY))
    [call] = (e.data for e in rig.llm_calls(claim.rollout.id))
    assert (
        call["prompt_token_ids"]
        == _replay(engine_server, "chat.completions", call["request"])["prompt_token_ids"]
    )


def test_streamed_completion_recorded_like_the_plain_one(rig, engine_server, engine_claim):
    claim, client = engine_claim()
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="Once upon a time", stream=True, **GREEDY)
        if c.choices
    )
    [call] = (e.data for e in rig.llm_calls(claim.rollout.id))
    assert call["stream"] is True and call["choices"][0]["text"] == text
    _assert_exact(call, _replay(engine_server, "completions", call["request"]))


@pytest.mark.parametrize(
    "name", ["openai_agent", "langchain_agent", "openai_agents_sdk_agent", "autogen_agent"]
)
def test_example_against_the_engine(name, rig, engine_server, monkeypatch):
    sys.path.insert(0, str(EXAMPLES))
    from calculator_task import SYSTEM_PROMPT, TASKS

    agent = load_agent(f"{EXAMPLES / name}.py:{name}")
    sampling = GREEDY
    if name == "openai_agents_sdk_agent":
        # a reply cut at the max_output_tokens the agent set is an incomplete Response, which the
        # Agents SDK raises on (as against OpenAI); the random model's replies end at the
        # engine's own limit instead, one token here (its greedy second token is "42")
        sampling = {"temperature": 0.0}
        engine = engine_server.engine
        monkeypatch.setattr(engine, "config", replace(engine.config, default_max_tokens=1))
    rig.client.publish_resources(
        {
            "llm": LLM(base_url=engine_server.base_url, model="tiny", sampling_parameters=sampling),
            "system_prompt": PromptTemplate(template=SYSTEM_PROMPT),
        }
    )
    [rollout] = rig.client.enqueue([RolloutCreate(task=Task(id=TASKS[0]["id"], data=TASKS[0]))])
    asyncio.run(asyncio.wait_for(Runner(agent, rig.server.url, max_rollouts=1).run(), 120))
    [done] = rig.client.wait([rollout.id], 10).rollouts
    assert done.status == RolloutStatus.SUCCEEDED, done.error
    assert done.reward == 0.0  # a random model does not do arithmetic; the run is what is tested
    calls = [e.data for e in rig.llm_calls(rollout.id)]
    assert calls and all(c["error"] is None and c["upstream_status"] == 200 for c in calls)
    if name == "openai_agents_sdk_agent":  # its default model: the Responses API, translated
        assert all(c["endpoint"] == "responses" and c["token_ids"] is True for c in calls)
    for call in calls:
        truth = _replay(engine_server, "chat.completions", call.get("chat_request") or call["request"])
        assert call["choices"][0]["token_ids"] == truth["choices"][0]["token_ids"]
        if not call["stream"]:
            _assert_exact(call, truth)
