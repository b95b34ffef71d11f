"""A token given as a command-line flag: every user of the machine sees it in ``ps`` (the
process's ``/proc/<pid>/cmdline`` is world-readable). The command warns, naming the environment
variable that keeps it out of sight, and overwrites the value in the argument block that
``/proc`` shows, so that it is visible only while the command starts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import typer
from rich.markup import escape

from agentbolt.cli.common import err_console
from agentbolt.runner.credentials import hide_in_blocks

__all__ = ["warn_token_flags"]

SECRET_VARIABLE = re.compile(r"_(TOKENS?|KEYS?)$")
"""An option whose environment variable is named so holds a secret."""


def warn_token_flags(app: typer.Typer, argv: Sequence[str]) -> list[str]:
    """Warn (one line each, on stderr) for each secret flag given in ``argv``; hide the values.
    The flags warned about, in order."""
    args = list(argv[: argv.index("--")] if "--" in argv else argv)
    if not any(a.startswith("--") and ("token" in a or "key" in a) for a in args):
        return []  # the common case costs no walk of the command tree
    command = _command_of(app, args)
    if command is None:
        return []
    secret = {
        opt: param.envvar
        for param in command.params
        if isinstance(param.envvar, str) and SECRET_VARIABLE.search(param.envvar)
        for opt in param.opts
        if opt.startswith("--")
    }
    warned: list[str] = []
    values: list[str] = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in secret:
            continue
        values.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
        if flag not in warned:
            warned.append(flag)
            err_console.print(
                f"[yellow]warning:[/] {escape(flag)} on the command line shows in `ps` to every "
                f"user of this machine; give it in the environment variable {secret[flag]} instead",
                soft_wrap=True,
            )
    hide_in_blocks([v for v in values if v])
    return warned


def _command_of(app: typer.Typer, args: list[str]) -> Any:
    """The click command that ``args`` runs (a group's subcommands followed by name); None when
    they name none (the command line's own error then says so)."""
    command: Any = typer.main.get_command(app)
    rest = list(args)
    while hasattr(command, "resolve_command") and rest and not rest[0].startswith("-"):
        ctx = typer.Context(command, info_name="agentbolt", resilient_parsing=True)
        try:
            _, command, rest = command.resolve_command(ctx, rest)
        except Exception:  # noqa: BLE001 - an unknown command (a usage error): app() reports it
            return None
        if command is None:
            return None
    return command
