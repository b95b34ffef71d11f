"""Resource limits of one program run, and the failure kind that names the one it went over.

Memory and processes are limited through a cgroup made for each run under the runner's own
(cgroup v1's ``memory`` and ``pids`` controllers, or v2's where they can be delegated): the
child joins it before it executes anything, so what it starts is counted too, and the cgroup is
emptied and removed when the run ends. Where no cgroup is writable, both fall back to rlimits
of the child (``RLIMIT_DATA``; ``RLIMIT_NPROC``, which counts every process of the user, not of
the run). CPU seconds (per process), file size and open files are always rlimits. Never
``RLIMIT_AS``: Node.js reserves far more address space than it uses (its ``fetch`` reserves
WebAssembly memory) and fails to start under any useful address-space limit.

Going over a limit fails the attempt with a kind naming it: ``MemoryLimit`` (the kernel killed a
process of the run for memory), ``ProcessLimit`` (a fork failed at the limit: the run is ended
at once, so a fork bomb stops there), ``CpuLimit`` (SIGXCPU), ``FileSizeLimit`` (SIGXFSZ, or
an exit with a file in the scratch directory at the limit: Python ignores SIGXFSZ and sees the
write fail). Open files have no kind of their own: the program's ``open`` fails (EMFILE).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import itertools
import logging
import math
import os
import re
import resource
import signal
import stat
import threading
import time
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.program_io import ProgramFailed

__all__ = ["SANDBOX_LIMITS", "Limits", "Rlimit", "RunLimits", "parse_size", "rlimits"]

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.2
"""Seconds between two looks at a running program's cgroup for a limit it reached."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_counter = itertools.count()


def parse_size(value: int | str | None, what: str) -> int | None:
    """Bytes from ``2G``, ``512M``, ``64k`` (powers of 1024; ``B``/``iB`` optional) or a number;
    None stays None (the default), 0 is no limit."""
    if value is None or isinstance(value, int):
        number: float | None = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", value, re.I)
        if m is None:
            raise ConfigError(f"{what}: expected a size such as 2G, 512M or a number of bytes, not {value!r}")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if number is not None and number < 0:
        raise ConfigError(f"{what} must not be negative, not {value!r}")
    return None if number is None else int(number)


@dataclass(frozen=True)
class Limits:
    """Per-run limits; None: none. ``processes`` counts processes and threads."""

    memory: int | None = None
    processes: int | None = None
    cpu_s: float | None = None
    file_size: int | None = None
    open_files: int | None = None

    @classmethod
    def of(
        cls,
        defaults: Limits,
        memory: int | str | None,
        processes: int | None,
        cpu_s: float | None,
        file_size: int | str | None,
        open_files: int | None,
    ) -> Limits:
        """The limits given, each None one from ``defaults``; 0 is no limit."""
        for name, value in (
            ("limit_processes", processes),
            ("limit_cpu_s", cpu_s),
            ("limit_open_files", open_files),
        ):
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, not {value}")
        return cls(
            memory=_pick(parse_size(memory, "limit_memory"), defaults.memory),
            processes=_pick(processes, defaults.processes),
            cpu_s=_pick(cpu_s, defaults.cpu_s),
            file_size=_pick(parse_size(file_size, "limit_file_size"), defaults.file_size),
            open_files=_pick(open_files, defaults.open_files),
        )

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


def _pick(given: Any, default: Any) -> Any:
    """A limit given (0: none), else the default."""
    return default if given is None else (given or None)


SANDBOX_LIMITS = Limits(memory=4 << 30, processes=512, cpu_s=3600, file_size=1 << 30, open_files=4096)
"""The limits of a sandboxed program unless given: room for a Node.js or Python agent and the
tools it runs, not for a fork bomb or a disk filled."""


# ---------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class _Controller:
    """Where one controller (memory or pids) can make cgroups: ``parent``, in hierarchy
    ``version`` 1 or 2."""

    name: str
    parent: Path
    version: int

    @property
    def join_file(self) -> str:
        """What a process writes ``0`` to, to move itself in. v1's ``tasks`` (this thread) takes
        no global lock for it, where ``cgroup.procs`` (the whole process) waits for an RCU grace
        period: milliseconds per run, more on a loaded machine."""
        return "tasks" if self.version == 1 else "cgroup.procs"

    @property
    def limit_file(self) -> str:
        if self.name == "pids":
            return "pids.max"
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    def make(self, name: str, value: int) -> Path:
        path = self.parent / name
        path.mkdir()
        try:
            (path / self.limit_file).write_text(str(value))
            if self.name == "memory":  # no way around the limit through swap
                swap = "memory.memsw.limit_in_bytes" if self.version == 1 else "memory.swap.max"
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    (path / swap).write_text(str(value) if self.version == 1 else "0")
        except OSError:
            _remove(path)
            raise
        return path

    def breaches(self, path: Path) -> int:
        """How often the kernel killed a process for memory / refused a fork at the limit."""
        events = {"memory": ("memory.oom_control", "memory.events"), "pids": ("pids.events", "pids.events")}
        name, key = events[self.name][self.version - 1], "oom_kill" if self.name == "memory" else "max"
        try:
            text = (path / name).read_text()
        except OSError:
            return 0
        return sum(int(line.split()[1]) for line in text.splitlines() if line.split()[:1] == [key])


