"""Training metrics: a JSONL file (one object per step), optional W&B / MLflow mirroring when
the user has them installed and configured, and a PNG plot at the end."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "jsonable", "plot_history"]


class MetricsLog:
    """One JSON object per line. A new log starts the file afresh; ``resume`` appends, keeping
    only the rows up to ``keep_through`` (the resumed checkpoint's step): rows written after that
    checkpoint, before a crash, are redone by the resumed run and would otherwise appear twice.
    A line cut short by the crash is dropped too."""

    def __init__(self, path: Path, resume: bool = False, keep_through: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and keep_through is not None and path.exists():
            _truncate_after(path, keep_through)
        self._file = path.open("a" if resume else "w")
        self._wandb = _wandb_run()
        self._mlflow = _mlflow()

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: v for k, v in row.items() if _loggable(v)}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in clean.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        step = int(row.get("step", 0))
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k: float(v) for k, v in numeric.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it (a checkpoint's history, a resources version's metrics): a
    tensor or NumPy scalar as its number, a dataclass as a dict, anything else as its text."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _loggable(value: Any) -> bool:
    """A scalar, None, a list of numbers (``turn_reward_by_index``) or a table of numbers by
    name (``staleness_hist``: samples by version lag)."""
    if isinstance(value, list):
        return all(_number(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _number(v) for k, v in value.items())
    return isinstance(value, int | float | str | bool) or value is None


def _truncate_after(path: Path, step: int) -> None:
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            continue
        kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _wandb_run() -> Any:
    """W&B when installed and WANDB_PROJECT is set (never prompts for a login)."""
    if not os.environ.get("WANDB_PROJECT") or importlib.util.find_spec("wandb") is None:
        return None
    import wandb

    return wandb.init(project=os.environ["WANDB_PROJECT"], reinit=True)


def _mlflow() -> Any:
    """MLflow when installed and MLFLOW_TRACKING_URI is set."""
    if not os.environ.get("MLFLOW_TRACKING_URI") or importlib.util.find_spec("mlflow") is None:
        return None
    import mlflow

    mlflow.start_run()
    return mlflow


def plot_history(history: list[dict[str, Any]], path: Path) -> Path:
    """Reward and success per step, validation success where measured; asynchronous GRPO's
    runs get a second panel: the samples' mean staleness and the stale samples dropped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stale = [h for h in history if "staleness_mean" in h]
    if stale:
        fig, (ax, ax2) = plt.subplots(
            2, 1, figsize=(8, 6.5), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
        )
        steps = [h["step"] for h in stale]
        ax2.plot(steps, [h["staleness_mean"] for h in stale], "o-", label="mean staleness (versions)")
        ax2.bar(steps, [h.get("stale_dropped", 0) for h in stale], alpha=0.4, label="stale samples dropped")
        ax2.set_xlabel("step")
        ax2.grid(alpha=0.3)
        ax2.legend(loc="upper left", fontsize="small")
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    train = [h for h in history if "reward_mean" in h]
    val = [h for h in history if h.get("val_success") is not None]
    if train:
        ax.plot(
            [h["step"] for h in train], [h["reward_mean"] for h in train], "o-", label="train reward (mean)"
        )
        ax.plot(
            [h["step"] for h in train], [h["success"] for h in train], "s--", alpha=0.7, label="train success"
        )
    if val:
        ax.plot(
            [h["step"] for h in val],
            [h["val_success"] for h in val],
            "D-",
            lw=2.5,
            label="validation success",
        )
    greedy = [h for h in history if h.get("val_greedy") is not None]
    if greedy:
        ax.plot(
            [h["step"] for h in greedy],
            [h["val_greedy"] for h in greedy],
            "^:",
            lw=2,
            label="validation success (greedy)",
        )
    if not stale:
        ax.set_xlabel("step")
    ax.set_ylabel("reward / success rate")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("agentbolt GRPO")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
