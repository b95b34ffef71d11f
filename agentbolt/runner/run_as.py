"""``run_as``: a program agent run, unsandboxed, as an unprivileged user of the machine.

A runner often runs as root (CI does), and a root child reads any process's ``/proc`` (the
runner's environment, command line and memory, its token included) whatever
``PR_SET_DUMPABLE`` says. A program spawned as another, unprivileged user holds no capabilities
(a non-root uid keeps none across the switch) and no supplementary groups: the kernel's ptrace
check keeps it out of the runner's ``/proc/<pid>/environ`` and ``mem``. The user must be able to
read and run the program's own files; its scratch directory is handed to it, and removed
afterwards whatever it made there.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError

__all__ = ["RunAs", "remove_scratch", "resolve_run_as"]

_NUMERIC = re.compile(r"(\d+)(?::(\d+))?")


@dataclass(frozen=True)
class RunAs:
    """The user a program runs as: its uid, its group, and its name where the machine has one."""

    uid: int
    gid: int
    name: str | None
    switch: bool
    """Whether spawning means a change of user (False: the runner already is this user)."""

    def __str__(self) -> str:
        return self.name or f"{self.uid}:{self.gid}"

    def spawn_options(self) -> dict[str, Any]:
        """``subprocess`` arguments that start the child as this user, its supplementary groups
        dropped (none when no switch is needed)."""
        if not self.switch:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def environment(self, home: Path) -> dict[str, str]:
        """The variables that name the user: its own ``HOME`` (in the scratch directory: the
        runner's home is not its to write), ``USER`` and ``LOGNAME``."""
        if not self.switch:
            return {}
        named = {"USER": self.name, "LOGNAME": self.name} if self.name else {}
        return {"HOME": str(home), **named}

    def hand_over(self, *paths: Path) -> None:
        """Make ``paths`` (the scratch root, the working directory) the user's own."""
        if self.switch:
            for path in paths:
                os.chown(path, self.uid, self.gid)


def resolve_run_as(spec: str | int | None) -> RunAs | None:
    """The user ``spec`` names (a user name, or ``uid[:gid]``), checked now: it exists (a name),
    it is not root, and this process may become it (it runs as root, or already as that user)."""
    if spec is None:
        return None
    text = str(spec).strip()
    match = _NUMERIC.fullmatch(text)
    if match:
        uid = int(match.group(1))
        entry = _by_uid(uid)
        gid = int(match.group(2)) if match.group(2) else (entry.pw_gid if entry else uid)
        name = entry.pw_name if entry else None
    else:
        try:
            entry = pwd.getpwnam(text)
        except KeyError:
            raise ConfigError(
                f"run_as: no user named {text!r} on this machine (a name or uid[:gid])"
            ) from None
        uid, gid, name = entry.pw_uid, entry.pw_gid, entry.pw_name
    if uid == 0 or gid == 0:
        raise ConfigError(
            f"run_as {text!r} is root (uid or gid 0): a program run as root reads the runner's "
            "memory and token; name an unprivileged user, e.g. nobody"
        )
    me = os.geteuid()
    if me != 0 and (me != uid or os.getegid() != gid):
        raise ConfigError(
            f"run_as {text!r}: only a runner run as root can start programs as another user "
            f"(this one runs as uid {me}:{os.getegid()}); leave run_as out to run them as this user"
        )
    return RunAs(uid, gid, name, switch=me == 0)


def _by_uid(uid: int) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        return None


def remove_scratch(root: Path) -> None:
    """Remove a scratch directory and whatever the program left in it, including directories
    it made unreadable or unwritable to their owner (``chmod 0``): each is opened up once and
    its removal retried. Symbolic links are removed, never followed."""
    opened: set[str] = set()

    def open_up(_function: Any, path: str, _exc_info: Any) -> None:
        if path in opened or not os.path.lexists(path):
            return
        opened.add(path)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if is_dir:
                os.chmod(path, stat.S_IRWXU)
        except OSError:
            return
        if is_dir:
            shutil.rmtree(path, onerror=open_up)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    shutil.rmtree(root, onerror=open_up)
    if os.path.lexists(root):  # its contents are gone now that they were opened up
        shutil.rmtree(root, ignore_errors=True)
