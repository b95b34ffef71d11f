"""Helpers shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

from agentbolt.engine import ModelEngine


def make_engine(path: Path, **config) -> ModelEngine:
    """A float32 engine named "tiny" over the model at ``path``, started; its forward pass the
    engine's own unless ``forward`` says otherwise (the tests cover that path first)."""
    config.setdefault("forward", "auto")
    return ModelEngine.from_pretrained(path, device="cpu", dtype="float32", name="tiny", **config).start()


def teacher_forced_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """Log-probabilities of ``completion_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)


def max_logprob_error(model, responses: list[dict]) -> float:
    """The largest difference between a returned logprob (every choice of every response) and
    a teacher-forced pass of ``model`` over the same tokens."""
    errors = [0.0]
    for response in responses:
        for choice in response["choices"]:
            returned = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
            expected = teacher_forced_logprobs(model, response["prompt_token_ids"], choice["token_ids"])
            errors.append(float((returned - expected).abs().max()))
    return max(errors)


def chat_body(text: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}
