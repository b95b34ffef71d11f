"""Command-line settings generated from the Python API, so the two cannot drift.

Each field of an algorithm dataclass (``GRPO.lr``) and each parameter of ``Trainer``
(``n_runners``) becomes a :class:`Setting`: its name, default and help are read from the class
itself. The help is the docstring each class already puts under a field, read from the class
source with ``ast``; keeping a copy in field metadata would be a second text to keep in step.

A field of a dataclass type (``SFT.train``, a ``TrainConfig``) is spread into one setting per
inner field, named as the inner field (``lr``, the name GRPO's own field has too), whose
default comes from the outer default (``SFT`` trains at ``lr=2e-4``, not ``TrainConfig``'s own
``1e-4``). A setting may be named apart from its Python name where the command line names the
same thing alike in every command (``Trainer``'s ``n_runners`` is ``runners``); a config file
that still uses the Python name or the dotted ``train.lr`` is told the setting's name. A field that only Python can give (a live
``PolicyServer``) is listed apart, as Python-only. Values from a config file or a flag are
checked by pydantic against the field's type; a bad one raises :class:`ConfigError` naming
its key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import PydanticUserError, TypeAdapter, ValidationError

from agentbolt.errors import ConfigError

__all__ = [
    "Schema",
    "Setting",
    "dataclass_schema",
    "load_config",
    "parameters_schema",
    "split_config",
    "union_members",
]

_NONE_WORDS = ("none", "null")


@dataclass(frozen=True)
class Setting:
    """One option: ``key`` as in a config file and its flag (``lr``, ``runners``), with its type
    and default."""

    key: str
    kind: Any
    default: Any
    help: str
    target: str = ""
    """Where the value goes in Python when that is not ``key``: the parameter ``n_runners``, or
    ``train.lr`` (field ``lr`` of the spread field ``train``)."""

    @property
    def dest(self) -> str:
        """The Python identifier click stores the flag's value under."""
        return self.key

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        """A flag pair ``--x/--no-x``: a bool, or a bool that None leaves to the code (unset)."""
        return self.kind is bool or set(union_members(self.kind)) == {bool, type(None)}

    def shown_default(self) -> str:
        if self.default is dataclasses.MISSING:
            return "required"
        if self.default is None:
            return "none"
        if isinstance(self.default, bool | dict | list | tuple):
            return json.dumps(self.default)
        return str(self.default)

    def check(self, value: Any, *, from_flag: bool = False) -> Any:
        """``value`` as this setting's type; a flag's text is parsed first (JSON for a table)."""
        if from_flag and isinstance(value, str):
            value = self._parse_flag(value)
        elif not from_flag:
            self._check_scalar(value)
        try:
            return _adapter(self.kind).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ConfigError(f"{self.key}: {reason} (got {value!r})") from None

    def _check_scalar(self, value: Any) -> None:
        """A file's true/false and numbers are typed: pydantic's lax mode would take ``steps =
        true`` as 1 and ``lora = 1`` as true, which is a mistake to report, not to guess at."""
        members = union_members(self.kind)
        if isinstance(value, bool) and bool not in members:
            raise ConfigError(f"{self.key}: expected {self._words()}, got {value!r}")
        if not isinstance(value, bool) and self.kind is bool:
            raise ConfigError(f"{self.key}: expected true or false, got {value!r}")

    def _words(self) -> str:
        names = (
            "none" if m is type(None) else getattr(m, "__name__", str(m)) for m in union_members(self.kind)
        )
        return " or ".join(names)

    def _parse_flag(self, text: str) -> Any:
        if text.lower() in _NONE_WORDS and _allows_none(self.kind):
            return None
        if not _is_structured(self.kind):
            return text
        if text.lstrip()[:1] not in ("[", "{") and _accepts_text(self.kind):
            return text  # ``--target-modules all-linear``
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{self.key}: expected JSON, got {text!r}") from None


@dataclass(frozen=True)
class Schema:
    """Every setting of one class; ``parents`` holds the default of each spread dataclass field,
    ``renamed`` the setting key of each Python name (or dotted ``train.lr``) that is not one."""

    settings: dict[str, Setting]
    parents: dict[str, Any]
    python_only: tuple[str, ...]
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)

    def check_all(self, values: dict[str, Any], source: str) -> dict[str, Any]:
        """Each of ``values`` checked; an unknown key names the close ones, a Python name the key."""
        checked = {}
        for key, value in values.items():
            if key in self.renamed:
                raise ConfigError(f"{source}: {key!r} is named {self.renamed[key]!r} (as its flag)")
            if key not in self.settings:
                raise ConfigError(f"{source}: unknown key {key!r}{self._suggest(key)}")
            checked[key] = self.settings[key].check(value)
        return checked

    def kwargs(self, values: dict[str, Any]) -> dict[str, Any]:
        """Checked ``values`` as keyword arguments: ``lr`` of ``SFT`` goes into its ``train``."""
        out: dict[str, Any] = {}
        inner: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            parent, _, name = (self.settings[key].target or key).rpartition(".")
            (inner.setdefault(parent, {}) if parent else out)[name] = value
        for parent, fields in inner.items():
            out[parent] = dataclasses.replace(self.parents[parent], **fields)
        return out

    def flatten(self, table: dict[str, Any]) -> dict[str, Any]:
        """A config table's keys as dotted keys (only a spread field's table is opened, which
        ``check_all`` then answers with the setting's own key)."""
        flat = {}
        for key, value in table.items():
            if key in self.parents and isinstance(value, dict):
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[key] = value
        return flat

    def _suggest(self, key: str) -> str:
        close = difflib.get_close_matches(key, list(self.settings), n=2)
        return f" (did you mean {' or '.join(close)}?)" if close else ""


def dataclass_schema(cls: type, names: dict[str, str] | None = None) -> Schema:
    """The settings of dataclass ``cls``: one per field, a dataclass field spread into its own;
    ``names`` gives a field's setting key where it is not the field's name."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls, include_extras=True)
    settings: list[Setting] = []
    parents: dict[str, Any] = {}
    python_only = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = _default_of(f)
        if dataclasses.is_dataclass(hints[f.name]):
            parents[f.name] = default
            inner = dataclass_schema(hints[f.name]).settings.values()
            settings += (_nested(f.name, s, default) for s in inner)
            continue
        kind = cli_type(hints[f.name])
        if kind is None:
            python_only.append(f.name)
            continue
        settings.append(_named(Setting(f.name, kind, default, docs.get(f.name, "")), names))
    return _schema(cls.__name__, settings, parents, tuple(python_only))


def parameters_schema(
    func: Any, skip: tuple[str, ...], docs: dict[str, str], names: dict[str, str] | None = None
) -> Schema:
    """The settings of ``func``'s keyword parameters (``Trainer.__init__``), but ``skip``;
    ``names`` gives a parameter's setting key where it is not the parameter's name."""
    hints = typing.get_type_hints(func, include_extras=True)
    settings, python_only = [], []
    for name, param in inspect.signature(func).parameters.items():
        if name in skip or name == "self":
            continue
        kind = cli_type(hints[name])
        if kind is None:
            python_only.append(name)
            continue
        default = dataclasses.MISSING if param.default is param.empty else param.default
        settings.append(_named(Setting(name, kind, default, docs.get(name, "")), names))
    return _schema(func.__qualname__, settings, {}, tuple(python_only))


def _named(setting: Setting, names: dict[str, str] | None) -> Setting:
    key = (names or {}).get(setting.key)
    return dataclasses.replace(setting, key=key, target=setting.key) if key else setting


def _schema(
    owner: str, settings: list[Setting], parents: dict[str, Any], python_only: tuple[str, ...]
) -> Schema:
    by_key: dict[str, Setting] = {}
    for setting in settings:
        if setting.key in by_key:  # a spread field's name met the class's own: a key for each is needed
            raise TypeError(f"{owner}: two settings are named {setting.key!r}")
        by_key[setting.key] = setting
    renamed = {s.target: s.key for s in settings if s.target}
    return Schema(by_key, parents, python_only, renamed)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (and of its dataclass bases), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        [node] = ast.parse(textwrap.dedent(inspect.getsource(klass))).body
        assert isinstance(node, ast.ClassDef)
        for item, after in zip(node.body, node.body[1:], strict=False):
            text = _text(after)
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and text is not None:
                docs[item.target.id] = inspect.cleandoc(text)
    return docs


def cli_type(hint: Any) -> Any:
    """``hint`` without the union members no file or flag can give; None when none is left
    but ``None`` itself (such a field is Python-only)."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    kept = [m for m in members if _representable(m)]
    if not [m for m in kept if m is not type(None)]:
        return None
    return kept[0] if len(kept) == 1 else typing.Union[tuple(kept)]  # noqa: UP007


def load_config(path: Path) -> dict[str, Any]:
    """A TOML or YAML file (by its suffix) as a table; any problem is one :class:`ConfigError`."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = _parse(path)
    except (tomllib.TOMLDecodeError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper()} ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table of settings, not a {type(data).__name__}")
    return data


def split_config(
    data: dict[str, Any], path: Path, tables: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A config file's top-level settings, and each of its named ``tables`` (``[trainer]``)."""
    found = {}
    for name in tables:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name!r} must be a table of settings")
        found[name] = table
    return {k: v for k, v in data.items() if k not in tables}, found


def _parse(path: Path) -> Any:
    if path.suffix == ".toml":
        return tomllib.loads(path.read_text())
    if path.suffix in (".yaml", ".yml"):
        import yaml  # only a YAML config needs it

        try:
            return yaml.safe_load(path.read_text())
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{exc.problem}{where}") from None
        except yaml.YAMLError as exc:
            raise ValueError(" ".join(str(exc).split())) from None
    raise ValueError(f"unknown config format {path.suffix!r}: use .toml, .yaml or .yml")


def _nested(parent: str, inner: Setting, default: Any) -> Setting:
    target = f"{parent}.{inner.key}"
    return Setting(inner.key, inner.kind, getattr(default, inner.key), inner.help, target)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _text(node: ast.stmt) -> str | None:
    """The string of a statement that is a string literal (a docstring); None otherwise."""
    if (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ):
        return node.value.value
    return None


def union_members(kind: Any) -> tuple[Any, ...]:
    """The members of a union type; a plain type is its own only member."""
    return typing.get_args(kind) if _is_union(kind) else (kind,)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _allows_none(kind: Any) -> bool:
    return _is_union(kind) and type(None) in typing.get_args(kind)


def _is_structured(kind: Any) -> bool:
    """A table or a list: a flag gives it as JSON."""
    members = typing.get_args(kind) if _is_union(kind) else (kind,)
    return any(typing.get_origin(m) in (dict, list, tuple) or m in (dict, list, tuple) for m in members)


def _accepts_text(kind: Any) -> bool:
    return str in (typing.get_args(kind) if _is_union(kind) else (kind,))


def _representable(hint: Any) -> bool:
    """Whether pydantic can check a value of ``hint`` (a live object such as a module cannot)."""
    try:
        _adapter(hint)
    except PydanticUserError:
        return False
    return True


def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)
