"""The embedded model engine: SmolLM2-135M-Instruct (or any local HF causal LM) served
OpenAI-compatibly with continuous batching, token ids and log-probabilities in every response, and
weights swapped in place while it serves. vLLM plays the same role at scale; both speak one dialect.

The names below are imported on first use: they load torch and transformers (the ``train``
extra), and the CLI imports :mod:`agentbolt.cli.model` on every command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbolt.engine.config import EngineConfig
    from agentbolt.engine.engine import ModelEngine
    from agentbolt.engine.model_files import DEFAULT_MODEL, ModelNotFoundError, ensure_model
    from agentbolt.engine.protocol import EngineRequestError
    from agentbolt.engine.server import EngineServer, create_engine_app
    from agentbolt.engine.testing import tiny_model_dir

__all__ = [
    "DEFAULT_MODEL",
    "EngineConfig",
    "EngineRequestError",
    "EngineServer",
    "ModelEngine",
    "ModelNotFoundError",
    "create_engine_app",
    "ensure_model",
    "tiny_model_dir",
]

_LAZY = {
    "DEFAULT_MODEL": "agentbolt.engine.model_files",
    "EngineConfig": "agentbolt.engine.config",
    "EngineRequestError": "agentbolt.engine.protocol",
    "EngineServer": "agentbolt.engine.server",
    "ModelEngine": "agentbolt.engine.engine",
    "ModelNotFoundError": "agentbolt.engine.model_files",
    "create_engine_app": "agentbolt.engine.server",
    "ensure_model": "agentbolt.engine.model_files",
    "tiny_model_dir": "agentbolt.engine.testing",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'agentbolt.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
