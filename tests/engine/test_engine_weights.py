"""Live weight updates: state dicts, LoRA adapters, versions, and requests that span an update."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_helpers import chat_body, teacher_forced_logprobs
from safetensors.torch import save_file

from agentbolt.engine import EngineRequestError, ModelEngine

PROMPT = "What is 12 plus 30?"


async def _greedy(engine: ModelEngine, max_tokens: int = 16, **extra) -> dict:
    return await engine.chat(
        chat_body(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)
    )


def _perturbed(engine: ModelEngine, scale: float = 0.5) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state["lm_head.weight"] += scale * torch.randn(state["lm_head.weight"].shape, generator=generator)
    return state


async def test_state_dict_update_changes_outputs_and_version(
    fresh_engine: ModelEngine, tmp_path: Path
) -> None:
    assert fresh_engine.stats()["forward"] == "engine"  # the engine's own forward sees updates
    original = {k: v.clone() for k, v in fresh_engine.model.state_dict().items()}
    before = await _greedy(fresh_engine)
    assert before["model_version"] == 0
    assert await fresh_engine.aupdate_weights(state_dict=_perturbed(fresh_engine)) == 1
    after = await _greedy(fresh_engine)
    assert after["model_version"] == 1 and after["system_fingerprint"] == "agentbolt-v1"
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    # a safetensors file on disk works too, with a caller-chosen version
    save_file(original, str(tmp_path / "w.safetensors"))
    assert (
        await fresh_engine.aupdate_weights(state_dict=str(tmp_path / "w.safetensors"), version="v-orig")
        == "v-orig"
    )
    restored = await _greedy(fresh_engine)
    assert restored["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert restored["model_version"] == "v-orig"


def _adapter(base_dir: Path, out: Path, seed: int, targets: list[str]) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def _peft_logprobs(base_dir: Path, adapter: Path, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter
    )
    return teacher_forced_logprobs(model.eval(), prompt_ids, ids)


@pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)  # peft vs transformers 5
async def test_lora_adapters_apply_to_the_base_weights(
    fresh_engine: ModelEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    assert fresh_engine.stats()["forward"] == "engine"
    base = await _greedy(fresh_engine)
    first = _adapter(tiny_dir, tmp_path / "a1", seed=1, targets=["q_proj", "v_proj", "down_proj"])
    second = _adapter(tiny_dir, tmp_path / "a2", seed=2, targets=["k_proj", "up_proj"])
    for adapter, name in ((first, "policy-1"), (second, "policy-2")):
        version = await fresh_engine.aupdate_weights(adapter_path=str(adapter), version=name)
        assert version == name
        response = await _greedy(fresh_engine, logprobs=True)
        choice = response["choices"][0]
        assert response["model_version"] == name and choice["token_ids"] != base["choices"][0]["token_ids"]
        returned = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        # equal to PEFT running this adapter alone on the base model: adapters do not stack
        expected = _peft_logprobs(tiny_dir, adapter, response["prompt_token_ids"], choice["token_ids"])
        assert torch.allclose(returned, expected, atol=1e-4), (returned - expected).abs().max()


async def test_running_request_finishes_on_its_version(fresh_engine: ModelEngine) -> None:
    old = await _greedy(fresh_engine, max_tokens=80)
    long_task = asyncio.create_task(_greedy(fresh_engine, max_tokens=80))
    while fresh_engine.stats()["running"] == 0:
        await asyncio.sleep(0.002)
    version = await fresh_engine.aupdate_weights(state_dict=_perturbed(fresh_engine), version=7)
    assert version == 7
    finished = await long_task
    # the swap waited: every token of the running request came from the old weights
    assert finished["model_version"] == 0 and "model_version_mixed" not in finished
    assert finished["choices"][0]["token_ids"] == old["choices"][0]["token_ids"]
    assert (await _greedy(fresh_engine))["model_version"] == 7


async def test_update_past_the_drain_timeout_marks_the_request(fresh_engine: ModelEngine) -> None:
    long_task = asyncio.create_task(_greedy(fresh_engine, max_tokens=120))
    while fresh_engine.stats()["running"] == 0:
        await asyncio.sleep(0.002)
    await fresh_engine.aupdate_weights(state_dict=_perturbed(fresh_engine), version=3, drain_timeout_s=0)
    response = await long_task
    assert response["model_version"] == 0 and response["model_version_mixed"] is True
    assert response["choices"][0]["model_versions"] == [0, 3]


def test_bad_updates_are_refused_before_anything_changes(fresh_engine: ModelEngine, tmp_path: Path) -> None:
    with pytest.raises(EngineRequestError, match="does not belong"):
        fresh_engine.update_weights(state_dict={"nope.weight": torch.zeros(1)})
    with pytest.raises(EngineRequestError, match="shape"):
        fresh_engine.update_weights(state_dict={"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(EngineRequestError, match="adapter_config"):
        fresh_engine.update_weights(adapter_path=str(tmp_path))
    with pytest.raises(EngineRequestError, match="exactly one"):
        fresh_engine.update_weights()
    assert fresh_engine.version == 0
