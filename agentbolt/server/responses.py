"""The Responses API (``POST /v1/responses``) in terms of chat completions, for the gateway.

Model servers such as the embedded engine speak chat completions only, while the OpenAI Agents
SDK's default model speaks the Responses API. The gateway turns a Responses request into one
chat completion (:func:`to_chat`), sends and records that like any chat call (exact token ids),
and answers in the Responses shape the openai clients parse (:func:`to_response`); a streamed
request streams from the model and gets the Responses events as the chunks come
(:class:`~agentbolt.server.responses_events.EventStream`).

Mapping: ``instructions`` is the system message; ``input`` a string (one user message) or items:
messages (text parts joined, images kept as chat image parts), ``function_call`` items (the
assistant's tool calls, consecutive ones merged into one assistant message) and
``function_call_output`` items (tool messages); reasoning items are dropped, the chat model
never saw them. Only function tools can be translated: any other tool is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from agentbolt.turns import drop_examples

__all__ = [
    "REQUEST_SCHEMA",
    "Untranslatable",
    "chat_choice",
    "chat_usage",
    "check",
    "history_of",
    "new_id",
    "output_message",
    "to_chat",
    "to_response",
    "with_history",
]

# Fields copied as they are onto the chat request.
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop")

REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tools": {"anyOf": [{"type": "array", "items": {"type": "object"}}, {"type": "null"}]},
        "stream": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "max_output_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
    },
}


class Untranslatable(ValueError):
    """A request that has no chat-completions equivalent; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check(body: dict[str, Any]) -> tuple[str, str] | None:
    """``(message, param)`` for a malformed request; ``None`` when it can be translated."""
    try:
        to_chat(body)
    except Untranslatable as exc:
        return str(exc), exc.param
    return None


# ---------------------------------------------------------------------------- request


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions request that asks the model what ``body`` asks."""
    _check_fields(body)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise Untranslatable("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    if not messages:
        raise Untranslatable("'input' must hold at least one item", "input")
    chat: dict[str, Any] = {k: body[k] for k in _SAME if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
            raise Untranslatable("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
        chat["max_tokens"] = limit
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


# (field, test, what it must be): the fields REQUEST_SCHEMA types that to_chat does not read
_FIELD_CHECKS: list[tuple[str, Any, str]] = [
    ("model", lambda v: isinstance(v, str), "a string"),
    ("stream", lambda v: isinstance(v, bool), "a boolean"),
    ("tools", lambda v: isinstance(v, list), "a list of objects"),
]


def _check_fields(body: dict[str, Any]) -> None:
    for name, test, what in _FIELD_CHECKS:
        if body.get(name) is not None and not test(body[name]):
            raise Untranslatable(f"'{name}' must be {what}", name)


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise Untranslatable("'input' must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Untranslatable(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            _add_tool_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", i),
                    "content": _text(item.get("output")),
                }
            )
        elif kind != "reasoning":  # the chat model never saw reasoning items: nothing to send
            raise Untranslatable(f"input[{i}] of type {kind!r} cannot be sent to this model", f"input[{i}]")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise Untranslatable(f"input[{i}].role must be user, assistant, system or developer", f"input[{i}]")
    # chat servers such as the embedded engine know no developer role: it is the system prompt
    return {"role": "system" if role == "developer" else role, "content": _content(item.get("content"), i)}


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with an image, the chat list of parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untranslatable(f"input[{i}].content must be a string or a list of parts", f"input[{i}]")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise Untranslatable(
                f"input[{i}] has a content part of type {kind!r} this model cannot take", f"input[{i}]"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _add_tool_call(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    call = {
        "id": _string(item, "call_id", i),
        "type": "function",
        "function": {"name": _string(item, "name", i), "arguments": str(item.get("arguments") or "{}")},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)  # one assistant turn that called several tools
    elif last is not None and last["role"] == "assistant" and "tool_calls" not in last:
        last["tool_calls"] = [call]  # the text said before the call belongs to the same turn
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise Untranslatable(f"input[{i}].{key} must be a non-empty string", f"input[{i}].{key}")
    return value


def _text(output: Any) -> str:
    """A function call's output as the tool message's text."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return "" if output is None else str(output)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise Untranslatable("'tools' must be a list of objects", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise Untranslatable(
                f"tools[{i}] of type {kind!r}: only function tools reach this model", f"tools[{i}]"
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise Untranslatable("'tool_choice' must be auto, none, required or a function", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def history_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a recorded Responses call leaves for the next call that names it as
    ``previous_response_id``: what the model was asked (less that call's instructions, which
    OpenAI does not carry over) and its answer."""
    messages = drop_examples(data["chat_request"]["messages"], data.get("examples", 0))
    if data["request"].get("instructions"):
        messages = messages[1:]
    answer = data["choices"][0]["message"]
    reply: dict[str, Any] = {"role": "assistant", "content": answer.get("content")}
    if answer.get("tool_calls"):
        reply["tool_calls"] = answer["tool_calls"]
    return [*messages, reply]


def with_history(chat: dict[str, Any], body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """``chat`` (from :func:`to_chat`) with the earlier conversation after its system message."""
    at = 1 if body.get("instructions") else 0
    return {**chat, "messages": [*chat["messages"][:at], *history, *chat["messages"][at:]]}


# ---------------------------------------------------------------------------- response


def to_response(chat: dict[str, Any], request: dict[str, Any], response_id: str) -> dict[str, Any]:
    """The Responses-API body for a chat completion (choice 0) answering ``request``."""
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(output_message(message["content"]))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call.get("id") or new_id("call"),
                "name": function.get("name", ""),
                "arguments": function.get("arguments") or "{}",
                "status": "completed",
            }
        )
    # incomplete only at the limit the agent set: a chat server's own length limit has no
    # Responses counterpart, and clients such as the Agents SDK raise on an incomplete answer
    cut = choice.get("finish_reason") == "length" and request.get("max_output_tokens") is not None
    return {
        "id": response_id,
        "object": "response",
        "created_at": chat.get("created") or int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": chat.get("model") or request.get("model") or "",
        "instructions": request.get("instructions"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "metadata": request.get("metadata") or {},
        "text": request.get("text") or {"format": {"type": "text"}},
        "usage": _usage(chat.get("usage")),
    }


def output_message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_id("msg"),
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


# ---------------------------------------------------------------------------- passed through


def chat_choice(response: dict[str, Any]) -> dict[str, Any]:
    """A Responses answer as the chat choice the record keeps (``message``, ``finish_reason``;
    ``token_ids`` and ``logprobs`` none: :mod:`.responses_ids` fills them where the upstream
    sent them), so every reader of llm_call sees one shape."""
    text, calls = [], []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            text += [p.get("text", "") for p in item.get("content") or [] if p.get("type") == "output_text"]
        elif item.get("type") == "function_call":
            function = {"name": item.get("name", ""), "arguments": item.get("arguments", "")}
            calls.append({"id": item.get("call_id"), "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else ("length" if response.get("status") == "incomplete" else "stop")
    return {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "token_ids": None,
        "logprobs": None,
    }


def chat_usage(usage: Any) -> dict[str, int] | None:
    """Responses usage in the chat fields the record keeps."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