_POOL_SIZE = 64
"""Idle cgroups kept per controller and limit: a run takes one made before (a cgroup made and
removed per run costs about a millisecond), the events it counted noted when taken."""
_pool: dict[tuple[_Controller, int], list[Path]] = {}
_pool_lock = threading.Lock()  # runners in several threads of one process share it


def _take(controller: _Controller, value: int) -> Path:
    with _pool_lock:
        free = _pool.get((controller, value))
        if free:
            return free.pop()
        if not _pool:
            atexit.register(_empty_pool)
        _pool.setdefault((controller, value), [])
    return controller.make(f"agentbolt-{os.getpid()}-{next(_counter)}", value)


def _give_back(controller: _Controller, value: int, path: Path, tries: int = 40) -> None:
    """Keep an emptied cgroup for the next run; one whose last processes are still dying is
    looked at again a moment later (off the run's path), and removed if they never go."""
    _kill_members(path)
    try:
        empty = not (path / "cgroup.procs").read_text().strip()
    except OSError:
        return
    if empty:
        with _pool_lock:
            free = _pool.setdefault((controller, value), [])
            if len(free) < _POOL_SIZE:
                free.append(path)
                return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if empty or tries <= 0 or loop is None:
        _remove(path)
    else:
        loop.call_later(0.05, _give_back, controller, value, path, tries - 1)


def _empty_pool() -> None:
    for free in _pool.values():
        for path in free:
            with contextlib.suppress(OSError):
                path.rmdir()
        free.clear()


