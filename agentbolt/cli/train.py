"""``agentbolt train ALGORITHM``: Evaluate, APO, SFT or GRPO on an agent, from the command line.

The options of each algorithm are generated from its dataclass, and the Trainer's from its
parameters (``cli/options.py``), so a flag has the name, the default and the help of the Python
field. They are built only when that algorithm is asked for: the algorithm classes import
torch, which ``agentbolt runner --help`` must not load. Precedence: flags over the ``--config``
file over the class defaults. The run is ``Trainer(...).fit(...)``, so it prints what the
Python API prints.
"""

from __future__ import annotations

import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from agentbolt.cli.common import fail, load_tasks
from agentbolt.cli.options import (
    Schema,
    Setting,
    dataclass_schema,
    load_config,
    parameters_schema,
    split_config,
    union_members,
)
from agentbolt.errors import ConfigError
from agentbolt.extras import needs_extra

__all__ = ["ALGORITHMS", "TRAINER_HELP", "algorithm_class", "train_app", "trainer_schema"]

# command name -> (class name in agentbolt.algorithms, the extras its run needs)
ALGORITHMS = {
    "evaluate": ("Evaluate", ("server",)),
    "apo": ("APO", ("server",)),
    "sft": ("SFT", ("server", "train")),
    "grpo": ("GRPO", ("server", "train")),
}
# Trainer's parameters carry no docstrings of their own; what its module docstring says of each.
TRAINER_HELP = {
    "n_runners": "Local runner processes to start (0: runners are started elsewhere).",
    "runner_concurrency": "Rollouts each local runner runs at a time.",
    "server_url": "Train against this running server instead of an embedded one.",
    "token": "Bearer token of the server ('auto': a random one for the embedded server).",
    "resources": "Resources to publish first, as a JSON table: name -> resource.",
    "run_dir": "Folder of the run's store, metrics and checkpoints (default: runs/<time>).",
    "lease_seconds": "Lease per attempt without a heartbeat.",
}
# Shorter spellings some Trainer flags also answer to (the other commands use these names).
TRAINER_ALIASES = {"n_runners": "--runners", "server_url": "--server"}
_METAVARS = {
    int: "INTEGER",
    float: "FLOAT",
    str: "TEXT",
    Path: "PATH",
    dict: "JSON",
    list: "JSON",
    tuple: "JSON",
}
PANEL_ALGORITHM, PANEL_TRAINER = "Algorithm options", "Trainer options"


def algorithm_class(name: str) -> type:
    """The class of algorithm ``name``; importing it may load torch."""
    import agentbolt.algorithms as algorithms

    return getattr(algorithms, ALGORITHMS[name][0])  # type: ignore[no-any-return]


def trainer_schema() -> Schema:
    from agentbolt.trainer import Trainer

    return parameters_schema(Trainer.__init__, skip=("algorithm",), docs=TRAINER_HELP)


