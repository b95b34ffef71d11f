"""Worked example turns an ``LLM`` resource carries (``LLM.examples``).

A small model learns a task from worked examples shown as chat turns far better than from the
same examples written into its system prompt (the bundled 135M model: see
``docs/training.md``, prompt optimization). So an LLM resource may carry example turns, and the
gateway puts them into every chat call (and Responses call, in its chat form) through that
resource, after the call's leading system (or developer) messages, before the agent's own. The agent's code does not change, whatever its
language: its claim's LLM resource never carries them, the gateway adds them.

The call's record holds the request as the model got it (the turns included: its token ids
are those of that prompt) and ``examples``, how many messages were put in; a Responses call's
history (``previous_response_id``) and a bootstrapped demonstration leave them out again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentbolt.schemas import ExampleTurn

__all__ = ["drop_examples", "insert_examples", "render_conversation", "system_count", "turn_dicts"]

_SYSTEM = ("system", "developer")
_ROLES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def system_count(messages: Sequence[Any]) -> int:
    """How many messages the conversation opens with that are system or developer messages."""
    n = 0
    while n < len(messages) and isinstance(messages[n], dict) and messages[n].get("role") in _SYSTEM:
        n += 1
    return n


def turn_dicts(turns: Sequence[ExampleTurn]) -> list[dict[str, Any]]:
    """The turns as chat messages (fields not set left out)."""
    return [t.model_dump(exclude_none=True) for t in turns]


def insert_examples(body: dict[str, Any], turns: Sequence[ExampleTurn]) -> tuple[dict[str, Any], int]:
    """A copy of the chat request ``body`` with ``turns`` after its leading system messages, and
    how many messages were put in (0, and ``body`` itself, when there are none or it has no
    message list)."""
    messages = body.get("messages")
    if not turns or not isinstance(messages, list):
        return body, 0
    at = system_count(messages)
    return {**body, "messages": [*messages[:at], *turn_dicts(turns), *messages[at:]]}, len(turns)


def drop_examples(messages: Sequence[Any], n: int) -> list[Any]:
    """``messages`` without the ``n`` example messages :func:`insert_examples` put in."""
    if not n:
        return list(messages)
    at = system_count(messages)
    return [*messages[:at], *messages[at + n :]]


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "").strip()
    calls = [
        f"[calls {c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})]"
        for c in message.get("tool_calls") or []
    ]
    return " ".join([text, *calls]).strip()


def render_conversation(messages: Sequence[dict[str, Any]]) -> str:
    """``User: ...`` / ``Assistant: ...`` / ``Tool: ...`` lines, one per message."""
    return "\n".join(f"{_ROLES.get(str(m.get('role')), str(m.get('role')))}: {_content(m)}" for m in messages)
