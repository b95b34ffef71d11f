"""The gateway's Responses API side that needs the upstream or the store: passing a call
through to an upstream that serves ``/responses`` (asking it for token ids and logprobs, and
recording them: :mod:`agentbolt.server.responses_ids`), and the conversation behind a
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
from agentbolt.server.responses_ids import prepare, recorded_ids, strip, strip_event
from agentbolt.server.store_caller import StoreCaller

__all__ = ["ResponsesUpstream", "chat_for"]

log = logging.getLogger("agentbolt.gateway")

_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesUpstream:
    """Which upstreams serve ``/responses`` (learnt from their first answer), the calls passed
    to them, and the stored conversations of translated calls."""

    def __init__(self, sender: UpstreamSender, recorder: CallRecorder, call: StoreCaller) -> None:
        self.sender, self.recorder, self.call = sender, recorder, call
        self.serves: dict[str, bool] = {}  # base URL -> whether it has /responses

    def may_serve(self, base_url: str) -> bool:
        return self.serves.get(base_url, True)

    def prepare(self, server: str, body: dict[str, Any]) -> tuple[dict[str, Any], Wants]:
        """The request for ``server``'s /responses (the agent's, with the asks for ids and
        logprobs it does not refuse) and what the agent itself asked for."""
        rejected = self.sender.rejected(server, RESPONSES)
        return prepare(body, "enable_response_messages" not in rejected, "logprobs" not in rejected)

    async def send(self, call: ForwardedCall, payload: dict[str, Any]) -> Response | None:
        """Send a Responses call (``payload``: :meth:`prepare`'s) to an upstream that serves
        /responses; ``None`` when it has none (a 404 or 405, remembered): the call is then
        translated."""
        try:
            upstream = await self.sender.send(call, payload)
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
        data = self._data(call, upstream.status_code, full)
        call_id = await self.recorder.record(call, data)
        return json_answer(data["response"], upstream.status_code, call_id)

    async def _relay(self, call: ForwardedCall, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """A passed-through Responses stream, line by line, without what the agent did not ask
        for; recorded from its final event, which then goes on with the call's id in its
        response (``agentbolt``)."""
        recorded = False
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data:"):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        event = orjson.loads(line[5:].strip())
                        if isinstance(event, dict):
                            final = event.get("response")
                            if (
                                event.get("type") in _FINAL_EVENTS
                                and isinstance(final, dict)
                                and not recorded
                            ):
                                recorded = True
                                data = self._data(call, upstream.status_code, final)
                                with anyio.CancelScope(shield=True):
                                    call_id = await self.recorder.record(call, data)
                                event = {**event, "response": with_call_id(data["response"], call_id)}
                            line = "data: " + orjson.dumps(strip_event(event, call.wants)).decode()
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
        """The record of a passed-through answer, in the chat shape: the ids and logprobs the
        upstream sent (text-only without them), and in ``response`` the answer as the agent gets
        it (``full`` is stripped in place)."""
        prompt_ids, token_ids, logprobs = recorded_ids(full)
        out = strip(full, call.wants)
        data = self.recorder.base_data(call, status, out)
        choice = {**chat_choice(out), "token_ids": token_ids, "logprobs": logprobs}
        data.update(
            prompt_token_ids=prompt_ids,
            choices=[choice],
            usage=chat_usage(out.get("usage")),
            model=out.get("model") or data["model"],
        )
        data["token_ids"] = prompt_ids is not None and token_ids is not None
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
