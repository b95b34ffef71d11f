"""``stream: true`` for chat: ``chat.completion.chunk`` dicts as tokens arrive.

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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentbolt.engine.protocol import ChatCompletionRequest
from agentbolt.engine.responses import chat_logprobs, chat_message, usage
from agentbolt.engine.sampling import SamplingParams
from agentbolt.engine.sequence import Sequence

if TYPE_CHECKING:
    from agentbolt.engine.engine import ModelEngine

__all__ = ["stream_chat"]


class _Choice:
    def __init__(self, index: int, seq: Sequence) -> None:
        self.index, self.seq, self.sent_text, self.sent_tokens, self.done = index, seq, 0, 0, False


async def stream_chat(
    engine: ModelEngine, req: ChatCompletionRequest, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[bool, Sequence]] = asyncio.Queue()
    seqs = engine.make_sequences(prompt_ids, params, req.n)
    choices = {id(s): _Choice(i, s) for i, s in enumerate(seqs)}
    for seq in seqs:
        seq.on_token = lambda s: loop.call_soon_threadsafe(events.put_nowait, (False, s))
        seq.on_done = lambda s: loop.call_soon_threadsafe(events.put_nowait, (True, s))
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
    }
    head |= {"model": engine.name, "system_fingerprint": f"agentbolt-v{engine.version}"}
    engine.submit(seqs)
    try:
        for choice in choices.values():
            yield head | {"choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""}}]}
        while not all(c.done for c in choices.values()):
            final, seq = await events.get()
            chunk = _chunk(engine, req, choices[id(seq)], final)
            if chunk is not None:
                yield head | {"model_version": seq.versions[0] if seq.versions else None, "choices": [chunk]}
    finally:
        for seq in seqs:
            seq.cancelled.set()
    if (req.stream_options or {}).get("include_usage"):
        yield head | {"choices": [], "usage": usage(len(prompt_ids), seqs)}


def _chunk(
    engine: ModelEngine, req: ChatCompletionRequest, choice: _Choice, final: bool
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
