"""The upstream test double the probes' gateway calls reach."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from upstream_double import UpstreamDouble  # noqa: E402


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamDouble]:
    with UpstreamDouble() as double:
        yield double
