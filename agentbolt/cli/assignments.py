"""``NAME=VALUE`` items of repeatable options (``--env QUESTION={question}``,
``--ray-resource sandbox=1``): one reading of them, and one message for an item that is not of
that form, naming the option and the item."""

from __future__ import annotations

from collections.abc import Iterable

from agentbolt.errors import ConfigError

__all__ = ["assignment", "assignments", "env_templates", "malformed"]


def assignment(item: str, option: str, form: str, example: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> ``(NAME, VALUE)``, split at the first ``=`` (a value may hold more);
    the name without surrounding blanks, and never empty."""
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise malformed(item, option, form, example)
    return name.strip(), value


def assignments(items: Iterable[str], option: str, form: str, example: str) -> dict[str, str]:
    """Each item read by :func:`assignment`; a name given again takes the later value."""
    return dict(assignment(item, option, form, example) for item in items)


def env_templates(items: Iterable[str], option: str) -> dict[str, str]:
    """A program's variables made from task fields (``--env QUESTION={question}``)."""
    return assignments(items, option, "NAME=TEMPLATE", "QUESTION={question}")


def malformed(item: str, option: str, form: str, example: str) -> ConfigError:
    """The error for an item of ``option`` that is not of ``form`` (e.g. ``NAME=TEMPLATE``)."""
    return ConfigError(f"{option} {item!r} must look like {form}, e.g. {example}")
