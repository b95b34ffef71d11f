"""Finished sequences -> OpenAI response bodies with vLLM's token-id fields.

Fields beyond OpenAI's: top-level ``prompt_token_ids`` and per-choice ``token_ids`` (vLLM's
``return_token_ids``; sent unless the request says ``return_token_ids: false``), top-level
``model_version`` (also in ``system_fingerprint``), and per-choice ``model_versions`` plus
top-level ``model_version_mixed: true`` only when the weights changed while a choice was generated.
Log-probabilities are of the raw model distribution; ``token_ids`` and ``logprobs`` include the
end-of-sequence token and the token that completed a stop string, while ``content`` does not.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from agentbolt.engine.chat_format import parse_tool_calls
from agentbolt.engine.protocol import ChatCompletionRequest, CompletionRequest
from agentbolt.engine.sequence import Sequence

__all__ = ["chat_response", "completion_response", "usage"]


def _header(kind: str, prefix: str, model: str, seqs: list[Sequence]) -> dict[str, Any]:
    version = seqs[0].versions[0] if seqs and seqs[0].versions else None
    head = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"agentbolt-v{version}",
        "model_version": version,
    }
    if any(len(set(s.versions)) > 1 for s in seqs):
        head["model_version_mixed"] = True
    return head


def usage(prompt_tokens: int, seqs: list[Sequence]) -> dict[str, int]:
    completion = sum(len(s.output_ids) for s in seqs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.batch_decode([[i] for i in ids]) if ids else []


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokenizer, seq: Sequence, start: int = 0) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` for the completion tokens from ``start`` on."""
    texts = _token_texts(tokenizer, seq.output_ids[start:])
    content = []
    for i, (text, lp) in enumerate(zip(texts, seq.logprobs[start:], strict=True), start=start):
        top = seq.top_logprobs[i] if i < len(seq.top_logprobs) else []
        top_texts = _token_texts(tokenizer, [t for t, _ in top])
        alternatives = [_entry(t, v) for t, (_, v) in zip(top_texts, top, strict=True)]
        content.append(_entry(text, lp) | {"top_logprobs": alternatives})
    return {"content": content}


def chat_message(req: ChatCompletionRequest, seq: Sequence) -> tuple[dict[str, Any], str | None]:
    text = seq.text()
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reason = seq.finish_reason
    if req.wants_tool_calls:
        content, calls = parse_tool_calls(text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            reason = "tool_calls" if reason == "stop" else reason
    return message, reason


def chat_response(
    req: ChatCompletionRequest, model: str, tokenizer, prompt_ids: list[int], seqs: list[Sequence]
) -> dict[str, Any]:
    with_ids = req.return_token_ids is not False
    choices = []
    for i, seq in enumerate(seqs):
        message, reason = chat_message(req, seq)
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(tokenizer, seq) if req.logprobs else None,
            "finish_reason": reason,
        }
        if with_ids:
            choice["token_ids"] = list(seq.output_ids)
        if len(set(seq.versions)) > 1:
            choice["model_versions"] = list(seq.versions)
        choices.append(choice)
    body = _header("chat.completion", "chatcmpl", model, seqs) | {"choices": choices}
    if with_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body | {"usage": usage(len(prompt_ids), seqs)}


def completion_logprobs(tokenizer, seq: Sequence, k: int, offset: int) -> dict[str, Any]:
    texts = _token_texts(tokenizer, seq.output_ids)
    offsets, top = [], []
    for i, text in enumerate(texts):
        offsets.append(offset)
        offset += len(text)
        alternatives = seq.top_logprobs[i][:k] if k else []
        names = _token_texts(tokenizer, [t for t, _ in alternatives])
        top.append(dict(zip(names, (v for _, v in alternatives), strict=True)) | {text: seq.logprobs[i]})
    return {
        "tokens": texts,
        "token_logprobs": list(seq.logprobs),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def completion_response(
    req: CompletionRequest, model: str, tokenizer, prompts: list[tuple[str, list[int]]], seqs: list[Sequence]
) -> dict[str, Any]:
    with_ids = req.return_token_ids is not False
    choices = []
    for i, seq in enumerate(seqs):
        prompt_text, prompt_ids = prompts[i // req.n]
        prefix = prompt_text if req.echo else ""
        choice: dict[str, Any] = {
            "index": i,
            "text": prefix + seq.text(),
            "logprobs": None,
            "finish_reason": seq.finish_reason,
        }
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(tokenizer, seq, req.logprobs, len(prefix))
        if with_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = list(seq.output_ids)
        if len(set(seq.versions)) > 1:
            choice["model_versions"] = list(seq.versions)
        choices.append(choice)
    body = _header("text_completion", "cmpl", model, seqs) | {"choices": choices}
    if with_ids and len(prompts) == 1:
        body["prompt_token_ids"] = list(prompts[0][1])
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return body | {"usage": usage(prompt_tokens, seqs)}
