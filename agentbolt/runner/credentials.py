"""The runner's token kept from its agents: out of its environment, out of the command line that
``ps`` shows, and out of reach of its children's ``/proc`` reads.

* ``os.environ`` loses the token variables (``AGENTBOLT_TOKEN``, ``AGENTBOLT_RUNNER_TOKEN``, and
  any variable holding a token's value) once the client holds the token.
* ``/proc/<pid>/environ`` shows the environment the process started with (the block the kernel
  copied onto its stack), not ``os.environ``: removing a variable does not erase it there. So
  the token's bytes in that block are overwritten in place, as are those of a token given on
  the command line in the argument block (``/proc/<pid>/cmdline``, which every user of the
  machine may read). Copies in the heap (the client's headers) remain: they are the next point.
* The process is made non-dumpable (``PR_SET_DUMPABLE`` 0): another process of the same
  non-root user then cannot open its ``/proc/<pid>/environ``, ``mem`` or ``maps`` (the kernel's
  ptrace access check). Root, or any process with ``CAP_SYS_PTRACE``, is not stopped by this:
  a program agent must run as another, unprivileged user (``run_as``) or sandboxed.

In-process agents share the runner's memory: they are trusted code by definition.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterable, Sequence

from agentbolt.runner.program_io import TOKEN_VARIABLES

__all__ = ["forget_tokens", "hide_in_blocks", "make_undumpable", "unprotected_warning"]

log = logging.getLogger("agentbolt.runner")

MIN_SECRET = 8
"""A secret at least this long is also hidden where it is part of a value (``Bearer <token>``)."""

_PR_SET_DUMPABLE = 4
_STAT_ARG_START = 48  # fields of /proc/<pid>/stat (man 5 proc), counted from 1
_STAT_ENV_START = 50


def forget_tokens(secrets: Iterable[str]) -> None:
    """Remove the token variables, and every variable holding one of ``secrets``, from
    ``os.environ``; overwrite the secrets in the environment and argument blocks that
    ``/proc/<pid>/environ`` and ``cmdline`` show."""
    secrets = [s for s in secrets if s]
    for name, value in list(os.environ.items()):
        if name in TOKEN_VARIABLES or _holds(value, secrets):
            del os.environ[name]
    hide_in_blocks(secrets)


def hide_in_blocks(secrets: Sequence[str]) -> bool:
    """Overwrite, with ``*``, the values of the token variables and of any variable holding one
    of ``secrets`` in this process's initial environment block, and each argument that is one
    of ``secrets`` (or ends in ``=<secret>``) in its argument block. False when the blocks could
    not be found here (not Linux, or ``/proc/self/stat`` unreadable)."""
    bounds = _block_bounds()
    if bounds is None:
        return False
    (arg_start, arg_end), (env_start, env_end) = bounds
    _overwrite(env_start, env_end, lambda entry: _env_value(entry, secrets))
    _overwrite(arg_start, arg_end, lambda entry: _arg_value(entry, secrets))
    return True


def make_undumpable() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: processes of the same user lose ptrace access (and so the
    ``/proc`` files it guards: environ, mem, maps); no core dump is written. False where
    ``prctl`` is missing or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def unprotected_warning(run_as: object, sandbox: bool) -> str | None:
    """The warning a root runner gives once for a program agent run unsandboxed as root."""
    if os.geteuid() != 0 or run_as is not None or sandbox:
        return None
    return (
        "program agents run as root, unsandboxed: a program can read this runner's memory and "
        "environment (its token); use --sandbox or --run-as USER (e.g. nobody)"
    )


# ---------------------------------------------------------------------------- the blocks


def _holds(value: str, secrets: Sequence[str]) -> bool:
    return any(value == s or (len(s) >= MIN_SECRET and s in value) for s in secrets)


def _env_value(entry: bytes, secrets: Sequence[str]) -> slice | None:
    """The part of ``NAME=VALUE`` to overwrite: the value, when it is a token's."""
    name, sep, value = entry.partition(b"=")
    if not sep or not value:
        return None
    text = value.decode(errors="replace")
    if name.decode(errors="replace") in TOKEN_VARIABLES or _holds(text, secrets):
        return slice(len(name) + 1, len(entry))
    return None


def _arg_value(entry: bytes, secrets: Sequence[str]) -> slice | None:
    """The part of one argument to overwrite: all of it, or what follows ``=``, when that is
    a secret; or each place a long secret appears in it."""
    text = entry.decode(errors="replace")
    for secret in secrets:
        if text == secret:
            return slice(0, len(entry))
        if text.endswith("=" + secret):
            return slice(len(entry) - len(secret.encode()), len(entry))
    if any(len(s) >= MIN_SECRET and s in text for s in secrets):
        return slice(0, len(entry))
    return None


def _overwrite(start: int, end: int, part: Callable[[bytes], slice | None]) -> None:
    """Overwrite, in ``[start, end)`` of this process's memory (NUL-separated strings), the part
    of each string that ``part(entry)`` names; the NULs stay, so the layout does too."""
    if not (0 < start < end):
        return
    block = ctypes.string_at(start, end - start)
    offset = 0
    for entry in block.split(b"\0"):
        where = part(entry)
        if where is not None:
            first, stop, _ = where.indices(len(entry))
            ctypes.memset(start + offset + first, ord("*"), stop - first)
        offset += len(entry) + 1


def _block_bounds() -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``((arg_start, arg_end), (env_start, env_end))`` from ``/proc/self/stat``."""
    try:
        with open("/proc/self/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces

    def field(number: int) -> int:
        return int(fields[number - 3])  # the list starts at field 3 (the state)

    try:
        args = (field(_STAT_ARG_START), field(_STAT_ARG_START + 1))
        env = (field(_STAT_ENV_START), field(_STAT_ENV_START + 1))
    except (IndexError, ValueError):
        return None
    return args, env
