"""The engine says at start, in one log line, what serves its attention and small ops, and why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from engine_helpers import make_engine

from agentbolt.engine import kernels


def _started_line(tiny_dir: Path, caplog: pytest.LogCaptureFixture, **config) -> str:
    with caplog.at_level(logging.INFO, logger="agentbolt.engine.engine"):
        engine = make_engine(tiny_dir, max_batch=4, **config)
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
        assert lines == [engine.serving()]  # one line, once
        return lines[0]
    finally:
        engine.close()


def test_the_line_names_the_kernels_when_they_serve(tiny_dir, caplog):
    if not kernels.available():
        pytest.fail(f"the kernels should build on this machine: {kernels.status()}")
    line = _started_line(tiny_dir, caplog)
    assert f"by the C kernels ({kernels.status()})" in line
    assert "forward pass the engine's own" in line and "dtype float32" in line


def test_the_line_says_why_pytorch_serves_instead(tiny_dir, caplog, monkeypatch, tmp_path):
    line = _started_line(tiny_dir, caplog, kernels=False)
    assert "by PyTorch (switched off (kernels=False))" in line
    caplog.clear()
    # no compiler where the image has none: the engine still serves, and the line says why
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setenv("AGENTBOLT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    line = _started_line(tiny_dir, caplog)
    assert "by PyTorch (no C compiler: 'no-such-compiler-here' not found" in line
