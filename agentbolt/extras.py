"""The optional parts of agentbolt (``pip install 'agentbolt[server]'`` ...) and how their
absence is reported: one :class:`~agentbolt.errors.MissingExtra` naming the extra to install,
instead of a ``ModuleNotFoundError`` from deep inside a dependency."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from agentbolt.errors import MissingExtra

__all__ = ["EXTRA_OF", "lazy_attributes", "needs_extra"]

# The top-level modules each extra of pyproject.toml brings, as agentbolt imports them.
EXTRA_OF = {
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "torch": "train",
    "transformers": "train",
    "peft": "train",
    "safetensors": "train",
    "gguf": "train",
    "numpy": "train",
    "matplotlib": "train",
    "datasets": "export",
    "ray": "ray",
    "kubernetes": "kubernetes",
    "reasoning_gym": "envs",
    "gymnasium": "envs",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # an import hook that refuses the module
        return False


@contextmanager
def needs_extra(what: str, *extras: str) -> Iterator[None]:
    """Run a block (or, as a decorator, a function) that needs ``extras``.

    Before it starts, every module of ``extras`` must be installed, so a command fails before
    doing any work. Inside, a missing module of any extra (``psycopg`` when a server is given a
    PostgreSQL URL) raises :class:`MissingExtra` naming its extra. A module no extra provides (an
    agent's own import) is left to raise as it is."""
    for module, extra in EXTRA_OF.items():
        if extra in extras and not _installed(module):
            raise MissingExtra(what, extras, module)
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        its_extra = EXTRA_OF.get(missing)
        if its_extra is None:
            raise
        raise MissingExtra(what, extras if its_extra in extras else (its_extra,), missing) from None


def lazy_attributes(
    package: str, namespace: dict[str, Any], lazy: Mapping[str, tuple[str, tuple[str, ...]]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for names imported on first use: ``lazy``
    maps each name to the module that defines it and the extras that module needs, so a name
    whose extra is missing raises :class:`MissingExtra` naming it, and the package itself imports
    without any extra. A name, once imported, is kept in ``namespace`` (the package's globals)."""

    def getattr_(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, extras = lazy[name]
        with needs_extra(name, *extras):
            value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return getattr_, dir_
