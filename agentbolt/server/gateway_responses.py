"""The gateway's Responses API side that needs the upstream or the store: passing a call
through to an upstream that serves ``/responses``, and the conversation behind a
``previous_response_id`` (see :mod:`agentbolt.server.gateway`; the translation itself is
:mod:`agentbolt.server.responses`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import orjson
from fastapi.responses import Response, StreamingResponse

from agentbolt.schemas import EventType
from agentbolt.server.gateway_call import ForwardedCall, Refused, Target, json_answer, with_call_id
from agentbolt.server.gateway_record import CallRecorder
from agentbolt.server.gateway_send import UpstreamSender
from agentbolt.server.openai_format import RESPONSES, Wants, openai_error
from agentbolt.server.responses import Untranslatable, chat_choice, chat_usage, history_of, to_chat
from agentbolt.server.store_caller import StoreCaller

__all__ = ["PASSED", "ResponsesUpstream", "chat_for"]

log = logging.getLogger("agentbolt.gateway")

PASSED = Wants(token_ids=True, logprobs=True, usage=True)  # a passed-through answer is not stripped
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesUpstream:
    """Which upstreams serve ``/responses`` (learnt from their first answer), the calls passed
    to them, and the stored conversations of translated calls."""

    def __init__(self, sender: UpstreamSender, recorder: CallRecorder, call: StoreCaller) -> None:
        self.sender, self.recorder, self.call = sender, recorder, call
        self.serves: dict[str, bool] = {}  # base URL -> whether it has /responses

    def may_serve(self, base_url: str) -> bool:
        return self.serves.get(base_url, True)

    async def send(self, call: ForwardedCall) -> Response | None:
        """Send a Responses call as it is to an upstream that serves /responses; ``None`` when
        it has none (a 404 or 405, remembered): the call is then translated."""
        try:
            upstream = await self.sender.send_as_is(call)
        except httpx.HTTPError as exc:
            return await self.recorder.unsent(call, exc)
        base = call.upstream  # the server that answered (another one when the first sent nothing)
        if upstream.status_code in (404, 405):
            await upstream.aclose()
            if base not in self.serves:
                log.info(
                    "model server %s has no /responses: Responses calls are translated",
                    self.sender.upstreams.public(base),
                )
            self.serves[base] = False
            return None
        self.serves[base] = True
        if upstream.status_code >= 400:
            return await self.recorder.upstream_error(call, upstream)
        if call.request.get("stream"):
            return StreamingResponse(
                self._relay(call, upstream),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            full = orjson.loads(await upstream.aread())
        except (orjson.JSONDecodeError, httpx.HTTPError) as exc:
            return await self.recorder.unreadable(call, exc, upstream.status_code)
        call_id = await self.recorder.record(call, self._data(call, upstream.status_code, full))
        return json_answer(full, upstream.status_code, call_id)

    async def _relay(self, call: ForwardedCall, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """A passed-through Responses stream, line by line; recorded from its final event,
        which then goes on with the call's id in its response (``agentbolt``)."""
        final: dict[str, Any] | None = None
        recorded = False
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data:") and not recorded:
                    with contextlib.suppress(orjson.JSONDecodeError):
                        event = orjson.loads(line[5:].strip())
                        if isinstance(event, dict) and event.get("type") in _FINAL_EVENTS:
                            final = event.get("response")
                            if isinstance(final, dict):
                                recorded = True
                                with anyio.CancelScope(shield=True):
                                    call_id = await self.recorder.record(
                                        call, self._data(call, upstream.status_code, final)
                                    )
                                event = {**event, "response": with_call_id(final, call_id)}
                                line = "data: " + orjson.dumps(event).decode()
                yield line.encode() + b"\n"
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
                if not recorded:
                    error = openai_error("the stream ended without a final response", "upstream_stream_error")
                    await self.recorder.record(
                        call, self.recorder.error_data(call, upstream.status_code, error)
                    )

    def _data(self, call: ForwardedCall, status: int, full: dict[str, Any]) -> dict[str, Any]:
        """The record of a passed-through answer: text-only unless the upstream sent ids."""
        data = self.recorder.base_data(call, status, full)
        choice = chat_choice(full)
        data.update(
            prompt_token_ids=full.get("prompt_token_ids"),
            choices=[choice],
            usage=chat_usage(full.get("usage")),
            model=full.get("model") or data["model"],
        )
        data["token_ids"] = data["prompt_token_ids"] is not None and choice["token_ids"] is not None
        return data

    async def history(self, target: Target, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to the attempt's Response ``response_id``, from its recorded
        call: the state lives in the store, so any replica can continue it."""
        found, cursor = None, None
        while True:
            page = await self.call(
                self.call.store.list_events,
                attempt_id=target.attempt_id,
                types=[EventType.LLM_CALL.value],
                limit=500,
                cursor=cursor,
            )
            for event in page.items:
                data = event.data
                if (
                    data.get("endpoint") == RESPONSES
                    and (data.get("response") or {}).get("id") == response_id
                ):
                    found = data
            if page.next_cursor is None or not page.items:
                break
            cursor = page.next_cursor
        if found is None or found.get("error") or not found.get("choices"):
            message = f"previous response {response_id!r} not found among this attempt's answered calls"
            raise Refused(400, message, "invalid_request_error", "previous_response_id")
        return history_of(found)


def chat_for(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request for a Responses request (without the history a
    ``previous_response_id`` brings: that needs the attempt)."""
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise Untranslatable("'previous_response_id' must be a string", "previous_response_id")
    chat = to_chat(body)
    if body.get("stream"):
        chat["stream"] = True
    return chat
