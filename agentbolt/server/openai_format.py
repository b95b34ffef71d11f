"""Pure functions over OpenAI-compatible request and response bodies, for the gateway.

The gateway asks the upstream for more than the agent did (token ids, logprobs, stream usage),
records it, and hands the agent back only what it asked for. Upstreams place the extras
differently; every shape below is accepted:

- vLLM (``return_token_ids: true``): chat puts ``prompt_token_ids`` at the top level, legacy
  completions put it on each choice; each choice (or stream delta choice) carries ``token_ids``.
- The embedded engine speaks the same.
- Logprobs: chat ``choices[i].logprobs.content[j].logprob``; completions
  ``choices[i].logprobs.token_logprobs[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentbolt.web import error_body

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "RESPONSES",
    "REQUEST_SCHEMAS",
    "StreamAssembler",
    "check_request",
    "count_usage",
    "Wants",
    "openai_error",
    "extract",
    "prepare",
    "strip",
]

CHAT = "chat.completions"
COMPLETIONS = "completions"
RESPONSES = "responses"  # translated to CHAT by the gateway (agentbolt.server.responses)

# Fields an upstream adds when asked for token ids (vLLM: ``prompt_text`` comes with them).
_TOP_EXTRAS = ("prompt_token_ids", "prompt_text")
_CHOICE_EXTRAS = ("token_ids", "prompt_token_ids", "prompt_text")
# The embedded engine reports which weights served a call; a choice generated across a weight
# swap carries ``model_versions`` (one per token) and the body ``model_version_mixed: true``.
_VERSION_EXTRAS = ("model_version", "model_version_mixed")


@dataclass(frozen=True)
class Wants:
    """What the agent itself asked for; everything else the gateway added is stripped."""

    token_ids: bool
    logprobs: bool
    usage: bool  # streams only: ``stream_options.include_usage``


def openai_error(
    message: str, type: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """An error body with the fields OpenAI's clients read: ``param`` and ``code`` always there."""
    return error_body(message, type, param=param, code=code)


def _is_int(value: Any, low: int = 0) -> bool:
    """An integer as JSON Schema sees it (``2.0`` counts), at least ``low``."""
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    return whole and value >= low


