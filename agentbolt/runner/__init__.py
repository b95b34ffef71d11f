"""The runner process: the worker loop (``worker``), each attempt's talk with the server
(``attempt``, shared with the Kubernetes launcher), the agent API (``agent``), program agents
(``program``: any executable as an agent), OpenTelemetry tracing of rollouts (``tracing``) and
the OpenAI client helpers agents use (``llm``)."""

from agentbolt.runner.agent import (
    LitAgent,
    RolloutContext,
    call_id_of,
    current_rollout,
    emit_event,
    emit_message,
    emit_reward,
    emit_state,
    emit_tool_call,
    rollout,
    rollout_thread,
)
from agentbolt.runner.llm import async_openai, sync_openai
from agentbolt.runner.program import Program
from agentbolt.runner.tracing import span
from agentbolt.runner.worker import Runner, load_agent

__all__ = [
    "LitAgent",
    "Program",
    "RolloutContext",
    "Runner",
    "async_openai",
    "call_id_of",
    "current_rollout",
    "emit_event",
    "emit_message",
    "emit_reward",
    "emit_state",
    "emit_tool_call",
    "load_agent",
    "rollout",
    "rollout_thread",
    "span",
    "sync_openai",
]
