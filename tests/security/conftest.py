"""The upstream test double the probes' gateway calls reach, and an admin client of the module's
own ``server`` fixture (each module configures its server; ``ADMIN`` is its admin token)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbolt.client import Client

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from upstream_double import UpstreamDouble  # noqa: E402

ADMIN = "adm-token-security-1"


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamDouble]:
    with UpstreamDouble() as double:
        yield double


@pytest.fixture
def admin(server) -> Iterator[Client]:
    with Client(server.url, ADMIN) as client:
        yield client
