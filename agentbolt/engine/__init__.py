"""The embedded model engine: SmolLM2-135M-Instruct (or any local HF causal LM) served
OpenAI-compatibly with continuous batching, token ids and log-probabilities in every response, and
weights swapped in place while it serves. vLLM plays the same role at scale; both speak one dialect.
"""

from agentbolt.engine.engine import EngineConfig, ModelEngine
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
