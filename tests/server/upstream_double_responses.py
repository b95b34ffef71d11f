"""TEST DOUBLE, its ``/v1/responses``: a fixed answer ("Hosted answer.") in vLLM 0.34.0's shapes.

As vLLM does for a model without the Harmony format: ``enable_response_messages: true`` adds
``input_messages`` and ``output_messages``, one ``raw_message_tokens`` each (the rendered prompt
and the completion, with their ids); ``include: ["message.output_text.logprobs"]`` adds one
logprob per generated token on the output text (and ``top_logprobs: 0``); without them those
fields are ``null``. A stream sends vLLM's events, a text delta per word, each with the logprobs
of its tokens (``[]`` without the ask), and ends with ``response.completed`` holding the same
body as the plain answer. The ids come from the double's byte tokenizer (one id per UTF-8 byte,
+3), so tests can check them exactly.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

TEXT = "Hosted answer."
WORDS = ["Hosted", " answer", "."]
CREATED = 1_700_000_000
LOGPROBS = "message.output_text.logprobs"


def ids(text: str) -> list[int]:
    """The double's byte 'tokenizer': one id per UTF-8 byte (+3 for special ids)."""
    return [b + 3 for b in text.encode()]


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as the double's chat template renders it: ``<role>text`` per message."""
    turns = [("system", body["instructions"])] if body.get("instructions") else []
    given = body.get("input")
    for item in [{"role": "user", "content": given}] if isinstance(given, str) else given or []:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        turns.append((str(item.get("role", item.get("type"))), str(content or item.get("output") or "")))
    return "".join(f"<{role}>{text}" for role, text in turns) + "<assistant>"


def _logprobs(word: str, start: int) -> list[dict[str, Any]]:
    """One entry per byte of ``word`` (its tokens), the ``start``-th token of the answer first."""
    return [
        {"token": chr(b), "logprob": -round(0.01 * (start + i + 1), 4), "bytes": [b], "top_logprobs": []}
        for i, b in enumerate(word.encode())
    ]


def answer(body: dict[str, Any]) -> dict[str, Any]:
    """The ``ResponsesResponse`` for ``body``."""
    with_ids, with_logprobs = (
        body.get("enable_response_messages") is True,
        LOGPROBS in (body.get("include") or []),
    )
    prompt = prompt_text(body)
    part = {
        "type": "output_text",
        "text": TEXT,
        "annotations": [],
        "logprobs": _logprobs(TEXT, 0) if with_logprobs else None,
    }
    message = {
        "type": "message",
        "id": "msg_hosted",
        "role": "assistant",
        "status": "completed",
        "content": [part],
    }
    usage = {
        "input_tokens": len(ids(prompt)),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(ids(TEXT)),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(ids(prompt)) + len(ids(TEXT)),
    }
    return {
        "id": "resp_hosted",
        "object": "response",
        "created_at": CREATED,
        "status": "completed",
        "model": body.get("model"),
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0 if with_logprobs else None,
        "usage": usage,
        "input_messages": [_raw(prompt)] if with_ids else None,
        "output_messages": [_raw(TEXT)] if with_ids else None,
    }


def _raw(text: str) -> dict[str, Any]:
    """vLLM's ``ResponseRawMessageAndToken``."""
    return {"message": text, "tokens": ids(text), "type": "raw_message_tokens"}


def events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, as vLLM's simple (non-Harmony) streaming sends them."""
    full = answer(body)
    message = full["output"][0]
    part = message["content"][0]
    at = {"item_id": "msg_hosted", "output_index": 0, "content_index": 0}
    asked = part["logprobs"] is not None
    deltas, start = [], 0
    for word in WORDS:
        # a delta's logprobs are the openai delta event's: no ``bytes``
        logprobs = [{k: v for k, v in lp.items() if k != "bytes"} for lp in _logprobs(word, start)]
        logprobs = logprobs if asked else []
        deltas.append({"type": "response.output_text.delta", **at, "delta": word, "logprobs": logprobs})
        start += len(word.encode())
    begun = {**full, "status": "in_progress", "output": [], "usage": None}
    begun.update(input_messages=None, output_messages=None)
    return [
        {"type": "response.created", "response": begun},
        {"type": "response.in_progress", "response": begun},
        {"type": "response.output_item.added", "output_index": 0, "item": {**message, "content": []}},
        {"type": "response.content_part.added", **at, "part": {**part, "text": "", "logprobs": []}},
        *deltas,
        {"type": "response.output_text.done", **at, "text": TEXT, "logprobs": []},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        {"type": "response.completed", "response": full},
    ]


def respond(body: dict[str, Any]) -> Any:
    """The HTTP answer: the body, or its events as server-sent events."""
    if not body.get("stream"):
        return JSONResponse(answer(body))
    lines = "".join(
        f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n"
        for i, e in enumerate(events(body))
    )
    return StreamingResponse(iter([lines]), media_type="text/event-stream")
