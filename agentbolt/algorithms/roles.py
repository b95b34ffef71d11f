"""Which model calls a policy trains on: its own role's.

A system of agents calls several LLM resources (roles: ``planner``, ``solver``, a judge's
model); every call's record names the resource that served it (``resource``, written by the
gateway). A policy published as one LLM resource (``llm_resource`` of GRPO and SFT) trains on
the calls served through that resource only: another role's calls came from another model or
adapter, so their tokens and log-probabilities are not this policy's. Records from before the
gateway named the resource are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentbolt.schemas import Event, EventType

__all__ = ["other_roles_note", "role_calls"]

_LLM_CALL = EventType.LLM_CALL.value


def role_calls(events: Sequence[Event], role: str) -> tuple[list[Event], int]:
    """``events`` without the model calls another LLM resource than ``role`` served, and how
    many were left out."""
    kept = [e for e in events if e.type != _LLM_CALL or e.data.get("resource", role) == role]
    return kept, len(events) - len(kept)


def other_roles_note(count: int, role: str) -> str:
    return f"{count} model call(s) through other LLM resources than {role!r} left out (other roles' calls)"
