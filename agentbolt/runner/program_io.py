"""What a program agent is given and what it gives back, apart from running it: argv and
variable templates filled from the task, the environment without the runner's secrets, and
output kept within a limit."""

from __future__ import annotations

import asyncio
import json
import re
import string
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from agentbolt.errors import AgentboltError, ConfigError
from agentbolt.schemas import LLM, PromptTemplate, Resources

__all__ = [
    "OUTPUT_LIMIT",
    "TOKEN_VARIABLES",
    "CappedOutput",
    "ProgramFailed",
    "check_template",
    "prompt_variables",
    "render",
    "role_variables",
    "secret_free_environ",
]

OUTPUT_LIMIT = 64 * 1024
"""Bytes of stdout and of stderr recorded per rollout by default."""

TOKEN_VARIABLES = frozenset({"AGENTBOLT_TOKEN", "AGENTBOLT_RUNNER_TOKEN"})
"""Where the runner's own token is usually given; never passed to a program."""

_MIN_SECRET = 8
"""Secrets at least this long are also looked for inside variables (``Bearer <token>``); a
shorter one only as a whole value, so a one-letter test token does not empty the environment."""


class ProgramFailed(AgentboltError):
    """The attempt fails for a reason the runner states (``kind`` names it in the event)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _TaskFormatter(string.Formatter):
    """``{field}`` from the task's data; a structured value goes in as JSON, not Python repr."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        if isinstance(value, dict | list | bool) or value is None:
            value = json.dumps(value)
        return super().format_field(value, format_spec)


_FORMATTER = _TaskFormatter()


def check_template(template: str, where: str) -> None:
    """Refuse, when the program is made, a template no task could fill."""
    try:
        fields = [name for _, name, _, _ in _FORMATTER.parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(
            f"{where}: bad template {template!r} ({exc}; a literal brace is written twice)"
        ) from None
    for name in fields:
        if name == "" or name[0].isdigit():
            raise ConfigError(f"{where}: {template!r} must name task fields, as in {{question}}")


def render(template: str, fields: Mapping[str, Any], where: str) -> str:
    """``template`` with the task's fields; a field the task lacks fails the attempt."""
    try:
        return _FORMATTER.vformat(template, (), dict(fields))
    except (KeyError, AttributeError, IndexError) as exc:
        have = ", ".join(sorted(fields)) or "none"
        raise ProgramFailed(
            "TaskField",
            f"{where}: the task has no field {exc.args[0]!r} for {template!r} (its fields: {have})",
        ) from None


def prompt_variables(resources: Resources | None, folder: Path | None) -> dict[str, str]:
    """Every prompt resource of the rollout, for a program to read where it likes: its text in
    ``AGENTBOLT_PROMPT_<NAME>`` and in the file ``folder/<name>.txt`` that
    ``AGENTBOLT_PROMPT_<NAME>_FILE`` names (``NAME``: the resource's name in capitals, anything
    but letters and digits as ``_``; ``system_prompt`` -> ``AGENTBOLT_PROMPT_SYSTEM_PROMPT``);
    without a ``folder``, the text only. So a prompt optimizer's candidates reach a program
    agent with no change to its code."""
    env: dict[str, str] = {}
    for name, resource in (resources.resources if resources else {}).items():
        if not isinstance(resource, PromptTemplate):
            continue
        key = _variable(name)
        env[f"AGENTBOLT_PROMPT_{key}"] = resource.template
        if folder is not None:  # None: a Kubernetes pod, which shares no file system with us
            folder.mkdir(exist_ok=True)
            path = folder / f"{key.lower()}.txt"
            path.write_text(resource.template, encoding="utf-8")
            env[f"AGENTBOLT_PROMPT_{key}_FILE"] = str(path)
    return env


def _variable(name: str) -> str:
    """A resource's name as part of a variable name: capitals, anything but letters and digits
    as ``_`` (``system_prompt`` -> ``SYSTEM_PROMPT``)."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def role_variables(resources: Resources | None, url_of: Callable[[str, LLM], str]) -> dict[str, str]:
    """Every LLM resource of the rollout (every role of a system of agents), for a program to
    call the one it means: its gateway URL (``url_of(name, resource)``) in
    ``AGENTBOLT_LLM_<NAME>_BASE_URL`` and its model in ``AGENTBOLT_LLM_<NAME>_MODEL``. A call
    to a role's URL with the role's model is recorded as that role's, even where other roles
    share the model."""
    env: dict[str, str] = {}
    for name, resource in (resources.resources if resources else {}).items():
        if isinstance(resource, LLM):
            env[f"AGENTBOLT_LLM_{_variable(name)}_BASE_URL"] = url_of(name, resource)
            env[f"AGENTBOLT_LLM_{_variable(name)}_MODEL"] = resource.model
    return env


def secret_free_environ(environ: Mapping[str, str], secrets: Iterable[str]) -> dict[str, str]:
    """``environ`` without the variables that hold one of ``secrets`` (the runner's token
    and the worker token it was issued) or that are named for the runner's token."""
    secrets = [s for s in secrets if s]

    def holds(value: str) -> bool:
        return any(value == s or (len(s) >= _MIN_SECRET and s in value) for s in secrets)

    return {k: v for k, v in environ.items() if k not in TOKEN_VARIABLES and not holds(v)}


class CappedOutput:
    """One output stream, read to its end, of which the first and last halves of ``limit``
    bytes are kept: the start says what the program set out to do, the end how it ended."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        keep = self.limit // 2
        if len(self.tail) > 2 * keep:  # trim now and then, not on every chunk
            del self.tail[: len(self.tail) - keep]

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.add(chunk)

    @property
    def cut(self) -> int:
        return max(0, self.total - self.limit)

    def text(self) -> str:
        tail = bytes(self.tail[len(self.tail) - self.limit // 2 :]) if self.cut else bytes(self.tail)
        if not self.cut:
            return (bytes(self.head) + tail).decode(errors="replace")
        middle = f"\n[… {self.cut} bytes cut …]\n"
        return bytes(self.head).decode(errors="replace") + middle + tail.decode(errors="replace")

    def sizes(self) -> dict[str, int]:
        return {"bytes": self.total, "cut_bytes": self.cut}
