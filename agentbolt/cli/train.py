"""``agentbolt train ALGORITHM``: Evaluate, APO, SFT or GRPO on an agent, from the command line.

The options of each algorithm are generated from its dataclass, and the Trainer's and the
Program's from their parameters (``cli/options.py``), so a flag has the name, the default and the
help of the Python field; where every other command names the same thing otherwise (the runners'
count is ``--runners``, the program's timeout ``--timeout``), the flag and its config key take that
name (``TRAINER_NAMES``, ``ALGORITHM_NAMES``). They are built only when that algorithm is asked for: the algorithm classes import
torch, which ``agentbolt runner --help`` must not load. Precedence: flags over the ``--config``
file over the class defaults. The run is ``Trainer(...).fit(...)``, so it prints what the
Python API prints.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from agentbolt.cli.assignments import env_templates
from agentbolt.cli.common import fail, keyword_option, load_tasks
from agentbolt.cli.options import (
    Schema,
    Setting,
    dataclass_schema,
    load_config,
    parameters_schema,
    split_config,
    union_members,
)
from agentbolt.cli.rewards import REWARD_PANEL, evaluators, reward_parameters
from agentbolt.errors import ConfigError
from agentbolt.extras import needs_extra

if typing.TYPE_CHECKING:
    from agentbolt.tasks.base import Split

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "TRAINER_NAMES",
    "TRAINER_HELP",
    "algorithm_class",
    "program_schema",
    "train_app",
    "trainer_schema",
]

# command name -> (class name in agentbolt.algorithms, the extras its run needs, what it does)
ALGORITHMS = {
    "evaluate": ("Evaluate", ("server",), "Run every validation (else training) task once and report."),
    "apo": (
        "APO",
        ("server",),
        "Optimize a prompt resource: worked examples from successful runs, or rewrites.",
    ),
    "sft": ("SFT", ("server", "train"), "Fine-tune the policy on its best runs (rejection sampling)."),
    "grpo": ("GRPO", ("server", "train"), "Reinforcement learning on the policy's weights."),
}
# Trainer's parameters have no docstrings to read, so their help is kept here (their names,
# types and defaults are still read from its signature).
TRAINER_HELP = {
    "n_runners": "Local runner processes to start (0: runners are started elsewhere).",
    "runner_concurrency": "Rollouts each local runner runs at a time.",
    "server_url": "Train against this running server instead of an embedded one.",
    "token": "Bearer token of the server (the embedded server makes a random one).",
    "resources": "Resources to publish first, as a JSON table: name -> resource.",
    "run_dir": "Folder of the run's store, metrics and checkpoints (default: runs/<time>).",
    "lease_seconds": "Lease per attempt without a heartbeat.",
}
# The flag (and config key) of a Trainer parameter that every other command names otherwise.
TRAINER_NAMES = {"n_runners": "runners", "server_url": "server", "runner_concurrency": "concurrency"}
# Evaluate's batch wait is APO's batch_timeout; --timeout is the program's, as in `agentbolt runner`.
ALGORITHM_NAMES = {"Evaluate": {"timeout": "batch_timeout"}}
# The short flags the other commands give the same options.
SHORT_FLAGS = {"server": "-s", "concurrency": "-n"}
_METAVARS = {
    int: "INTEGER",
    float: "FLOAT",
    str: "TEXT",
    Path: "PATH",
    dict: "JSON",
    list: "JSON",
    tuple: "JSON",
}
PROGRAM_PANEL = "Program options (with --command)"
# Given by hand below: the command is its own flag, the scorer is named as module:fn, and
# --env repeats NAME=TEMPLATE as in ``agentbolt runner``.
PROGRAM_BY_HAND = ("command", "scorer")


@dataclass(frozen=True)
class _Section:
    """One group of generated options: its settings, help panel and config table. The flags of
    all groups share one namespace: two settings of one name fail to build the command."""

    schema: Schema
    panel: str
    table: str | None = None
    """The config file's table of these settings; None: the top level."""


def algorithm_class(name: str) -> type:
    """The class of algorithm ``name``; importing it may load torch."""
    import agentbolt.algorithms as algorithms

    cls: type = getattr(algorithms, ALGORITHMS[name][0])
    return cls


def algorithm_schema(cls: type) -> Schema:
    """The settings of algorithm ``cls``, named as on the command line."""
    return dataclass_schema(cls, ALGORITHM_NAMES.get(cls.__name__))


