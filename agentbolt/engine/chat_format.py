"""OpenAI chat messages -> prompt token ids through the model's chat template; tool calls back out.

Tool calls use the Hermes / Qwen convention, which many small instruct models were tuned on. When
the chat template renders ``tools`` itself (its source mentions ``tools``), the tools and the
assistant ``tool_calls`` are handed to it. Otherwise (SmolLM2's template has no tool support) the
tool list is written into the system message as JSON, and earlier assistant tool calls are written
into their message text in the same form the model is asked to produce.

Parse rule for the model's output (only when the request carried ``tools`` and ``tool_choice`` is
not ``"none"``): every ``<tool_call>{json}</tool_call>`` block whose JSON is an object with a string
``name`` (and ``arguments`` or ``parameters``, an object or a JSON string) becomes one OpenAI
``tool_call``; the text outside the blocks, stripped, is the message ``content`` (None if empty).
A block that does not parse stays in the content as text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from agentbolt.engine.protocol import EngineRequestError

__all__ = ["parse_tool_calls", "render_chat_prompt", "template_supports_tools", "tools_system_text"]

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_chat_prompt(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the prompt, exactly as the model will see them."""
    if not getattr(tokenizer, "chat_template", None):
        raise EngineRequestError("this model has no chat template; use /v1/completions", param="messages")
    native = template_supports_tools(tokenizer)
    msgs = [_normalize_message(m, native) for m in messages]
    if tools and not native:
        msgs = _with_tools_in_system(msgs, tools)
    try:
        ids = tokenizer.apply_chat_template(
            msgs,
            tools=tools if (tools and native) else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises TemplateError or plain exceptions from raise_exception()
        raise EngineRequestError(f"chat template rejected the messages: {exc}", param="messages") from exc
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") not in ("text", "input_text", "output_text"):
            raise EngineRequestError(
                f"content part of type {part.get('type')!r} is not supported", param="messages"
            )
        parts.append(part.get("text", ""))
    return "".join(parts)


def _normalize_message(message: dict[str, Any], native_tools: bool) -> dict[str, Any]:
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        if native_tools:
            out["tool_calls"] = [_call_for_template(c) for c in calls]
        else:
            blocks = [_tool_call_block(c) for c in calls]
            out["content"] = "\n".join(([out["content"]] if out["content"] else []) + blocks)
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and native_tools:
            out[key] = message[key]
    return out


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    return {
        "type": "function",
        "function": {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))},
    }


def _tool_call_block(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    body = {"name": fn.get("name"), "arguments": _arguments_object(fn.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _with_tools_in_system(msgs: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    text = tools_system_text(tools)
    if msgs and msgs[0]["role"] == "system":
        first = dict(msgs[0], content=f"{msgs[0]['content']}\n\n{text}".strip())
        return [first, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, OpenAI tool_calls) by the rule in the module docstring."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _parse_call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    content = TOOL_CALL_RE.sub(take, text).strip()
    return (content or None), calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }
