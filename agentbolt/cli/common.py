"""What every ``agentbolt`` command shares: the consoles, the server and token options, and
the one way a command reports a problem (a plain message and an exit code, never a traceback)."""

from __future__ import annotations

from typing import Annotated

import typer

from agentbolt.console import make_console

__all__ = ["DEFAULT_SERVER", "ServerOpt", "TokenOpt", "console", "err_console", "fail"]

console = make_console()
err_console = make_console(stderr=True)

ServerOpt = Annotated[str, typer.Option("--server", "-s", envvar="AGENTBOLT_SERVER", help="Server URL.")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="AGENTBOLT_TOKEN", help="Bearer token.")]
DEFAULT_SERVER = "http://127.0.0.1:8765"


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error and return the ``typer.Exit`` to raise."""
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)
