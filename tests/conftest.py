"""Shared fixtures: a real server on 127.0.0.1 (in a thread) and a client for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentbolt.client import Client
from agentbolt.server import ServerConfig, ServerThread

IN_CI = os.environ.get("CI", "").lower() == "true"


def need(condition: bool, reason: str) -> None:
    """Skip when a service is missing — except under CI=true, where it is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture
def server(tmp_path) -> Iterator[ServerThread]:
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=30.0, sweep_interval=0.1)
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c
