"""Fixtures: the tiny random Llama (built once per session) and float32 engines over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import make_engine

from agentbolt.engine import ModelEngine, tiny_model_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[ModelEngine]:
    """Shared by a module's tests; tests that change weights use ``fresh_engine``."""
    eng = make_engine(tiny_dir, max_batch=16)
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(tiny_dir: Path) -> Iterator[ModelEngine]:
    eng = make_engine(tiny_dir, max_batch=16)
    yield eng
    eng.close()
