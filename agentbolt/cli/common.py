"""What every ``agentbolt`` command shares: the consoles, the server and token options, and
the one way a command reports a problem (a plain message and an exit code, never a traceback)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from agentbolt.console import make_console
from agentbolt.schemas import Task

__all__ = [
    "DEFAULT_SERVER",
    "ServerOpt",
    "TokenOpt",
    "console",
    "err_console",
    "fail",
    "keyword_option",
    "load_tasks",
]

console = make_console()
err_console = make_console(stderr=True)

ServerOpt = Annotated[str, typer.Option("--server", "-s", envvar="AGENTBOLT_SERVER", help="Server URL.")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="AGENTBOLT_TOKEN", help="Bearer token.")]
DEFAULT_SERVER = "http://127.0.0.1:8765"


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error and return the ``typer.Exit`` to raise."""
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def keyword_option(
    name: str, kind: Any, *decls: str, help: str, panel: str | None = None
) -> inspect.Parameter:
    """A parameter of a command built at run time (``agentbolt train ALGORITHM``): flag ``decls``,
    None unless given."""
    info = typer.Option(*decls, help=help, show_default=False, rich_help_panel=panel)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, info]
    )


def load_tasks(path: Path) -> list[Task]:
    """Tasks from a JSON list or JSON-lines file; each item is task data (``id`` optional)."""
    if not path.exists():
        raise fail(f"task file {path} does not exist")
    text = path.read_text()
    try:
        items = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
    except json.JSONDecodeError as exc:
        raise fail(f"{path}: not JSON or JSON lines ({exc})") from None
    if not all(isinstance(i, dict) for i in items):
        raise fail(f"{path}: every task must be a JSON object")
    return [Task.of(i) for i in items]
