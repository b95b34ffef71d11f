"""What a GRPO run shows and keeps of each step: the live table of its rows (the columns that
say something for this run), the same row as one plain line where the console shows nothing
live (a log, CI), and :class:`StepRecord`, which checks, keeps, writes and shows each row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from agentbolt.algorithms.base import no_ids_note
from agentbolt.algorithms.collapse import CollapseWatch
from agentbolt.algorithms.metrics import MetricsLog
from agentbolt.algorithms.roles import other_roles_note
from agentbolt.console import print_line

__all__ = ["COLUMNS", "Columns", "StepRecord", "add_row", "columns", "line", "metrics_table"]

Columns = tuple[tuple[str, str], ...]
"""``(row key, format)`` of each column, in order."""

COLUMNS: Columns = (
    ("step", "{}"),
    ("success", "{:.0%}"),
    ("reward_mean", "{:.3f}"),
    ("val_success", "{:.0%}"),
    ("val_greedy", "{:.0%}"),
    ("loss", "{:+.4f}"),
    ("clip_fraction", "{:.3f}"),
    ("entropy", "{:.2f}"),
    ("zero_spread_groups", "{}"),
    ("turns_mean", "{:.1f}"),
    ("step_reward_mean", "{:+.3f}"),
    ("retried", "{}"),
    ("reward_pending", "{}"),
    ("reward_errors", "{}"),
    ("claims_disputed", "{}"),
    ("carried_groups", "{}"),
    ("evicted_groups", "{}"),
    ("stale_dropped", "{}"),
    ("staleness_mean", "{:.2f}"),
    ("is_weight_mean", "{:.3f}"),
    ("is_weight_min", "{:.3f}"),
    ("is_weight_max", "{:.3f}"),
    ("is_clipped_fraction", "{:.3f}"),
    ("t_trainer_wait", "{:.1f}s"),
    ("t_engine_idle", "{:.1f}s"),
    ("t_rollouts", "{:.1f}s"),
    ("t_update", "{:.1f}s"),
    ("t_sync", "{:.1f}s"),
    ("steps_per_hour", "{:.1f}"),
)
# columns that say nothing while the reward is the agent's own (always 0: nothing is awaited)
_NAMED_REWARD_COLUMNS = ("reward_pending", "reward_errors")
# columns of asynchronous mode only (nothing is carried, stale or weighted in synchronous mode)
_ASYNC_COLUMNS = (
    "carried_groups",
    "evicted_groups",
    "stale_dropped",
    "staleness_mean",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "is_clipped_fraction",
    "t_trainer_wait",
)


def columns(agent_only: bool, asynchronous: bool = False) -> Columns:
    """The live table's columns: the named-reward counts only when a named reward is in play,
    the staleness and importance-weight columns only in asynchronous mode."""
    return tuple(
        c
        for c in COLUMNS
        if not (agent_only and c[0] in _NAMED_REWARD_COLUMNS)
        and not (not asynchronous and c[0] in _ASYNC_COLUMNS)
    )


def metrics_table(shown: Columns = COLUMNS) -> Table:
    table = Table(title="GRPO", expand=False)
    for name, _ in shown:
        table.add_column(name.replace("_", " "), justify="right")
    return table


def _cells(row: dict[str, Any], shown: Columns) -> list[str]:
    return [fmt.format(row[name]) if row.get(name) is not None else "-" for name, fmt in shown]


def add_row(table: Table, row: dict[str, Any], shown: Columns = COLUMNS) -> None:
    table.add_row(*_cells(row, shown))


def line(row: dict[str, Any], shown: Columns = COLUMNS) -> str:
    """The table's row as one plain line: ``GRPO step 3 | success 50% | reward mean 0.412 | ...``."""
    pairs = [
        f"{name.replace('_', ' ')} {cell}" for (name, _), cell in zip(shown, _cells(row, shown), strict=True)
    ]
    return "GRPO " + " | ".join(pairs)


@dataclass
class StepRecord:
    """A run's step rows as they are recorded: each is checked by the collapse watch (its warning
    printed and kept in the row), appended to ``history``, written to the metrics log and shown
    in the live table, and, on a console that shows nothing live, printed as one line. A step
    whose rollouts made model calls recorded without token ids, or calls of other roles (LLM
    resources), says how many it left out, on a line of its own. A resumed run's ``history`` is shown again and continues the watch's count."""

    console: Console
    log: MetricsLog
    history: list[dict[str, Any]]
    shown: Columns
    collapse: CollapseWatch
    role: str = "llm"
    """The LLM resource the policy is published as: other resources' calls are left out."""
    table: Table = field(init=False)

    def __post_init__(self) -> None:
        self.table = metrics_table(self.shown)
        for row in self.history:
            add_row(self.table, row, self.shown)
            self.collapse.check(row)

    def record(self, row: dict[str, Any]) -> None:
        warning = self.collapse.check(row)
        if warning:
            row["warning"] = warning
            print_line(self.console, f"warning: {warning}")
        skipped = row.get("skipped_no_ids")
        if skipped:
            print_line(self.console, f"step {row.get('step')}: {no_ids_note(skipped)}")
        if row.get("other_roles_calls"):  # a system of agents: only this policy's role trains it
            print_line(
                self.console,
                f"step {row.get('step')}: {other_roles_note(row['other_roles_calls'], self.role)}",
            )
        self.history.append(row)
        self.log.write(row)
        add_row(self.table, row, self.shown)
        if not self.console.is_terminal:  # a log or CI shows nothing live: one line per step
            print_line(self.console, line(row, self.shown))
