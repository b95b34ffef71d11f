"""Server configuration: one frozen dataclass, filled from the CLI or by the Trainer."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Role", "ServerConfig"]


class Role(StrEnum):
    """What a bearer token may do. Configured tokens are admin, runner, reader, reviewer or
    evaluator; the server issues the others: a worker token (a runner bound to one worker id)
    and an attempt's agent key. Each role's rights are its row in ``middleware.role_allows``."""

    ADMIN = "admin"  # everything
    RUNNER = "runner"  # read, and work on the attempts it holds (dequeue, events, finish, gateway)
    READER = "reader"  # read only (the dashboard)
    AGENT = "agent"  # one attempt's agent key: its gateway routes and events URL, nothing else
    REVIEWER = "reviewer"  # a person: read, and score the rewards reviewers give
    EVALUATOR = "evaluator"  # a judge or scoring worker: read, score, call judge models through the server


@dataclass(frozen=True)
class ServerConfig:
    db: str = "agentbolt.db"
    """Store URL: a SQLite file path, ``:memory:``, or ``postgresql://...``."""
    host: str = "127.0.0.1"
    port: int = 8765
    tokens: dict[str, Role] = field(default_factory=dict)
    """Bearer token -> role. Empty: no authentication (only sensible on loopback)."""
    token_names: dict[str, str] = field(default_factory=dict)
    """Bearer token -> who holds it (a reviewer's name: the author of the scores it gives)."""
    lease_seconds: float = 30.0
    """How long a dequeued attempt is held without a heartbeat."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Larger request bodies get 413."""
    sweep_interval: float = 1.0
    """Seconds between sweeps that expire lapsed leases and timed-out attempts."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS; empty (the default) sends no CORS headers at all."""
    upstream_api_keys: dict[str, str] = field(default_factory=dict)
    """Gateway: API key per upstream base URL (or ``"*"``), kept out of events and responses."""
    upstream_timeout: float = 300.0
    """Gateway: seconds an upstream model call may take."""
    registered_runners_only: bool = False
    """A configured runner token may only read and register (``POST /api/workers/register``);
    every runner write then carries a worker token, bound to its worker. Every agentbolt runner
    registers, so it works unchanged; off by default for clients that act with the runner
    token itself."""
    worker_token_ttl: float | None = 24 * 3600.0
    """Seconds a worker token stays valid after its worker was last seen (a dequeue, a
    heartbeat); an expired one is refused (401) and its runner registers again. None: never."""
    dashboard: bool = True
    quota_events: int = 10_000
    """Events an attempt's agent may post to its events URL, all posts together (then 429);
    0: no limit. The runner's uploads and the gateway's records are not counted."""
    quota_event_bytes: int = 64 * 1024 * 1024
    """Bytes of events (type and data as JSON) an attempt's agent may post (then 413); 0: no limit."""
    quota_calls: int = 1_000
    """Model calls an attempt may make through the gateway (then 429), counted per server
    replica; 0: no limit."""

    @staticmethod
    def with_token(token: str | None, **kwargs: object) -> ServerConfig:
        """A config with one admin token (``token="auto"`` makes a random one)."""
        if token == "auto":
            token = secrets.token_urlsafe(24)
        tokens = {token: Role.ADMIN} if token else {}
        return ServerConfig(tokens=tokens, **kwargs)  # type: ignore[arg-type]
