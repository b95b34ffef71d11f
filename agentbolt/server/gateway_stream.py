"""A streamed gateway call: the upstream's chunks passed on as they come (stripped of what the
gateway added, or as Responses events for a translated Responses call) and recorded
reassembled before the stream ends, so the record exists when the agent's call returns (see
:mod:`agentbolt.server.gateway`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import orjson

from agentbolt.server.gateway_call import ForwardedCall, with_call_id
from agentbolt.server.gateway_record import CallRecorder
from agentbolt.server.openai_format import CHAT, StreamAssembler, openai_error, strip
from agentbolt.server.responses_events import EventStream

__all__ = ["relay", "sse"]


async def relay(
    recorder: CallRecorder, call: ForwardedCall, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """Pass a stream through chunk by chunk (stripped); record it reassembled before the
    final ``[DONE]``. The call's id rides on the last chunk (``agentbolt``): a closing chunk
    (finish reasons, or usage with no choices) waits for the next one, so that the last can
    carry it; a stream that ends with another chunk gets one more, with no choices."""
    relayed = _Relayed(call)
    if relayed.events is not None:
        yield sse(relayed.events.start())
    recorded = False
    try:
        async for line in upstream.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            for out in relayed.add(orjson.loads(data)):
                yield out
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        message = f"the model server's stream broke: {call.scrub(str(exc))}"
        for out in relayed.fail(openai_error(message, "upstream_stream_error", 502)):
            yield out
    except BaseException:  # the agent went away: still record what came
        relayed.error = openai_error("the client disconnected before the stream ended", "client_disconnected")
        raise
    else:
        recorded = True
        answer, call_id = await _record(recorder, call, upstream, relayed)
        for out in relayed.finish(answer, call_id):
            yield out
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
            if not recorded:
                await _record(recorder, call, upstream, relayed)


class _Relayed:
    """What a relayed stream has seen so far, and the bytes each chunk becomes."""

    def __init__(self, call: ForwardedCall) -> None:
        self.call = call
        self.assembler = StreamAssembler(call.endpoint)
        self.events = (
            EventStream(call.responses, call.response_id or "") if call.responses is not None else None
        )
        self.error: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {"time_to_first_token_ms": None}
        self.held: dict[str, Any] | None = None  # a closing chunk, kept back to carry the call's id

    def add(self, chunk: dict[str, Any]) -> list[bytes]:
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            return self.fail(chunk if isinstance(error, dict) else openai_error(str(error), "upstream_error"))
        if self.extra["time_to_first_token_ms"] is None:
            self.extra["time_to_first_token_ms"] = self.call.elapsed_ms()
        self.assembler.add(chunk)
        if self.events is not None:
            return [sse(self.events.add(chunk))]
        out = strip(chunk, self.call.wants, stream=True)
        if out is None:
            return []
        sent = self._release()
        if _closing(out):
            self.held = out
        else:
            sent.append(_sse_chunk(out))
        return sent

    def fail(self, error: dict[str, Any]) -> list[bytes]:
        self.error = error
        return [*self._release(), sse(self.events.error(error)) if self.events else _sse_chunk(error)]

    def finish(self, answer: dict[str, Any] | None, call_id: int | None) -> list[bytes]:
        """The stream's end: the last chunk with the call's id, then ``[DONE]`` (for Responses
        events: the final event, its response carrying the id)."""
        if self.events is not None:
            return [] if answer is None else [sse(self.events.finish(with_call_id(answer, call_id)))]
        sent = []
        if self.held is not None:
            sent.append(_sse_chunk(with_call_id(self.held, call_id)))
        elif call_id is not None:
            sent.append(_sse_chunk(_id_chunk(self.call.endpoint, answer, call_id)))
        return [*sent, b"data: [DONE]\n\n"]

    def _release(self) -> list[bytes]:
        held, self.held = self.held, None
        return [] if held is None else [_sse_chunk(held)]


async def _record(
    recorder: CallRecorder, call: ForwardedCall, upstream: httpx.Response, relayed: _Relayed
) -> tuple[dict[str, Any] | None, int | None]:
    """Record a finished stream; the answer as the agent gets it (``None`` after an error)
    and the id of its record."""
    if relayed.error is not None:
        data = recorder.error_data(
            call, upstream.status_code, relayed.error, relayed.assembler.response(), relayed.extra
        )
        return None, await recorder.record(call, data)
    return await recorder.success(
        call, relayed.assembler.response(), upstream.status_code, upstream.headers, relayed.extra
    )


def sse(events: list[dict[str, Any]]) -> bytes:
    """Responses events as server-sent events (named, as OpenAI sends them)."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


def _sse_chunk(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _closing(chunk: dict[str, Any]) -> bool:
    """A chunk that may be a stream's last: every choice finished, or none (usage)."""
    return all(isinstance(c, dict) and c.get("finish_reason") for c in chunk.get("choices") or [])


def _id_chunk(endpoint: str, answer: dict[str, Any] | None, call_id: int) -> dict[str, Any]:
    """The chunk that ends a stream with the call's id: no choices (as the usage chunk OpenAI
    sends), the stream's id, model and time, and the ``agentbolt`` field."""
    top = answer or {}
    chunk: dict[str, Any] = {
        "id": top.get("id") or "",
        "object": "chat.completion.chunk" if endpoint == CHAT else "text_completion",
        "created": top.get("created") or int(time.time()),
        "model": top.get("model") or "",
        "choices": [],
    }
    return with_call_id(chunk, call_id)