def trainer_schema() -> Schema:
    from agentbolt.trainer import Trainer

    # the reward settings are the algorithm's own flags (--reward, --reward-wait, the judges')
    # runners on Ray are Trainer(ray=RayRunners(...)) in Python, or `agentbolt runner --ray`
    skip = ("algorithm", "reward", "evaluators", "reward_wait", "ray")
    return parameters_schema(Trainer.__init__, skip=skip, docs=TRAINER_HELP, names=TRAINER_NAMES)


def program_schema() -> Schema:
    """Program's parameters, with the help its docstring's list gives each."""
    from agentbolt.runner.program import Program

    names = inspect.signature(Program.__init__).parameters
    docs = {
        n: m.group(1)
        for n in names
        if (m := re.search(rf"``{n}``: (.+?)(?:;\n|\n\s*\*|\.?$)", Program.__doc__ or "", re.S))
    }
    return parameters_schema(Program.__init__, skip=PROGRAM_BY_HAND, docs=docs)


class _TrainGroup(TyperGroup):
    """Builds an algorithm's command only when it runs or shows its help (its class may import
    torch); the list of algorithms in ``agentbolt train --help`` is made of light stand-ins.

    ``ctx`` is the click context of the click that typer bundles, which typer does not export."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(ALGORITHMS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in ALGORITHMS:
            return None
        return TyperCommand(cmd_name, help=ALGORITHMS[cmd_name][2])

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in ALGORITHMS and not args[0].startswith("-"):
            raise fail(f"unknown algorithm {args[0]!r}: choose one of {', '.join(ALGORITHMS)}")
        name, stand_in, rest = super().resolve_command(ctx, args)
        if name is None:
            return name, stand_in, rest
        with needs_extra(f"agentbolt train {name}", *ALGORITHMS[name][1]):
            return name, _algorithm_command(name), rest


train_app = typer.Typer(
    cls=_TrainGroup,
    help="Train an agent (module:object or a command) with an algorithm, as Trainer(...).fit(...) does.",
    no_args_is_help=True,
)


def _algorithm_command(name: str) -> Any:
    """The click command of ``agentbolt train NAME``, built through typer from generated options."""
    cls = algorithm_class(name)
    sections = _sections(cls)

    def command(**params: Any) -> None:
        _train(name, cls, sections, params)

    params = [
        *_common_parameters(),
        *(p for s in sections for p in _parameters(s)),
        *_program_parameters(),
        *reward_parameters(),
    ]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = _command_help(cls, sections[0].schema)
    app = typer.Typer(add_completion=False)
    app.command(name)(command)
    return typer.main.get_command(app)


def _sections(cls: type) -> list[_Section]:
    """The algorithm's, the Trainer's and Program's settings, in that order."""
    return [
        _Section(algorithm_schema(cls), "Algorithm options"),
        _Section(trainer_schema(), "Trainer options", "trainer"),
        _Section(program_schema(), PROGRAM_PANEL, "program"),
    ]


def _command_help(cls: type, schema: Schema) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(f"{cls.__name__}("):
        # a dataclass without a docstring gets its signature as one; its module's says more
        doc = inspect.getdoc(sys.modules[cls.__module__]) or cls.__name__
    text = (
        f"{_summary(cls, doc)}\n\nSettings come from the --config file (TOML or YAML: the"
        " algorithm's at the top, \\[trainer] and \\[program] tables), then from flags."
    )
    # the evaluators are given by the reward flags (a judge, reviews)
    python_only = [name for name in schema.python_only if name != "evaluators"]
    if python_only:
        text += f"\n\nSettable from Python only: {', '.join(python_only)}."
    if "evaluators" in schema.python_only:
        text += f"\n\nEvaluators (a judge, a person's review): see {REWARD_PANEL}."
    return text


def _summary(cls: type, doc: str) -> str:
    first = doc.splitlines()[0]
    return first if first.startswith(f"{cls.__name__}:") else f"{cls.__name__}: {first}"


def _common_parameters() -> list[inspect.Parameter]:
    return [
        keyword_option(
            "agent", str | None, "--agent", "-a", help="The agent: module:object or file.py:object."
        ),
        keyword_option(
            "command", str | None, "--command", "-c", help="The agent as a program: an argv template."
        ),
        keyword_option(
            "train_file",
            Path | None,
            "--train",
            help="Training tasks: a JSON list or JSON-lines file, or a task spec such as "
            "'reasoning_gym:spell_backward?size=256' or 'gymnasium:FrozenLake-v1' (docs/training.md).",
        ),
        keyword_option(
            "val_file",
            Path | None,
            "--val",
            help="Validation tasks: a JSON list or JSON-lines file, or a task spec (held-out items).",
        ),
        keyword_option("config", Path | None, "--config", help="Settings file (.toml, .yaml or .yml)."),
        keyword_option(
            "nproc",
            int | None,
            "--nproc",
            help="Train over N ranks on this machine: runs torchrun --standalone --nproc-per-node N "
            "(GRPO and SFT; docs/training.md).",
        ),
    ]


