"""``agentbolt train grpo --asynchronous ...``: the flags, and one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbolt.cli.main import app
from agentbolt.cli.options import dataclass_schema
from agentbolt.cli.train import _algorithm_command, _sections, _settings, algorithm_class

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")


def test_the_async_flags_reach_grpo() -> None:
    args = ["--asynchronous", "--max-staleness", "3", "--importance", "sequence", "--importance-cap", "3"]
    args += ["--max-groups-in-flight", "12"]
    ctx = _algorithm_command("grpo").make_context("grpo", args)
    values = _settings(_sections(algorithm_class("grpo")), ctx.params)[None]
    grpo = algorithm_class("grpo")(**dataclass_schema(algorithm_class("grpo")).kwargs(values))
    assert (grpo.asynchronous, grpo.max_staleness, grpo.importance, grpo.importance_cap) == (
        True,
        3,
        "sequence",
        3.0,
    )
    assert grpo.groups_in_flight == 12


def test_the_async_flags_are_in_the_help() -> None:
    result = CliRunner().invoke(app, ["train", "grpo", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for flag in (
        "--asynchronous",
        "--max-staleness",
        "--importance",
        "--importance-cap",
        "--max-groups-in-flight",
    ):
        assert flag in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-staleness", "-1"], "max_staleness must be a whole number >= 0"),
        (["--importance-cap", "1"], "importance_cap must be a number > 1"),
        (["--importance", "tokens"], "importance:"),
        (["--max-staleness", "two"], "max_staleness:"),
    ],
)
def test_bad_async_flags_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "x"}\n')
    extra = ["--val", str(tasks), "--agent", f"{AGENTS}:echo"]
    result = CliRunner().invoke(app, ["train", "grpo", "--asynchronous", *args, *extra])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    message = " ".join(x.strip() for x in result.output.splitlines() if x.strip())
    assert message.startswith("error: ") and message.count("error:") == 1, result.output
    assert words in message
