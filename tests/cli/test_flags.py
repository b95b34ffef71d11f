"""One meaning, one flag: every option of every ``agentbolt`` command, the ``train ALGORITHM``
commands built at run time included, is read from click's command tree and checked for a second
spelling of the same thing."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from agentbolt.cli.main import app
from agentbolt.cli.train import ALGORITHMS, _algorithm_command, _TrainGroup

# Second spellings that commands once had, or that a new option could easily bring back.
BANNED = {
    "--server-url": "--server",
    "--n-runners": "--runners",
    "--num-runners": "--runners",
    "--runner-concurrency": "--concurrency",
    "--tasks": "--train/--val",
    "--task-file": "--train/--val",
    "--train-file": "--train",
    "--train-tasks": "--train",
    "--val-file": "--val",
    "--rubric": "--judge-rubric",
    "--rubric-file": "--judge-rubric-file",
    "--via-server": "--judge-via-server",
    "--group": "--group-judge",
}
# The config tables of `agentbolt train --config`: a table is no prefix of a flag.
TABLE_PREFIXES = ("--program", "--trainer")
EXPECTED = {
    "server",
    "runner",
    "eval",
    "demo",
    "judge",
    "review",
    "rollouts list",
    "rollouts show",
    "workers list",
    "workers revoke",
    "model pull",
    "model serve",
    "export prompt",
    "export sft",
    "export model",
    *(f"train {name}" for name in ALGORITHMS),
}


def _commands() -> dict[str, Any]:
    """Every command and group of the CLI by its path (``train grpo``; the root is ``agentbolt``),
    each algorithm's command built in full."""
    found: dict[str, Any] = {}

    def walk(command: Any, path: tuple[str, ...]) -> None:
        found[" ".join(path) or "agentbolt"] = command
        if not isinstance(command, TyperGroup):
            return
        ctx = typer.Context(command, info_name=path[-1] if path else "agentbolt")
        for name in command.list_commands(ctx):
            if isinstance(command, _TrainGroup):  # its listed commands are stand-ins without options
                sub = _algorithm_command(name)
            else:
                sub = command.get_command(ctx, name)
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return found


COMMANDS = _commands()
OPTIONS = [
    (path, p) for path, command in COMMANDS.items() for p in command.params if p.param_type_name == "option"
]


def _where(uses: list[str]) -> str:
    return ", ".join(sorted(uses))


def test_the_walk_reaches_every_command() -> None:
    assert set(COMMANDS) >= {"agentbolt", "train", "model", "export", "rollouts", "workers", *EXPECTED}
    assert len(OPTIONS) > 300  # every train command's generated options are read, not stand-ins


def test_an_option_has_one_long_flag_and_its_negation_is_no_flag() -> None:
    for path, p in OPTIONS:
        long = [o for o in p.opts if o.startswith("--")]
        assert len(long) == 1, f"{path}: {p.name} is spelt {p.opts}: one long flag per option"
        assert set(p.secondary_opts) <= {"--no-" + long[0][2:]}, f"{path}: {p.secondary_opts}"


def test_no_flag_is_dotted_or_prefixed_with_a_config_table() -> None:
    for path, p in OPTIONS:
        for flag in (*p.opts, *p.secondary_opts):
            assert "." not in flag, f"{path}: {flag}"
            assert (
                not flag.removeprefix("--no-")
                .removeprefix("--")
                .startswith(tuple(t[2:] for t in TABLE_PREFIXES))
            ), f"{path}: {flag}"


def test_no_banned_synonym_is_a_flag() -> None:
    for path, p in OPTIONS:
        for flag in (*p.opts, *p.secondary_opts):
            assert flag not in BANNED, f"{path}: {flag} is spelt {BANNED[flag]} everywhere"


def test_one_meaning_has_one_spelling_in_every_command() -> None:
    """An option's dest is its meaning in the code (``trainer__server`` would be ``server`` read
    into a config table's settings): the same dest is the same flags everywhere, and a flag (long
    or short) stands for one dest everywhere."""
    spellings: dict[str, dict[tuple[str, ...], list[str]]] = defaultdict(lambda: defaultdict(list))
    meanings: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path, p in OPTIONS:
        dest = p.name.rpartition("__")[2]
        spellings[dest][tuple(sorted(p.opts))].append(path)
        for flag in p.opts:
            meanings[flag][dest].append(path)
    drift = [
        f"{dest}: " + "; ".join(f"{' '.join(opts)} in {_where(uses)}" for opts, uses in by.items())
        for dest, by in spellings.items()
        if len(by) > 1
    ]
    assert not drift, "one option, several spellings:\n" + "\n".join(drift)
    shared = [
        f"{flag}: " + "; ".join(f"{dest} in {_where(uses)}" for dest, uses in by.items())
        for flag, by in meanings.items()
        if len(by) > 1
    ]
    assert not shared, "one flag, several dests:\n" + "\n".join(shared)


def _reads_tasks(p: Any) -> bool:
    """A file option whose help speaks of tasks."""
    takes_a_file = "Path" in str(p.type_descriptor.annotation)
    return takes_a_file and re.search(r"\btasks\b", p.help or "", re.I) is not None


def test_tasks_are_given_with_train_and_val_only() -> None:
    readers = [(path, p) for path, p in OPTIONS if _reads_tasks(p)]
    assert {path for path, _ in readers} >= {"eval", *(f"train {name}" for name in ALGORITHMS)}
    for path, p in readers:
        assert p.opts in (["--train"], ["--val"]), f"{path}: a task file is --train or --val, not {p.opts}"


@pytest.mark.parametrize(
    ("args", "old"),
    [
        (["train", "evaluate", "--server-url", "http://x"], "--server-url"),
        (["train", "grpo", "--n-runners", "2"], "--n-runners"),
        (["train", "sft", "--runner-concurrency", "2"], "--runner-concurrency"),
        (["train", "evaluate", "--program.scorer-command", "x"], "--program.scorer-command"),
        (["train", "sft", "--train.lr", "0.1"], "--train.lr"),
        (["eval", "--tasks", "t.json"], "--tasks"),
        (["judge", "--rubric", "r"], "--rubric"),
    ],
)
def test_a_removed_spelling_is_no_such_option(args: list[str], old: str) -> None:
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2
    assert "No such option" in done.output and old in done.output


def test_config_keys_are_the_flags_names_and_an_old_key_says_the_new_one(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "x"}\n')
    cases = {
        "[trainer]\nn_runners = 2\n": "'n_runners' is named 'runners'",
        "[trainer]\nserver_url = 'http://x'\n": "'server_url' is named 'server'",
        "[trainer]\nrunner_concurrency = 2\n": "'runner_concurrency' is named 'concurrency'",
        "timeout = 5\n": "'timeout' is named 'batch_timeout'",
    }
    for text, message in cases.items():
        config = tmp_path / "c.toml"
        config.write_text(text)
        args = ["train", "evaluate", "--agent", "x:y", "--val", str(tasks), "--config", str(config)]
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 2, text
        assert message in " ".join(done.output.split()), (text, done.output)
