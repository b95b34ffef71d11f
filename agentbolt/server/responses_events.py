"""A streamed Responses call as Responses events: the gateway streams the chat completion it
became from the model and hands the agent the events the openai clients parse, as the chunks
come (the translation of whole requests and answers: :mod:`agentbolt.server.responses`)."""

from __future__ import annotations

from typing import Any

from agentbolt.server.responses import new_id, output_message, to_response

__all__ = ["EventStream"]


class EventStream:
    """The Responses events of one streamed chat completion (choice 0), chunk by chunk: created
    and in_progress first, each output item added when its first delta comes, its text or
    arguments as deltas, and at the end every item done and the response completed."""

    def __init__(self, request: dict[str, Any], response_id: str) -> None:
        self.request, self.response_id = request, response_id
        self.number = 0
        self.next_index = 0
        self.text: dict[str, Any] | None = None  # the message item: id, output_index
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> id, output_index

    def start(self) -> list[dict[str, Any]]:
        pending = {**to_response({}, self.request, self.response_id), "status": "in_progress", "usage": None}
        return self._numbered(
            [
                {"type": "response.created", "response": pending},
                {"type": "response.in_progress", "response": pending},
            ]
        )

    def add(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:  # a Response has one answer: choice 0
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
        return self._numbered(events)

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.text is None:
            self.text = {"id": new_id("msg"), "output_index": self._next()}
            item = {**output_message(""), "id": self.text["id"], "content": [], "status": "in_progress"}
            blank = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": self.text["output_index"],
                    "item": item,
                },
                {
                    "type": "response.content_part.added",
                    **self._at(self.text),
                    "content_index": 0,
                    "part": blank,
                },
            ]
        delta = {"type": "response.output_text.delta", **self._at(self.text), "content_index": 0}
        return [*events, {**delta, "delta": text, "logprobs": []}]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function") or {}
        slot = self.calls.get(call.get("index", 0))
        events = []
        if slot is None:
            slot = self.calls[call.get("index", 0)] = {"id": new_id("fc"), "output_index": self._next()}
            item = {
                "type": "function_call",
                "id": slot["id"],
                "call_id": call.get("id") or new_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            events.append(
                {"type": "response.output_item.added", "output_index": slot["output_index"], "item": item}
            )
        if function.get("arguments"):
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    **self._at(slot),
                    "delta": function["arguments"],
                }
            )
        return events

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """Every item done and the final response (the recorded one, given the ids streamed)."""
        messages = [item for item in response["output"] if item["type"] == "message"]
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        placed: list[tuple[int, dict[str, Any]]] = []
        if self.text is not None and messages:
            messages[0]["id"] = self.text["id"]
            placed.append((self.text["output_index"], messages[0]))
        for slot, item in zip((self.calls[i] for i in sorted(self.calls)), calls, strict=False):
            item["id"] = slot["id"]
            placed.append((slot["output_index"], item))
        response["output"] = [item for _, item in sorted(placed, key=lambda p: p[0])]
        events: list[dict[str, Any]] = []
        for index, item in enumerate(response["output"]):
            events += _done_events(index, item)
        end = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._numbered([*events, {"type": end, "response": response}])

    def error(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        found = body.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        event = {
            "type": "error",
            "code": error.get("code"),
            "message": error.get("message", ""),
            "param": None,
        }
        return self._numbered([event])

    def _next(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    @staticmethod
    def _at(slot: dict[str, Any]) -> dict[str, Any]:
        return {"output_index": slot["output_index"], "item_id": slot["id"]}

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for event in events:
            event["sequence_number"] = self.number
            self.number += 1
        return events


def _done_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    at = {"output_index": index, "item_id": item["id"]}
    done = {"type": "response.output_item.done", "output_index": index, "item": item}
    if item["type"] == "function_call":
        return [{"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}, done]
    part = item["content"][0]
    return [
        {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
        done,
    ]