def _program_parameters() -> list[inspect.Parameter]:
    """The Program options not generated: each takes a form its type does not say."""
    env_help = "NAME=TEMPLATE: a variable rendered from the task's fields (repeatable)."
    scorer_help = "module:fn or file.py:fn scoring each run (sees the task, output, model calls)."
    read_help = "An absolute path a sandboxed program also sees, read-only (repeatable)."
    return [
        keyword_option("env", list[str] | None, "--env", help=env_help, panel=PROGRAM_PANEL),
        keyword_option(
            "sandbox_read", list[str] | None, "--sandbox-read", help=read_help, panel=PROGRAM_PANEL
        ),
        keyword_option("scorer", str | None, "--scorer", help=scorer_help, panel=PROGRAM_PANEL),
    ]


def _parameters(section: _Section) -> list[inspect.Parameter]:
    return [_parameter(section, s) for s in _generated(section)]


def _generated(section: _Section) -> list[Setting]:
    """The section's settings with a generated flag: the program's ``env`` and ``sandbox_read``
    repeat, by hand."""
    by_hand = ("env", "sandbox_read") if section.table == "program" else ()
    return [s for s in section.schema.settings.values() if s.key not in by_hand]


def _parameter(section: _Section, setting: Setting) -> inspect.Parameter:
    """One generated flag. Its value is None unless given, so a flag overrides only when used."""
    help_text = escape(f"{' '.join(setting.help.split())} [default: {setting.shown_default()}]".lstrip())
    flag = setting.flag
    if setting.is_bool:
        decls: tuple[str, ...] = (f"{flag}/--no-{flag.removeprefix('--')}",)
        kind: Any = bool | None
    else:
        short = SHORT_FLAGS.get(setting.key) if section.table == "trainer" else None
        decls, kind = (flag, short) if short else (flag,), str | None
    # the token is read from the environment too, so it need not show in a process list
    envvar = "AGENTBOLT_TOKEN" if section.table == "trainer" and setting.key == "token" else None
    info = typer.Option(
        *decls,
        help=help_text,
        show_default=False,
        rich_help_panel=section.panel,
        envvar=envvar,
        metavar=_metavar(setting),
    )
    return inspect.Parameter(
        setting.dest, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, info]
    )


def _metavar(setting: Setting) -> str | None:
    """What a flag takes, in words: the type without ``None`` (``none`` is always accepted)."""
    if setting.is_bool:
        return None
    if setting.key == "reward":
        return "NAME|NAME=W,..."
    members = [m for m in union_members(setting.kind) if m is not type(None)]
    if typing.get_origin(setting.kind) is typing.Literal:
        return "|".join(map(str, typing.get_args(setting.kind)))
    return "|".join(_METAVARS.get(typing.get_origin(m) or m, "TEXT") for m in members)


def _train(name: str, cls: type, sections: list[_Section], params: dict[str, Any]) -> None:
    from agentbolt.memory import bound_kernel_cache

    bound_kernel_cache()  # before any product: oneDNN reads it once (memory.bound_kernel_cache)
    try:
        values = _settings(sections, params)
        if params.get("judge_via_server") and not values.get("trainer", {}).get("server"):
            raise ConfigError(
                "--judge-via-server calls the judge through a server that holds its key: give that "
                "server with --server (the embedded one holds no upstream keys)"
            )
        given = evaluators(params)
        algorithm = cls(**sections[0].schema.kwargs(values[None]), **({"evaluators": given} if given else {}))
        agent = _agent(params, values.get("program", {}))
    except ConfigError as exc:
        raise fail(str(exc)) from None
    train = _tasks(params["train_file"], "train", "--train")
    val = _tasks(params["val_file"], "heldout", "--val")
    if not train and not val:
        raise fail("no tasks: give --train FILE and/or --val FILE")
    nproc = params.get("nproc")
    if nproc is not None:
        _launch_ranks(name, nproc)
    with needs_extra(f"agentbolt train {name}", *ALGORITHMS[name][1]):
        from agentbolt.algorithms.distributed import DistributedError
        from agentbolt.cli.train_resources import run_resources
        from agentbolt.trainer import Trainer

        kwargs = sections[1].schema.kwargs(values["trainer"])
        own = params["agent"] is None and params["command"] is None
        try:
            with run_resources(name, kwargs, agent if own else None) as resources:
                Trainer(algorithm, **{**kwargs, "resources": resources}).fit(agent, train, val)
        except (ConfigError, DistributedError) as exc:
            raise fail(str(exc)) from None


