"""The optional parts of agentbolt (``pip install 'agentbolt[server]'`` ...) and how their
absence is reported: one :class:`~agentbolt.errors.MissingExtra` naming the extra to install,
instead of a ``ModuleNotFoundError`` from deep inside a dependency."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from agentbolt.errors import MissingExtra

__all__ = ["EXTRA_OF", "needs_extra"]

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
