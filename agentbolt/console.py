"""The rich console every live table and message of agentbolt prints to."""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["make_console", "print_line", "task_bars"]

# Width when writing to a file or a CI log: rich would fall back to 80 columns, which cuts
# the training tables' headers and numbers to "…".
LOG_WIDTH = 140


def make_console(stderr: bool = False) -> Console:
    """A rich console; when output is not a terminal (and COLUMNS is unset), LOG_WIDTH wide."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH)
    return console


def print_line(console: Console, text: str) -> None:
    """One plain progress line for a log or CI: no markup, no highlighting, never wrapped.

    Rich writes and flushes the file after each print, so the line shows at once even when
    stdout is a pipe."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def task_bars(console: Console | None, transient: bool = True) -> Progress:
    """The bars of agentbolt's long waits: a description, the bar, done of total, the task's
    ``info`` field (give ``info=...`` to each ``add_task``) and the time taken. Hidden when
    ``console`` is None."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console or Console(),
        transient=transient,
        disable=console is None,
    )
