"""The agentbolt server: store API, gateway, OTLP ingest and dashboard over HTTP."""

from agentbolt.server.app import create_app
from agentbolt.server.config import Role, ServerConfig
from agentbolt.server.run import ServerProcess, ServerThread, serve

__all__ = ["Role", "ServerConfig", "ServerProcess", "ServerThread", "create_app", "serve"]
