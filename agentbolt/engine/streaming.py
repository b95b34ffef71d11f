"""``stream: true``: ``chat.completion.chunk`` (chat) and ``text_completion`` (completions)
dicts as tokens arrive.

Text is released only when it is final: a suffix that could still grow into a stop string, and an
incomplete UTF-8 character at the end, are held back. When the request carries tools, content is
sent whole in the last chunk (a ``<tool_call>`` block cannot be told from text before it closes).
Each chunk carries its new ``token_ids`` (and ``logprobs`` when asked), so a client that joins the
chunks gets the same ids as a non-streamed response.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from agentbolt.engine.protocol import ChatCompletionRequest, CompletionRequest
from agentbolt.engine.responses import chat_logprobs, chat_message, completion_logprobs, usage
from agentbolt.engine.sampling import SamplingParams
from agentbolt.engine.sequence import Sequence

__all__ = ["Generator", "stream_chat", "stream_completion"]


class Generator(Protocol):
    """What a stream needs of the engine (:class:`~agentbolt.engine.engine.ModelEngine`): its
    served name and weights version for the chunks, its tokenizer for logprobs, and a way to
    make and submit sequences."""

    name: str
    tokenizer: Any

    @property
    def version(self) -> int | str: ...

    def make_sequences(
        self, prompt_ids: list[int], params: SamplingParams, n: int, model: str | None = None
    ) -> list[Sequence]: ...

    def submit(self, seqs: list[Sequence]) -> None: ...


class _Choice:
    def __init__(self, index: int, seq: Sequence) -> None:
        self.index, self.seq, self.sent_text, self.sent_tokens, self.done = index, seq, 0, 0, False
        self.offset = 0  # completions: where the generated text starts (after an echoed prompt)


async def stream_chat(
    engine: Generator, req: ChatCompletionRequest, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[dict[str, Any]]:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": engine.name,
        "system_fingerprint": f"agentbolt-v{engine.version}",
    }
    # the prompt's ids travel once, in the first chunk (as vLLM sends them)
    prompt = [{"prompt_token_ids": list(prompt_ids)}] if req.return_token_ids is not False else []

    def opening(choice: _Choice) -> dict[str, Any]:
        top = prompt.pop() if prompt else {}
        return top | {"choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""}}]}

    async for chunk in _stream(
        engine,
        head,
        [engine.make_sequences(prompt_ids, params, req.n, req.model)],
        opening,
        lambda choice, final: _chunk(engine, req, choice, final),
        len(prompt_ids) if (req.stream_options or {}).get("include_usage") else None,
    ):
        yield chunk


async def stream_completion(
    engine: Generator,
    req: CompletionRequest,
    prompts: list[tuple[str, list[int]]],
    params: list[SamplingParams],
) -> AsyncIterator[dict[str, Any]]:
    """Choice ``i`` is sample ``i % n`` of prompt ``i // n``, as in the non-streamed answer.
    A choice's first chunk carries its ``prompt_token_ids`` (and the prompt text with ``echo``)."""
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.name,
        "system_fingerprint": f"agentbolt-v{engine.version}",
    }
    with_ids = req.return_token_ids is not False

    def opening(choice: _Choice) -> dict[str, Any]:
        prompt_text, prompt_ids = prompts[choice.index // req.n]
        first: dict[str, Any] = {
            "index": choice.index,
            "text": prompt_text if req.echo else "",
            "logprobs": None,
            "finish_reason": None,
        }
        if with_ids:
            first |= {"prompt_token_ids": list(prompt_ids), "token_ids": []}
        choice.offset = len(first["text"])
        return {"choices": [first]}

    groups = [
        engine.make_sequences(ids, p, req.n, req.model) for (_, ids), p in zip(prompts, params, strict=True)
    ]
    include_usage = (req.stream_options or {}).get("include_usage")
    async for chunk in _stream(
        engine,
        head,
        groups,
        opening,
        lambda choice, final: _text_chunk(engine, req, choice, final, with_ids),
        sum(len(ids) for _, ids in prompts) if include_usage else None,
    ):
        yield chunk


async def _stream(
    engine: Generator,
    head: dict[str, Any],
    groups: list[list[Sequence]],
    opening: Callable[[_Choice], dict[str, Any]],
    make_chunk: Callable[[_Choice, bool], dict[str, Any] | None],
    usage_prompt_tokens: int | None,
) -> AsyncIterator[dict[str, Any]]:
    """Submit ``groups`` (one per prompt: the batcher prefills a submission's prompt once), send
    each choice's opening chunk, then a chunk per token event as ``make_chunk`` builds it, and
    the usage last when asked for. Cancels generation if the client goes away."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[bool, Sequence]] = asyncio.Queue()
    seqs = [s for group in groups for s in group]
    choices = {id(s): _Choice(i, s) for i, s in enumerate(seqs)}
    for seq in seqs:
        seq.on_token = lambda s: loop.call_soon_threadsafe(events.put_nowait, (False, s))
        seq.on_done = lambda s: loop.call_soon_threadsafe(events.put_nowait, (True, s))
    try:
        for group in groups:
            engine.submit(group)
        for choice in choices.values():
            yield head | opening(choice)
        while not all(c.done for c in choices.values()):
            final, seq = await events.get()
            chunk = make_chunk(choices[id(seq)], final)
            if chunk is not None:
                yield head | {"model_version": seq.versions[0] if seq.versions else None, "choices": [chunk]}
    finally:
        for seq in seqs:
            seq.cancelled.set()
    if usage_prompt_tokens is not None:
        yield head | {"choices": [], "usage": usage(usage_prompt_tokens, seqs)}


def _text_chunk(
    engine: Generator, req: CompletionRequest, choice: _Choice, final: bool, with_ids: bool
) -> dict[str, Any] | None:
    seq = choice.seq
    if seq.error is not None:
        raise RuntimeError(f"generation failed: {seq.error}") from seq.error
    if choice.done:
        return None
    text = seq.text() if final else _stable_text(seq)
    delta = text[choice.sent_text :]
    if not final and not delta:
        return None  # nothing final yet; the ids go out with the next text
    new_ids = seq.output_ids[choice.sent_tokens :]
    out: dict[str, Any] = {"index": choice.index, "text": delta, "logprobs": None, "finish_reason": None}
    if req.logprobs is not None and new_ids:
        whole = completion_logprobs(engine.tokenizer, seq, req.logprobs, choice.offset)
        out["logprobs"] = {k: v[choice.sent_tokens :] for k, v in whole.items()}
    if with_ids:
        out["token_ids"] = new_ids
    choice.sent_text = max(choice.sent_text, len(text))
    choice.sent_tokens += len(new_ids)
    if final:
        choice.done = True
        out["finish_reason"] = seq.finish_reason
    return out


def _chunk(
    engine: Generator, req: ChatCompletionRequest, choice: _Choice, final: bool
) -> dict[str, Any] | None:
    seq = choice.seq
    if seq.error is not None:
        raise RuntimeError(f"generation failed: {seq.error}") from seq.error
    if choice.done or (req.wants_tool_calls and not final):
        return None
    if req.wants_tool_calls:
        message, _ = chat_message(req, seq)
        delta = {k: v for k, v in message.items() if k != "role"}
    else:
        text = seq.text() if final else _stable_text(seq)
        delta = {"content": text[choice.sent_text :]}
        choice.sent_text = max(choice.sent_text, len(text))
    new_ids = seq.output_ids[choice.sent_tokens :]
    if not final and not delta.get("content"):
        return None  # nothing final yet; the ids go out with the next text
    out: dict[str, Any] = {"index": choice.index, "delta": delta, "finish_reason": None, "token_ids": new_ids}
    if req.logprobs and new_ids:
        out["logprobs"] = chat_logprobs(engine.tokenizer, seq, start=choice.sent_tokens)
    choice.sent_tokens += len(new_ids)
    if final:
        choice.done = True
        out["finish_reason"] = chat_message(req, seq)[1]
    return out


def _stable_text(seq: Sequence) -> str:
    text = seq.decode(seq.output_ids)
    hold = max((len(s) - 1 for s in seq.params.stop), default=0)
    text = text[: len(text) - hold] if hold else text
    return text.rstrip("\ufffd")
