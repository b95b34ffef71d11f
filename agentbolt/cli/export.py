"""``agentbolt export``: write what training produced to files.

One command per artifact, all on :data:`export_app` (added by :mod:`agentbolt.cli.main`). Each
command reads the server through :class:`~agentbolt.client.Client` with the shared ``--server`` /
``--token`` options and writes ``--out``; add a command with ``@export_app.command("name")``.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentbolt.cli.common import DEFAULT_SERVER, ServerOpt, TokenOpt, console
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.extras import needs_extra
from agentbolt.schemas import Mode, Resources

__all__ = ["best_apo_resources", "export_app", "export_model", "export_sft"]

export_app = typer.Typer(help="Export trained artifacts (prompts, datasets, models).", no_args_is_help=True)

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="File to write.")]


@export_app.callback()
def _group() -> None:
    """Export trained artifacts (prompts, datasets, models)."""


def all_resources(client: Client) -> Iterator[Resources]:
    """Every resources version on the server, oldest first, following pagination."""
    return client.pages(client.list_resources, limit=500)


def _val_score(res: Resources) -> float | None:
    scores = res.metadata.get("scores") if res.metadata.get("algorithm") == "apo" else None
    val = scores.get("val") if isinstance(scores, dict) else None
    return float(val) if isinstance(val, int | float) and not isinstance(val, bool) else None


def best_apo_resources(client: Client) -> Resources:
    """The APO-scored version with the highest validation score (the earliest among equals, so
    a seed that tied with its rewrites is the one chosen, as APO itself does)."""
    scored = [
        (score, -res.version, res) for res in all_resources(client) if (score := _val_score(res)) is not None
    ]
    if not scored:
        raise ConfigError(
            "no APO-scored resources version on this server: run APO first, or pass --version N"
        )
    return max(scored, key=lambda item: item[:2])[2]


def _version_arg(value: str) -> str:
    if value != "best" and not (value.isdigit() and int(value) >= 1):
        raise typer.BadParameter("a version number (1, 2, ...) or 'best'")
    return value


@export_app.command("prompt")
def export_prompt(
    out: OutOpt,
    version: Annotated[
        str, typer.Option("--version", "-v", callback=_version_arg, help="Resources version N, or 'best'.")
    ] = "best",
    resource: Annotated[
        str | None,
        typer.Option(help="Prompt resource name (default: what APO optimized, else the only one)."),
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
) -> None:
    """Write a prompt to a file: the best APO candidate (highest validation score) or version N's."""
    from agentbolt.algorithms.apo import prompt_of

    with Client(server, token) as client:
        res = best_apo_resources(client) if version == "best" else client.get_resources(int(version))
    name = resource or res.metadata.get("prompt_resource")
    text = prompt_of(res, name)
    if text is None:
        wanted = f"prompt resource {name!r}" if name else "single prompt resource"
        raise ConfigError(f"version {res.version} has no {wanted} to export (it has {sorted(res.resources)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    score = _val_score(res)
    detail = f", val score {score:.3f}" if score is not None else ""
    console.print(f"wrote the prompt of version {res.version}{detail} to {out}")


# ---------------------------------------------------------------------------- SFT datasets and models


class DatasetFormat(StrEnum):
    OPENAI = "openai"
    HF = "hf"
    TOKENS = "tokens"


class ModeFilter(StrEnum):
    TRAIN = "train"
    VAL = "val"
    TEST = "test"
    ALL = "all"


@export_app.command("sft")
@needs_extra("agentbolt export sft")
def export_sft(
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file (openai, tokens) or folder (hf).")],
    format: Annotated[
        DatasetFormat,
        typer.Option(
            "--format", "-f", help="openai: chat JSONL; hf: datasets folder; tokens: token-id JSONL."
        ),
    ] = DatasetFormat.OPENAI,
    min_reward: Annotated[
        float | None, typer.Option(help="Keep rollouts whose reward is at least this.")
    ] = None,
    mode: Annotated[ModeFilter, typer.Option(help="Rollouts of this mode only (or all).")] = ModeFilter.TRAIN,
    version: Annotated[
        int | None,
        typer.Option("--version", "-v", min=1, help="Rollouts run with this resources version only."),
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
) -> None:
    """Write a fine-tuning dataset of the best stored runs, deduplicated, with a dataset card."""
    from agentbolt.export import export_dataset

    columns = (TextColumn("[bold]exporting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Client(server, token) as client, Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("export", total=None)
        summary = export_dataset(
            client,
            out,
            format.value,
            min_reward=min_reward,
            version=version,
            mode=None if mode == ModeFilter.ALL else Mode(mode.value),
            progress=lambda done, total: progress.update(bar, completed=done, total=total),
        )
    console.print(
        f"wrote {summary.rows} rows from {summary.rollouts_used} of {summary.rollouts} rollouts "
        f"({summary.duplicates} duplicates dropped, {summary.rows_per_s:.0f} rows/s) to {out}; card: {summary.card}"
    )


@export_app.command("model")
@needs_extra("agentbolt export model", "train")
def export_model(
    weights: Annotated[
        str,
        typer.Option("--weights", "-w", help="An adapter or model folder, or a resources version number."),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write (safetensors).")],
    merge: Annotated[bool, typer.Option(help="Merge a LoRA adapter into its base model.")] = False,
    base_model: Annotated[
        str | None, typer.Option(help="Base model folder or 'smollm2' (default: the one the adapter names).")
    ] = None,
    resource: Annotated[
        str | None, typer.Option(help="Weights resource name, when a version holds several.")
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    token: TokenOpt = None,
) -> None:
    """Write trained weights as a Hugging Face folder that transformers and vLLM load."""
    from agentbolt.export import export_model as write_model
    from agentbolt.export import resolve_weights

    if weights.isdigit() and not Path(weights).is_dir():
        with Client(server, token) as client:
            found = resolve_weights(weights, client, resource)
    else:
        found = resolve_weights(weights)
    with console.status("merging the adapter into its base model ..." if merge else "copying ..."):
        path = write_model(found, out, merge=merge, base_model=base_model)
    kind = "merged model" if merge and found.format == "lora" else f"{found.format} weights"
    console.print(f"wrote the {kind} to {path}")