def _mounts() -> dict[str, tuple[Path, str, int]]:
    """Each controller's (mount point, the mount's root in its hierarchy, version)."""
    found: dict[str, tuple[Path, str, int]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts, kind = left.split(), right.split()
            if len(parts) < 5 or len(kind) < 3:
                continue
            if kind[0] == "cgroup":
                for name in set(kind[2].split(",")) & {"memory", "pids"}:
                    found[name] = (Path(parts[4]), parts[3], 1)
            elif kind[0] == "cgroup2":
                found.setdefault("v2", (Path(parts[4]), parts[3], 2))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``v2``'s."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["v2"]:
                own[name] = path
    return own


def _candidates(name: str) -> list[_Controller]:
    mounts, own = _mounts(), _own_cgroups()
    out = []
    for key in (name, "v2"):
        if key in mounts and key in own:
            point, root, version = mounts[key]
            relative = os.path.relpath(own[key], root) if own[key].startswith(root) else None
            if relative is not None:
                out.append(_Controller(name, Path(os.path.normpath(point / relative)), version))
    return out


def _usable(controller: _Controller) -> bool:
    """Whether a child cgroup with this controller's limit can be made (and is removed again)."""
    if controller.version == 2:
        enabled = controller.parent / "cgroup.subtree_control"
        try:
            if controller.name not in enabled.read_text().split():
                enabled.write_text(f"+{controller.name}")
        except OSError:
            return False
    size = 1 << 40 if controller.name == "memory" else 4096
    try:
        controller.make(f"agentbolt-probe-{os.getpid()}", size).rmdir()
    except OSError:
        return False
    return True


@cache
def controllers() -> tuple[_Controller, ...]:
    """The controllers this process can make cgroups with (looked for once)."""
    usable = []
    for name in ("memory", "pids"):
        try:
            found = next((c for c in _candidates(name) if _usable(c)), None)
        except OSError:
            found = None
        if found is not None:
            usable.append(found)
    return tuple(usable)


def _remove(path: Path, tries: int = 100) -> None:
    """Remove a cgroup now, or, while the kernel still counts its last processes (or one that
    outlived its group is being killed), a little later."""
    try:
        path.rmdir()
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY or tries <= 0:
            log.warning("cannot remove cgroup %s: %s", path, exc)
            return
    _kill_members(path)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        time.sleep(0.01)
        _remove(path, tries - 1)
        return
    loop.call_later(0.02, _remove, path, tries - 1)


def _kill_members(path: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)


# ---------------------------------------------------------------------- one run


class RunLimits:
    """The limits of one run: its cgroups (made now), how the child is put into them and under
    its rlimits, and the failure kind once it has ended.

    A sandboxed child runs no hook (a hook means ``fork`` rather than ``vfork`` of the whole
    runner, tens of ms): it is started through ``sh``, which moves itself into the cgroups
    (:meth:`join_files`) and sets the :attr:`rlimits` before it executes bubblewrap
    (:mod:`agentbolt.runner.sandbox`). A child run without the sandbox runs :meth:`preexec`."""

    def __init__(self, limits: Limits, scratch: Path, exit_offset: bool) -> None:
        self.limits, self.scratch = limits, scratch
        self.exit_offset = exit_offset
        """The program's exit code holds 128 + the signal that killed it (bubblewrap's)."""
        self.cgroups: list[tuple[_Controller, Path, int]] = []
        """Each cgroup of the run, and its count of breaches when the run took it."""
        self._fds: list[int] = []
        wanted = {"memory": limits.memory, "pids": limits.processes}
        covered = set()
        try:
            for controller in controllers() if any(wanted.values()) else ():
                value = wanted[controller.name]
                if value is not None:
                    path = _take(controller, value)
                    self.cgroups.append((controller, path, controller.breaches(path)))
                    covered.add(controller.name)
            # Opened here, by the runner: a child may move itself in through them after it became
            # another user, and the kernel checks the opener's rights.
            self._fds = [os.open(path, os.O_WRONLY) for path in self.join_files()]
        except OSError as exc:
            self.close()
            raise ProgramFailed("LimitSetup", f"cannot make the run's cgroup: {exc}") from None
        self._rlimits = rlimits(limits, covered)

    def preexec(self) -> None:
        """In the child, before it executes (a program run without the sandbox): join the
        cgroups, set the rlimits."""
        for fd in self._fds:
            os.write(fd, b"0")
        for which, value in self._rlimits:
            resource.setrlimit(which, value)

    @property
    def rlimits(self) -> list[Rlimit]:
        return self._rlimits

    def join_files(self) -> list[Path]:
        """The files a process writes ``0`` to, to move itself into the run's cgroups."""
        return [path / controller.join_file for controller, path, _ in self.cgroups]

    def spawned(self) -> None:
        """The child is in its cgroups: the runner needs their files no more."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def breached(self) -> str | None:
        """The limit kind a cgroup says the run went over (memory first)."""
        for controller, path, before in self.cgroups:
            if controller.breaches(path) > before:
                return "MemoryLimit" if controller.name == "memory" else "ProcessLimit"
        return None

    async def watch(self) -> str:
        """Return once the run reaches a cgroup limit (never without cgroups)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if self.cgroups and (kind := self.breached()):
                return kind

    def failure(self, code: int | None) -> ProgramFailed | None:
        """The limit the ended run went over, as the failure that names it."""
        kind = self.breached()
        if kind is None and code:
            kind = self._by_exit(code)
        return ProgramFailed(kind, self._words(kind)) if kind else None

    def close(self) -> None:
        """Kill what is left of the run and remove its cgroups."""
        self.spawned()
        wanted = {"memory": self.limits.memory, "pids": self.limits.processes}
        for controller, path, _ in self.cgroups:
            _give_back(controller, wanted[controller.name] or 0, path)
        self.cgroups = []

    def _by_exit(self, code: int) -> str | None:
        sig = code - 128 if self.exit_offset and code > 128 else -code
        if sig == signal.SIGXCPU and self.limits.cpu_s is not None:
            return "CpuLimit"
        if self.limits.file_size is not None and (sig == signal.SIGXFSZ or self._file_at_limit()):
            return "FileSizeLimit"
        return None

    def _file_at_limit(self) -> bool:
        """A file of the scratch directory reached the size limit (the program then failed)."""
        assert self.limits.file_size is not None
        for root, _, files in os.walk(self.scratch):
            for name in files:
                with contextlib.suppress(OSError):
                    info = os.lstat(os.path.join(root, name))
                    if stat.S_ISREG(info.st_mode) and info.st_size >= self.limits.file_size:
                        return True
        return False

    def _words(self, kind: str) -> str:
        limits = self.limits
        if kind == "MemoryLimit":
            return f"the program went over its memory limit ({_size(limits.memory)}): the kernel killed it"
        if kind == "ProcessLimit":
            return f"the program reached its process limit ({limits.processes} processes and threads): it was ended"
        if kind == "CpuLimit":
            return f"the program used up its CPU time ({limits.cpu_s or 0:g} s per process)"
        return f"the program wrote a file up to its size limit ({_size(limits.file_size)})"


Rlimit = tuple[int, tuple[int, int]]
"""An rlimit (``resource.RLIMIT_*``) and its soft and hard values."""


def rlimits(limits: Limits, covered: set[str]) -> list[Rlimit]:
    """The rlimits of a child under ``limits`` where cgroups cover the ``covered`` controllers
    (memory, pids): each never above the runner's own hard limit (which only root may raise)."""
    wanted: list[tuple[int, int | None, int]] = [(resource.RLIMIT_CORE, 0, 0)]  # no core files in scratch
    if limits.cpu_s is not None:
        wanted.append((resource.RLIMIT_CPU, math.ceil(limits.cpu_s), 1))  # SIGXCPU, then SIGKILL 1 s on
    for which, value in (
        (resource.RLIMIT_FSIZE, limits.file_size),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_DATA, limits.memory if "memory" not in covered else None),
        (resource.RLIMIT_NPROC, limits.processes if "pids" not in covered else None),
    ):
        if value is not None:
            wanted.append((which, value, 0))
    out = []
    for which, soft, extra in wanted:
        assert soft is not None
        _, hard = resource.getrlimit(which)
        top = hard if hard != resource.RLIM_INFINITY else soft + extra
        out.append((which, (min(soft, top), min(soft + extra, top))))
    return out


def _size(value: int | None) -> str:
    if value is None:
        return "none"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} bytes"
