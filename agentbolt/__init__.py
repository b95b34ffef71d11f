"""agentbolt: train any AI agent from its real runs — prompt optimization, fine-tuning and RL —
without changing the agent's code.

``pip install agentbolt`` is what a runner host needs: the client, the runner and the agent API,
imported here at once, and the Trainer given a ``server_url``. The server and training come
with extras (``agentbolt[server]``, ``[train]``, ``[all]``); their names are imported on first
use, so ``import agentbolt`` never loads FastAPI or torch, and on a light install they raise one
:class:`~agentbolt.errors.MissingExtra` naming the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentbolt.client import AsyncClient, Client
from agentbolt.errors import AgentboltError, ConfigError, InvalidTransition, LeaseLost, NotFound
from agentbolt.extras import lazy_attributes
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
)
from agentbolt.runner.llm import async_openai, sync_openai
from agentbolt.runner.program import Program
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

if TYPE_CHECKING:
    from agentbolt.algorithms import Algorithm, Evaluate, TrainContext
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
    "Program",
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
    "call_id_of",
    "create_app",
    "current_rollout",
    "emit_event",
    "emit_message",
    "emit_reward",
    "emit_state",
    "emit_tool_call",
    "async_openai",
    "rollout",
    "span",
    "sync_openai",
]

# name -> (module, the extras it needs): imported on first use.
_LAZY: dict[str, tuple[str, tuple[str, ...]]] = {
    "Algorithm": ("agentbolt.algorithms", ()),
    "Evaluate": ("agentbolt.algorithms", ()),
    "TrainContext": ("agentbolt.algorithms", ()),
    "Trainer": ("agentbolt.trainer", ()),  # its embedded server asks for the server extra itself
    "ServerConfig": ("agentbolt.server", ("server",)),
    "create_app": ("agentbolt.server", ("server",)),
}


__getattr__, __dir__ = lazy_attributes("agentbolt", globals(), _LAZY)