def _launch_ranks(name: str, nproc: int) -> None:
    """``--nproc N``: this very command again as N ranks under torchrun (replaces this process);
    nothing for N = 1 or when already one of torchrun's ranks."""
    if nproc < 1:
        raise fail(f"--nproc must be at least 1; got {nproc}")
    if nproc == 1 or os.environ.get("WORLD_SIZE"):
        return
    if ALGORITHMS[name][0] not in ("GRPO", "SFT"):
        raise fail(f"--nproc: {name} does not train over several ranks (only grpo and sft do)")
    args = _without_nproc(sys.argv[1:])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [*command, "-m", "agentbolt", *args])


def _without_nproc(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _settings(sections: list[_Section], params: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    """Each section's settings by its table: the config file's, then the flags given."""
    values: dict[str | None, dict[str, Any]] = {s.table: {} for s in sections}
    if params["config"] is not None:
        path = params["config"]
        top, tables = split_config(load_config(path), path, tuple(s.table for s in sections if s.table))
        for section in sections:
            table = tables[section.table] if section.table else section.schema.flatten(top)
            values[section.table] = _from_file(section, dict(table), path)
    for section in sections:
        values[section.table].update(_flags(section, params))
    values["program"].update(_program_flags(params))
    return values


def _from_file(section: _Section, table: dict[str, Any], path: Path) -> dict[str, Any]:
    where = f"{path} [{section.table}]" if section.table else str(path)
    scorer = table.pop("scorer", None) if section.table == "program" else None
    checked = section.schema.check_all(table, where)
    if scorer is not None:
        checked["scorer"] = _scorer(scorer)
    return checked


def _flags(section: _Section, params: dict[str, Any]) -> dict[str, Any]:
    given = {s.key: (s, params.get(s.dest)) for s in _generated(section)}
    return {key: s.check(value, from_flag=True) for key, (s, value) in given.items() if value is not None}


def _program_flags(params: dict[str, Any]) -> dict[str, Any]:
    """``--env NAME=TEMPLATE`` and ``--sandbox-read PATH`` (repeated) and ``--scorer module:fn``."""
    given: dict[str, Any] = {}
    if params.get("env"):
        given["env"] = env_templates(params["env"], "--env")
    if params.get("sandbox_read"):
        given["sandbox_read"] = params["sandbox_read"]
    if params.get("scorer"):
        given["scorer"] = _scorer(params["scorer"])
    return given


def _scorer(spec: Any) -> Any:
    from agentbolt.runner.worker import load_object

    if not isinstance(spec, str):
        raise ConfigError(f"[program] scorer: expected 'module:fn', got {spec!r}")
    sys.path.insert(0, os.getcwd())
    return load_object(spec, "scorer")


def _tasks(path: Path | None, split: Split, flag: str) -> list[Any]:
    """The tasks of ``--train`` / ``--val``: a file's, or those a task spec draws for ``split``."""
    from agentbolt.tasks.external import SPEC_FORMS, is_spec, spec_tasks

    if path is None:
        return []
    if not is_spec(str(path)):
        if ":" in str(path) and not path.exists():
            raise fail(f"{flag} {path}: neither a task file nor a task spec ({SPEC_FORMS})")
        return load_tasks(path)
    try:
        return spec_tasks(str(path), split)[1]
    except ValueError as exc:
        raise fail(f"{flag}: {exc}") from None


def _spec_agent(params: dict[str, Any]) -> Any:
    """The agent of the task spec given as --train (else --val); None without a spec."""
    from agentbolt.tasks.external import external_task, is_spec

    specs = [str(p) for p in (params["train_file"], params["val_file"]) if p is not None and is_spec(str(p))]
    if not specs:
        return None
    try:
        return external_task(specs[0]).agent()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _agent(params: dict[str, Any], program: dict[str, Any]) -> Any:
    spec, command = params["agent"], params["command"]
    if spec is None and command is None and (own := _spec_agent(params)) is not None:
        return own  # the task spec's own agent: it plays the environment
    if (spec is None) == (command is None):
        raise ConfigError(
            "give the agent as exactly one of --agent module:object or --command '...' (or give a "
            "task spec as --train / --val: its own agent plays it)"
        )
    if command is None:
        from agentbolt.runner.worker import load_agent

        sys.path.insert(0, os.getcwd())
        return load_agent(str(spec))
    from agentbolt.runner.program import Program

    return Program(command, **program)