def _is_prompt(value: Any) -> bool:
    """A legacy completions prompt: text, token ids, or a batch of either."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(x, str) for x in value)
        or all(_is_int(x) for x in value)
        or all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in value)
    )


# (field, test, what it must be) for fields the gateway itself reads; anything else passes
# through for the model server to judge.
_FIELD_CHECKS: list[tuple[str, Any, str]] = [
    ("model", lambda v: v is None or isinstance(v, str), "a string"),
    ("stream", lambda v: v is None or isinstance(v, bool), "a boolean"),
    ("stream_options", lambda v: v is None or isinstance(v, dict), "an object"),
    ("n", lambda v: v is None or _is_int(v, 1), "an integer >= 1"),
    ("max_tokens", lambda v: v is None or _is_int(v, 1), "an integer >= 1"),
    ("max_completion_tokens", lambda v: v is None or _is_int(v, 1), "an integer >= 1"),
    (
        "tools",
        lambda v: v is None or (isinstance(v, list) and all(isinstance(t, dict) for t in v)),
        "a list of objects",
    ),
]


def check_request(endpoint: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """``(message, param)`` when the request is malformed in a way the gateway would trip on
    or forward pointlessly; ``None`` when it is fine to forward."""
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list", "messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]"
            if not (m.get("content") is None or isinstance(m["content"], str | list)):
                return f"messages[{i}].content must be a string, a list of parts or null", f"messages[{i}]"
    elif not _is_prompt(body.get("prompt")):
        return "'prompt' must be a string, a list of strings or token ids", "prompt"
    for name, test, what in _FIELD_CHECKS:
        if name in body and not test(body[name]):
            return f"'{name}' must be {what}", name
    return None


# The request bodies as the OpenAPI document shows them (what check_request enforces).
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]},
    },
}
_POSITIVE = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
_COMMON = {
    "model": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "stream": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    "stream_options": {"anyOf": [{"type": "object"}, {"type": "null"}]},
    "n": _POSITIVE,
    "max_tokens": _POSITIVE,
    "max_completion_tokens": _POSITIVE,
    "tools": {"anyOf": [{"type": "array", "items": {"type": "object"}}, {"type": "null"}]},
}
REQUEST_SCHEMAS: dict[str, dict[str, Any]] = {
    CHAT: {
        "type": "object",
        "required": ["messages"],
        "properties": {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}, **_COMMON},
    },
    COMPLETIONS: {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]
            },
            **_COMMON,
        },
    },
}


def prepare(
    endpoint: str, body: dict[str, Any], ask_token_ids: bool, ask_logprobs: bool = True
) -> tuple[dict[str, Any], Wants]:
    """The body to send upstream (the agent's, plus requests for ids, logprobs and usage);
    ``ask_*`` False: the upstream is known to reject that extra."""
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    wants = Wants(
        token_ids=bool(body.get("return_token_ids")),
        logprobs=bool(body.get("logprobs")) if endpoint == CHAT else body.get("logprobs") is not None,
        usage=bool(options.get("include_usage")) if stream else True,
    )
    upstream = dict(body)
    if ask_token_ids:
        upstream["return_token_ids"] = True
    if not wants.logprobs and ask_logprobs:
        upstream["logprobs"] = True if endpoint == CHAT else 1
    if stream and not wants.usage:
        upstream["stream_options"] = {**options, "include_usage": True}
    return upstream, wants


def strip(body: dict[str, Any], wants: Wants, stream: bool = False) -> dict[str, Any] | None:
    """Remove (in place) what the agent did not ask for; ``None``: drop this stream chunk."""
    for key in _VERSION_EXTRAS:  # the engine's own reports, for the record only
        body.pop(key, None)
    if not wants.token_ids:
        for key in _TOP_EXTRAS:
            body.pop(key, None)
    choices = body.get("choices") or []
    for choice in choices:
        choice.pop("model_versions", None)
        if not wants.token_ids:
            for key in _CHOICE_EXTRAS:
                choice.pop(key, None)
        if not wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    if stream and not wants.usage:
        if not choices and body.get("usage") is not None:
            return None  # the usage chunk the gateway asked for
        body.pop("usage", None)
    return body


def _logprob_values(endpoint: str, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if endpoint == CHAT:
        content = logprobs.get("content")
        return [float(t["logprob"]) for t in content] if isinstance(content, list) else None
    values = logprobs.get("token_logprobs")
    return [float(v) for v in values] if isinstance(values, list) else None


def extract(endpoint: str, response: dict[str, Any]) -> tuple[list[int] | None, list[dict[str, Any]]]:
    """Prompt token ids and one record per choice (message or text, finish reason, completion
    token ids, logprobs), exactly as the upstream returned them."""
    prompt_ids = response.get("prompt_token_ids")
    records: list[dict[str, Any]] = []
    for choice in response.get("choices") or []:
        if prompt_ids is None and choice.get("prompt_token_ids") is not None:
            prompt_ids = choice["prompt_token_ids"]
        record: dict[str, Any] = {"index": choice.get("index", len(records))}
        if endpoint == CHAT:
            record["message"] = choice.get("message")
        else:
            record["text"] = choice.get("text")
        record["finish_reason"] = choice.get("finish_reason")
        record["token_ids"] = choice.get("token_ids")
        record["logprobs"] = _logprob_values(endpoint, choice.get("logprobs"))
        if choice.get("prompt_token_ids") not in (None, prompt_ids):  # a batch of prompts
            record["prompt_token_ids"] = choice["prompt_token_ids"]
        if choice.get("model_versions") is not None:  # weights changed while it was generated
            record["model_versions"] = choice["model_versions"]
        records.append(record)
    return prompt_ids, records


class StreamAssembler:
    """Rebuilds the non-streamed body from the chunks of a stream (before stripping), so a
    streamed call is recorded exactly like the same call made without ``stream``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.prompt_token_ids: list[int] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint", "model_version", "model_version_mixed"):
            if key not in self.top and chunk.get(key) is not None:
                self.top[key] = chunk[key]
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        state = self.choices.setdefault(
            index,
            {
                "index": index,
                "parts": [],
                "tool_calls": {},
                "role": None,
                "finish_reason": None,
                "token_ids": None,
                "logprobs": None,
                "prompt_token_ids": None,
            },
        )
        if self.endpoint == CHAT:
            delta = choice.get("delta") or {}
            state["role"] = state["role"] or delta.get("role")
            if delta.get("content"):
                state["parts"].append(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._add_tool_call(state["tool_calls"], call)
        elif choice.get("text"):
            state["parts"].append(choice["text"])
        if choice.get("finish_reason") is not None:
            state["finish_reason"] = choice["finish_reason"]
        if choice.get("token_ids") is not None:
            state["token_ids"] = (state["token_ids"] or []) + list(choice["token_ids"])
        if choice.get("prompt_token_ids") is not None:
            state["prompt_token_ids"] = choice["prompt_token_ids"]
        if isinstance(choice.get("logprobs"), dict):
            state["logprobs"] = _merge_logprobs(state["logprobs"], choice["logprobs"])

    @staticmethod
    def _add_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
        slot = calls.setdefault(
            delta.get("index", len(calls)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            slot["id"] = delta["id"]
        if delta.get("type"):
            slot["type"] = delta["type"]
        function = delta.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]

    def response(self) -> dict[str, Any]:
        """The reassembled body, shaped like the upstream's non-streamed answer."""
        choices = [self._choice(self.choices[i]) for i in sorted(self.choices)]
        body: dict[str, Any] = {
            "id": self.top.get("id"),
            "object": "chat.completion" if self.endpoint == CHAT else "text_completion",
            "created": self.top.get("created"),
            "model": self.top.get("model"),
            "choices": choices,
            "usage": self.usage,
        }
        for key in ("system_fingerprint", "model_version", "model_version_mixed"):
            if key in self.top:
                body[key] = self.top[key]
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def _choice(self, state: dict[str, Any]) -> dict[str, Any]:
        text = "".join(state["parts"])
        out: dict[str, Any] = {"index": state["index"]}
        if self.endpoint == CHAT:
            message: dict[str, Any] = {"role": state["role"] or "assistant", "content": text or None}
            if state["tool_calls"]:
                message["tool_calls"] = [state["tool_calls"][i] for i in sorted(state["tool_calls"])]
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = state["logprobs"]
        out["finish_reason"] = state["finish_reason"]
        if state["token_ids"] is not None:
            out["token_ids"] = state["token_ids"]
        if state["prompt_token_ids"] is not None:
            out["prompt_token_ids"] = state["prompt_token_ids"]
        return out


def _merge_logprobs(into: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Concatenate the list fields of two logprobs objects (chat ``content``/``refusal``,
    completions ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``)."""
    merged = dict(into or {})
    for key, value in part.items():
        if isinstance(value, list):
            merged[key] = (merged.get(key) or []) + value
        elif key not in merged:
            merged[key] = value
    return merged


def count_usage(prompt_ids: list[int] | None, choices: list[dict[str, Any]]) -> dict[str, int] | None:
    """Usage from the token ids, for an upstream that reported none."""
    if prompt_ids is None or any(c.get("token_ids") is None for c in choices):
        return None
    completion = sum(len(c["token_ids"]) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }
