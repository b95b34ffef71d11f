"""Environments other projects wrote, used unmodified, named by a spec:

- ``reasoning_gym:<dataset>?<option>=<value>&...``: a reasoning-gym dataset, scored by the
  dataset's own scorer (:mod:`agentbolt.tasks.reasoning_gym`);
- ``gymnasium:<env id>?<option>=<value>&...``: a Gymnasium toy-text environment played as text,
  one model turn per environment step (:mod:`agentbolt.tasks.gymnasium_text`);
- ``agentbolt:<task>?size=...``: one of agentbolt's own tasks (``calculator``, ``chain``,
  ``guess``), so that ``--train`` and ``--val`` can draw them too.

Three options are agentbolt's own: ``size`` and ``seed``, how many tasks a spec given as
``agentbolt train --train`` / ``--val`` draws and from which seed (256 from seed 1 for training,
96 from seed 2 held out), and ``max_tokens``, the model's reply length per turn. Every other
option configures the dataset or the environment. Values are read as JSON where they parse
(``5``, ``0.8``, ``true``, ``[1,3]``), else as text. Which split a task belongs to never depends
on the seed: a hash of its content decides (:func:`agentbolt.tasks.base.split_of`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from agentbolt.errors import MissingExtra

if TYPE_CHECKING:
    from agentbolt.schemas import Task
    from agentbolt.tasks import BuiltinTask
    from agentbolt.tasks.base import Split

__all__ = [
    "SPEC_FORMS",
    "TaskSpec",
    "configure",
    "external_task",
    "id_prefix",
    "is_spec",
    "parse_spec",
    "spec_tasks",
]

SOURCES = {"reasoning_gym": "reasoning_gym", "gymnasium": "gymnasium", "agentbolt": "agentbolt"}
"""Each spec prefix and the module its package installs."""
SPEC_FORMS = "reasoning_gym:<dataset>[?option=value&...], gymnasium:<env id>[?option=value&...], agentbolt:<task>[?size=N]"
DRAWS: dict[str, tuple[int, int]] = {"train": (256, 1), "heldout": (96, 2)}
"""Tasks drawn and their seed, by split, when the spec gives no ``size`` / ``seed``."""


@dataclass(frozen=True)
class TaskSpec:
    source: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    """The dataset's or environment's options, read from the spec."""
    size: int | None = None
    seed: int | None = None
    max_tokens: int | None = None

    @property
    def label(self) -> str:
        """The spec without ``size`` and ``seed``: the task's name."""
        query = "&".join(f"{k}={_text(v)}" for k, v in self.options.items())
        if self.max_tokens is not None:
            query += f"{'&' if query else ''}max_tokens={self.max_tokens}"
        return f"{self.source}:{self.name}{'?' + query if query else ''}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def is_spec(text: str) -> bool:
    """Whether ``text`` names an external task (``<source>:...``), not a built-in one or a file."""
    source, colon, _ = text.partition(":")
    return bool(colon) and source in SOURCES


def parse_spec(text: str) -> TaskSpec:
    """The spec's parts; ValueError saying what is wrong with it."""
    source, colon, rest = text.partition(":")
    if not colon or source not in SOURCES:
        raise ValueError(f"{text!r} is not a task spec; write one of: {SPEC_FORMS}")
    name, _, query = rest.partition("?")
    if not name:
        raise ValueError(f"{text!r}: name the {source} task after '{source}:'")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise ValueError(f"{text!r}: write the options as ?name=value&name=value") from None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise ValueError(f"{text!r}: option {key!r} is given twice")
        options[key] = _value(value)
    own: dict[str, int] = {}
    for key, least in (("size", 1), ("seed", 0), ("max_tokens", 1)):
        if key in options:
            value = options.pop(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{text!r}: {key} must be a whole number of at least {least}, not {value!r}")
            own[key] = value
    return TaskSpec(source, name, options, **own)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def configure(defaults: dict[str, Any], given: dict[str, Any], where: str) -> dict[str, Any]:
    """``given`` options checked against the ones ``defaults`` names, each brought to its
    default's type (an int where a float is expected, a list where a tuple is); ValueError
    naming the choices for an unknown option, or the type expected."""
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key not in defaults:
            raise ValueError(
                f"{where}: no option {key!r}; its options: {', '.join(sorted(defaults)) or 'none'}"
            )
        default = defaults[key]
        if default is None:
            pass
        elif isinstance(default, str):
            value = _text(value)  # "123" was read as a number
        elif isinstance(default, bool) != isinstance(value, bool):
            raise ValueError(f"{where}: {key} expects {_kind(default)}, got {value!r}")
        elif isinstance(default, float) and isinstance(value, int):
            value = float(value)
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        elif not isinstance(value, type(default)):
            raise ValueError(f"{where}: {key} expects {_kind(default)}, got {value!r}")
        out[key] = value
    return out


def _kind(default: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}
    return names.get(type(default), f"a value like {_text(default)}")


def id_prefix(name: str, options: dict[str, Any]) -> str:
    """The start of a task id: the task's ``name`` and, with options, a hash of them (one item
    drawn under two configs is two tasks: their data differ, and a server keeps a task id's data
    for good)."""
    if not options:
        return name
    return f"{name}-{hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]}"


def external_task(spec: str | TaskSpec) -> BuiltinTask:
    """The task a spec names; ValueError for a bad spec (an unknown dataset or environment
    lists a few that exist), MissingExtra when the source's package is not installed."""
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    module = SOURCES[parsed.source]
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"the task {parsed.label!r}", ("envs",), module)
    if parsed.source == "agentbolt":
        task = _own_task(parsed)
    elif parsed.source == "reasoning_gym":
        from agentbolt.tasks.reasoning_gym import reasoning_gym_task

        task = reasoning_gym_task(parsed.name, parsed.options, parsed.label)
    else:
        from agentbolt.tasks.gymnasium_text import gymnasium_task

        task = gymnasium_task(parsed.name, parsed.options, parsed.label)
    return task if parsed.max_tokens is None else replace(task, max_tokens=parsed.max_tokens)


def spec_tasks(spec: str, split: Split) -> tuple[BuiltinTask, list[Task]]:
    """The task a spec names and the tasks it draws for ``split``: ``size`` from ``seed``
    (defaults: :data:`DRAWS`)."""
    parsed = parse_spec(spec)
    task = external_task(parsed)
    size, seed = DRAWS[split]
    return task, task.make_tasks(parsed.size or size, seed if parsed.seed is None else parsed.seed, split)


def _own_task(parsed: TaskSpec) -> BuiltinTask:
    """agentbolt's own task a spec names; ValueError naming the choices, or the options it takes
    (``size``, ``seed`` and ``max_tokens`` only)."""
    from agentbolt.tasks import TASKS

    if parsed.name not in TASKS:
        raise ValueError(f"{parsed.label!r}: no such task; agentbolt's own: {', '.join(TASKS)}")
    if parsed.options:
        raise ValueError(f"{parsed.label!r}: agentbolt's own tasks take size, seed and max_tokens only")
    return TASKS[parsed.name]
