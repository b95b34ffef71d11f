"""Several LoRA adapters served at once (vLLM's ``/v1/load_lora_adapter``): rows of one decode
step on different adapters, each exactly its adapter alone on the base model (PEFT's own pass),
and loading or unloading one leaving the others and the running sequences alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import chat_body, make_engine, teacher_forced_logprobs
from test_engine_weights import _adapter, _peft_logprobs

from agentbolt.engine import EngineRequestError, EngineServer, ModelEngine

PROMPT = "Name three colours."


async def _ask(engine: ModelEngine, model: str, max_tokens: int = 12) -> dict:
    body = chat_body(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True)
    return await engine.chat({**body, "model": model})


def _logprobs(response: dict) -> torch.Tensor:
    return torch.tensor([e["logprob"] for e in response["choices"][0]["logprobs"]["content"]])


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "planner": _adapter(tiny_dir, folder / "planner", seed=1, targets=["q_proj", "v_proj", "down_proj"]),
        "solver": _adapter(
            tiny_dir, folder / "solver", seed=2, targets=["k_proj", "o_proj", "up_proj", "gate_proj"]
        ),
    }


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_two_adapters_and_the_base_share_decode_steps_each_exact(
    fresh_engine: ModelEngine, tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    for name, path in adapters.items():
        assert fresh_engine.load_lora_adapter(name, str(path)) == name
    assert {m["id"] for m in fresh_engine.models()["data"]} == {"tiny", "planner", "solver"}
    seen: list[set[str | None]] = []
    row_adapters = fresh_engine._batcher.adapters
    assert row_adapters is not None
    select = row_adapters.select

    def recording(rows):  # type: ignore[no-untyped-def]
        seen.append({r.name if r is not None else None for r in rows})
        select(rows)

    row_adapters.select = recording  # type: ignore[method-assign]
    base, planner, solver = await asyncio.gather(
        _ask(fresh_engine, "tiny"), _ask(fresh_engine, "planner"), _ask(fresh_engine, "solver")
    )
    assert {None, "planner", "solver"} in seen  # one decode step held all three
    assert (base["model_version"], planner["model_version"], solver["model_version"]) == (
        0,
        "planner",
        "solver",
    )
    ids = base["prompt_token_ids"]
    expected = teacher_forced_logprobs(fresh_engine.model, ids, base["choices"][0]["token_ids"])
    assert torch.allclose(_logprobs(base), expected, atol=1e-4)
    for name, response in (("planner", planner), ("solver", solver)):
        out = response["choices"][0]["token_ids"]
        want = _peft_logprobs(tiny_dir, adapters[name], ids, out)  # that adapter alone, PEFT's pass
        assert torch.allclose(_logprobs(response), want, atol=1e-4), (
            name,
            (_logprobs(response) - want).abs().max(),
        )
    assert len({tuple(r["choices"][0]["token_ids"]) for r in (base, planner, solver)}) == 3
    # the weights themselves never changed
    again = await _ask(fresh_engine, "tiny")
    assert again["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_unloading_one_leaves_the_other_and_the_running_sequences(
    fresh_engine: ModelEngine, tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    for name, path in adapters.items():
        fresh_engine.load_lora_adapter(name, str(path))
    running = asyncio.create_task(_ask(fresh_engine, "planner", max_tokens=60))
    await asyncio.sleep(0.05)
    fresh_engine.unload_lora_adapter("planner")
    finished = await running  # finishes on the adapter it started with
    want = _peft_logprobs(
        tiny_dir, adapters["planner"], finished["prompt_token_ids"], finished["choices"][0]["token_ids"]
    )
    assert torch.allclose(_logprobs(finished), want, atol=1e-4)
    with pytest.raises(EngineRequestError, match="was unloaded") as refused:
        await _ask(fresh_engine, "planner")  # never the base in its place
    assert refused.value.status_code == 404
    solver = await _ask(fresh_engine, "solver")
    assert solver["model_version"] == "solver"
    with pytest.raises(EngineRequestError, match="no LoRA adapter named 'planner'.*loaded: solver"):
        fresh_engine.unload_lora_adapter("planner")
    # loaded again, it serves again
    fresh_engine.load_lora_adapter("planner", str(adapters["planner"]))
    assert (await _ask(fresh_engine, "planner"))["model_version"] == "planner"


def test_the_http_routes_speak_vllms_bodies(fresh_engine: ModelEngine, adapters: dict[str, Path]) -> None:
    with EngineServer(fresh_engine) as served, httpx.Client(base_url=served.base_url, timeout=60) as http:
        ok = http.post(
            "/load_lora_adapter", json={"lora_name": "solver", "lora_path": str(adapters["solver"])}
        )
        assert ok.status_code == 200 and ok.json()["lora_name"] == "solver"
        assert "solver" in {m["id"] for m in http.get("/models").json()["data"]}
        assert http.post("/unload_lora_adapter", json={"lora_name": "solver"}).status_code == 200
        gone = http.post("/unload_lora_adapter", json={"lora_name": "solver"})
        assert gone.status_code == 404 and "no LoRA adapter named 'solver'" in gone.json()["error"]["message"]
        same = http.post(
            "/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapters["solver"])}
        )
        assert same.status_code == 400 and "base model's name" in same.json()["error"]["message"]


def test_transformers_forward_refuses_with_the_reason(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    engine = make_engine(tiny_dir, forward="transformers")
    try:
        with pytest.raises(EngineRequestError, match="needs the engine's own forward pass"):
            engine.load_lora_adapter("solver", str(adapters["solver"]))
    finally:
        engine.close()