class _TrainGroup(TyperGroup):
    """Builds an algorithm's command only when it is asked for (its class may import torch).

    ``ctx`` is the click context of the click that typer bundles, which typer does not export."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(ALGORITHMS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in ALGORITHMS:
            return None
        with needs_extra(f"agentbolt train {cmd_name}", *ALGORITHMS[cmd_name][1]):
            return _algorithm_command(cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in ALGORITHMS and not args[0].startswith("-"):
            raise fail(f"unknown algorithm {args[0]!r}: choose one of {', '.join(ALGORITHMS)}")
        return super().resolve_command(ctx, args)


train_app = typer.Typer(
    cls=_TrainGroup,
    help="Train an agent (module:object or a command) with an algorithm, as Trainer(...).fit(...) does.",
    no_args_is_help=True,
)


def _algorithm_command(name: str) -> Any:
    """The click command of ``agentbolt train NAME``, built through typer from generated options."""
    cls = algorithm_class(name)
    schema, trainer = dataclass_schema(cls), trainer_schema()

    def command(**params: Any) -> None:
        _train(name, cls, schema, trainer, params)

    params = [
        *_common_parameters(),
        *_parameters(schema, PANEL_ALGORITHM),
        *_parameters(trainer, PANEL_TRAINER),
    ]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = _command_help(cls, schema)
    app = typer.Typer(add_completion=False)
    app.command(name)(command)
    return typer.main.get_command(app)


def _command_help(cls: type, schema: Schema) -> str:
    doc = inspect.getdoc(cls) or ""
    # a dataclass without a docstring gets its signature as one: not a summary
    summary = (
        doc.splitlines()[0] if doc and not doc.startswith(f"{cls.__name__}(") else "agentbolt." + cls.__name__
    )
    text = f"{cls.__name__}: {summary}\n\nOptions come from the --config file (TOML or YAML: the fields below, and a \\[trainer] table), then flags."
    if schema.python_only:
        text += f"\n\nSettable from Python only: {', '.join(schema.python_only)}."
    return text


def _common_parameters() -> list[inspect.Parameter]:
    def option(name: str, kind: Any, *decls: str, help: str) -> inspect.Parameter:
        info = typer.Option(*decls, help=help, show_default=False)
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, info]
        )

    return [
        option("agent", str | None, "--agent", "-a", help="The agent: module:object or file.py:object."),
        option(
            "command",
            str | None,
            "--command",
            "-c",
            help="The agent as a program: an argv template run per rollout.",
        ),
        option("train_file", Path | None, "--train", help="Training tasks: a JSON list or JSON-lines file."),
        option("val_file", Path | None, "--val", help="Validation tasks: a JSON list or JSON-lines file."),
        option("config", Path | None, "--config", help="Settings file (.toml, .yaml or .yml)."),
    ]


def _parameters(schema: Schema, panel: str) -> list[inspect.Parameter]:
    return [_parameter(s, panel) for s in schema.settings.values()]


def _parameter(setting: Setting, panel: str) -> inspect.Parameter:
    """One generated flag. Its value is None unless given, so a flag overrides only when used."""
    help_text = escape(f"{' '.join(setting.help.split())} [default: {setting.shown_default()}]".lstrip())
    if setting.is_bool:
        flag = setting.flag.removeprefix("--")
        decls: tuple[str, ...] = (f"--{flag}/--no-{flag}",)
        kind: Any = bool | None
    else:
        decls, kind = (setting.flag, *_aliases(setting)), str | None
    # the token is read from the environment too, so it need not show in a process list
    envvar = "AGENTBOLT_TOKEN" if panel == PANEL_TRAINER and setting.key == "token" else None
    info = typer.Option(
        *decls,
        help=help_text,
        show_default=False,
        rich_help_panel=panel,
        envvar=envvar,
        metavar=_metavar(setting),
    )
    return inspect.Parameter(
        _dest(setting, panel), inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, info]
    )


def _aliases(setting: Setting) -> tuple[str, ...]:
    alias = TRAINER_ALIASES.get(setting.key)
    return (alias,) if alias else ()


def _metavar(setting: Setting) -> str | None:
    """What a flag takes, in words: the type without ``None`` (``none`` is always accepted)."""
    if setting.is_bool:
        return None
    members = [m for m in union_members(setting.kind) if m is not type(None)]
    if typing.get_origin(setting.kind) is typing.Literal:
        return "|".join(map(str, typing.get_args(setting.kind)))
    return "|".join(_METAVARS.get(typing.get_origin(m) or m, "TEXT") for m in members)


def _dest(setting: Setting, panel: str) -> str:
    # Trainer's and an algorithm's names may meet (both could have a ``seed``): keep them apart.
    return f"trainer__{setting.dest}" if panel == PANEL_TRAINER else setting.dest


def _train(name: str, cls: type, schema: Schema, trainer: Schema, params: dict[str, Any]) -> None:
    try:
        algo_values, trainer_values = _settings(schema, trainer, params)
        algorithm = cls(**schema.kwargs(algo_values))
        agent = _agent(params["agent"], params["command"])
    except ConfigError as exc:
        raise fail(str(exc)) from None
    train = load_tasks(params["train_file"]) if params["train_file"] else []
    val = load_tasks(params["val_file"]) if params["val_file"] else []
    if not train and not val:
        raise fail("no tasks: give --train FILE and/or --val FILE")
    with needs_extra(f"agentbolt train {name}", *ALGORITHMS[name][1]):
        from agentbolt.trainer import Trainer

        try:
            Trainer(algorithm, **trainer.kwargs(trainer_values)).fit(agent, train, val)
        except ConfigError as exc:
            raise fail(str(exc)) from None


def _settings(
    schema: Schema, trainer: Schema, params: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The algorithm's and the Trainer's settings: the config file's, then the flags given."""
    algo_values: dict[str, Any] = {}
    trainer_values: dict[str, Any] = {}
    if params["config"] is not None:
        path = params["config"]
        algo_table, trainer_table = split_config(load_config(path), path)
        algo_values = schema.check_all(schema.flatten(algo_table), str(path))
        trainer_values = trainer.check_all(trainer_table, f"{path} [trainer]")
    algo_values.update(_flags(schema, params, PANEL_ALGORITHM))
    trainer_values.update(_flags(trainer, params, PANEL_TRAINER))
    return algo_values, trainer_values


def _flags(schema: Schema, params: dict[str, Any], panel: str) -> dict[str, Any]:
    given = {s.key: (s, params[_dest(s, panel)]) for s in schema.settings.values()}
    return {key: s.check(value, from_flag=True) for key, (s, value) in given.items() if value is not None}


def _agent(spec: str | None, command: str | None) -> Any:
    if (spec is None) == (command is None):
        raise ConfigError("give the agent as exactly one of --agent module:object or --command '...'")
    if command is None:
        from agentbolt.runner.worker import load_agent

        sys.path.insert(0, os.getcwd())
        return load_agent(str(spec))
    try:
        from agentbolt.runner.program import Program
    except ImportError:
        raise ConfigError(
            "--command needs agentbolt.runner.program, which this version does not have"
        ) from None
    return Program(command)
