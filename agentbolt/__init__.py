"""agentbolt: train any AI agent from its real runs — prompt optimization, fine-tuning and RL —
without changing the agent's code."""

from agentbolt.algorithms import Algorithm, Evaluate, TrainContext
from agentbolt.client import AsyncClient, Client
from agentbolt.errors import AgentboltError, ConfigError, InvalidTransition, LeaseLost, NotFound
from agentbolt.runner.agent import (
    LitAgent,
    RolloutContext,
    current_rollout,
    emit_event,
    emit_message,
    emit_reward,
    emit_tool_call,
    rollout,
)
from agentbolt.runner.llm import async_openai, sync_openai
from agentbolt.runner.tracing import span
from agentbolt.runner.worker import Runner
from agentbolt.schemas import (
    LLM,
    Attempt,
    Event,
    Mode,
    ModelWeights,
    PromptTemplate,
    Resources,
    Rollout,
    Task,
    Trajectory,
)
from agentbolt.server import ServerConfig, create_app
from agentbolt.trainer import Trainer

__all__ = [
    "LLM",
    "AgentboltError",
    "Algorithm",
    "AsyncClient",
    "Attempt",
    "Client",
    "ConfigError",
    "Evaluate",
    "Event",
    "InvalidTransition",
    "LeaseLost",
    "LitAgent",
    "Mode",
    "ModelWeights",
    "NotFound",
    "PromptTemplate",
    "Resources",
    "Rollout",
    "RolloutContext",
    "Runner",
    "ServerConfig",
    "Task",
    "TrainContext",
    "Trainer",
    "Trajectory",
    "create_app",
    "current_rollout",
    "emit_event",
    "emit_message",
    "emit_reward",
    "emit_tool_call",
    "async_openai",
    "rollout",
    "span",
    "sync_openai",
]
