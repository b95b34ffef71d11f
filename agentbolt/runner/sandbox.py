"""The sandbox of a program agent: bubblewrap (``bwrap``, the sandbox Flatpak uses) around each run.

Each run gets its own user namespace, as uid and gid 65534 (``nobody``) inside; its own PID
namespace (a fresh ``/proc``: no runner, no other rollout); its own IPC, UTS and cgroup
namespaces; the runner's network (the gateway is on its loopback). It dies with the runner.
When the runner is root, bubblewrap itself starts as ``nobody`` too, so the program holds no
capability and no root-owned file's rights anywhere (its files must then be readable by other
users). Its file system holds only:

* the system's directories read-only (``/usr``, ``/bin``, ``/sbin``, ``/lib*``) and the files
  of ``/etc`` that programs need and that hold no secret (a copy of them,
  :mod:`agentbolt.runner.sandbox_etc`: not ``shadow``, not ``npmrc`` or ``pip.conf``, which
  may hold tokens);
* the program's own files read-only (:func:`program_paths`): each absolute path written in the
  command that names an existing file, the installation its executable lies in, and the paths
  given with ``--sandbox-read``;
* its scratch directory read-write (``work/``, its working directory, ``task.json``,
  ``result.json``), and a private ``/tmp`` in memory; the rest of ``/`` is read-only.

Its environment is cleared: the variables the runner sets for it (docs/agents.md), those of
``--env``, and ``PATH``, ``LANG``, ``LC_*``, ``TZ``, ``TERM``; ``HOME`` is the scratch directory.

What it does not contain (docs/threat-model.md): the kernel itself (a kernel exploit escapes any
namespace), the network (the program reaches what the runner reaches).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.limits import Limits, Rlimit, RunLimits, controllers, rlimits
from agentbolt.runner.program_io import ProgramFailed
from agentbolt.runner.sandbox_etc import etc_copy

__all__ = ["NOBODY", "Launch", "Runtime", "program_paths", "sandbox_environ"]

NOBODY = 65534
"""The uid and gid the program has inside the sandbox (and outside, when the runner is root)."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
KEPT_VARIABLES = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM")
"""The runner's variables a sandboxed program keeps (with ``LC_*``); the rest are cleared."""

INSTALL_MARKERS = ("pyvenv.cfg", "lib")
"""What makes the folder above an executable's ``bin/`` an installation to show whole: a
virtualenv, or a Python or Node.js installation (its ``lib/``)."""

_NAMESPACE_WORDS = ("namespace", "uid map", "setting up uid", "Operation not permitted")
_CHECK_TIMEOUT = 30.0
_JOIN_FAILED = 125
"""The exit code of the ``sh`` that could not join the run's cgroups."""


def sandbox_environ(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """What a sandboxed program keeps of the runner's environment, with its own ``HOME``."""
    kept = {k: v for k, v in environ.items() if k in KEPT_VARIABLES or k.startswith("LC_")}
    return kept | {"HOME": str(home), "TMPDIR": "/tmp"}


def program_paths(argv: Sequence[str], path_variable: str | None) -> list[str]:
    """The program's own files shown read-only: each absolute path in the command that names
    an existing file (a folder only through ``--sandbox-read``: ``ls /`` shows nothing of
    ``/``), and the executable with its installation: the folder above its ``bin/`` when that
    holds ``pyvenv.cfg`` or ``lib/`` (a virtualenv, a Python or Node.js installation), for the
    path as found and for its real path (a virtualenv's interpreter links to its base
    installation). A part holding a ``{field}`` template is not looked at."""
    found: list[str] = []
    literal = [arg for arg in argv if "{" not in arg]
    for arg in literal:
        if os.path.isabs(arg) and os.path.isfile(arg):
            found.append(arg)
    if argv and "{" not in argv[0]:
        executable = shutil.which(argv[0], path=path_variable)
        if executable is not None:
            executable = os.path.abspath(executable)
            for path in dict.fromkeys((executable, os.path.realpath(executable))):
                found.append(_installation(path) or path)
    return [p for p in dict.fromkeys(found) if not _under_system(p)]


def _installation(executable: str) -> str | None:
    folder = os.path.dirname(executable)
    if os.path.basename(folder) != "bin":
        return None
    root = os.path.dirname(folder)
    if root in ("/", "") or root == os.path.expanduser("~"):
        return None
    return root if any(os.path.exists(os.path.join(root, m)) for m in INSTALL_MARKERS) else None


def _under_system(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + "/") for d in ("/usr",))


@dataclass
class Launch:
    """How one run is started: the argv and environment to execute, the keyword arguments of
    the spawn, and its limits (None: none)."""

    argv: list[str]
    env: dict[str, str]
    popen: dict[str, Any] = field(default_factory=dict)
    limits: RunLimits | None = None
    sandboxed: bool = False

    def spawned(self) -> None:
        """The child is started (or could not be)."""
        if self.limits is not None:
            self.limits.spawned()

    def failure(self, code: int | None, stderr: str) -> ProgramFailed | None:
        """Why the ended run failed, where it is not the program's own exit: a limit it went
        over, its cgroups not joined, or bubblewrap unable to start it."""
        found = self.limits.failure(code) if self.limits is not None else None
        line = stderr.splitlines()[0] if stderr else ""
        if found is None and self.sandboxed and code == _JOIN_FAILED and line.startswith("agentbolt: "):
            found = ProgramFailed("LimitSetup", line.removeprefix("agentbolt: "))
        if found is None and self.sandboxed and code == 1 and line.startswith("bwrap: "):
            kind = "CommandNotFound" if line.startswith("bwrap: execvp ") else "SandboxError"
            found = ProgramFailed(kind, f"the sandbox could not start the program: {line}")
        return found

    def close(self) -> None:
        self.spawned()
        if self.limits is not None:
            self.limits.close()


def _starter(joins: list[Path], limits: list[Rlimit]) -> list[str]:
    """What starts bubblewrap: ``sh``, which moves itself into the run's cgroups (``joins``) and
    sets the rlimits with ``ulimit``, or, for the rlimits ``sh`` does not spell alike everywhere
    (processes, data), ``prlimit`` after it."""
    steps = [f'echo 0 > "${i + 1}"' for i in range(len(joins))]
    by_shell = _ulimit(limits)
    if by_shell is not None:
        steps += by_shell
    failed = f"{{ echo 'agentbolt: cannot join the cgroups or set the limits of the run' >&2; exit {_JOIN_FAILED}; }}"
    script = f'{" && ".join(steps) or "true"} || {failed}; shift {len(joins)}; exec "$@"'
    after = [] if by_shell is not None else [_tool("prlimit"), *_prlimit_options(limits), "--"]
    return [_tool("sh"), "-c", script, "sh", *map(str, joins), *after]


_ULIMIT_FLAGS = {
    resource.RLIMIT_CORE: "c",
    resource.RLIMIT_CPU: "t",
    resource.RLIMIT_FSIZE: "f",
    resource.RLIMIT_NOFILE: "n",
}
"""``ulimit``'s flag for each rlimit that dash and bash (as ``sh``) spell alike; ``c`` and ``f``
count 512-byte blocks."""
_PRLIMIT_NAMES = {
    resource.RLIMIT_CORE: "core",
    resource.RLIMIT_CPU: "cpu",
    resource.RLIMIT_FSIZE: "fsize",
    resource.RLIMIT_NOFILE: "nofile",
    resource.RLIMIT_DATA: "data",
    resource.RLIMIT_NPROC: "nproc",
}


def _ulimit(limits: list[Rlimit]) -> list[str] | None:
    """``sh`` commands setting ``limits`` (soft first, then hard), or None where one cannot be."""
    steps = []
    for which, (soft, hard) in limits:
        flag = _ULIMIT_FLAGS.get(which)
        blocks = which in (resource.RLIMIT_CORE, resource.RLIMIT_FSIZE)
        if flag is None or (blocks and (soft % 512 or hard % 512)):
            return None
        scale = 512 if blocks else 1
        steps += [f"ulimit -S -{flag} {soft // scale}", f"ulimit -H -{flag} {hard // scale}"]
    return steps


def _prlimit_options(limits: list[Rlimit]) -> list[str]:
    return [f"--{_PRLIMIT_NAMES[which]}={soft}:{hard}" for which, (soft, hard) in limits]


class Runtime:
    """How a Program's runs are started: plainly, or sandboxed (``command`` is its argv
    template); with ``limits`` or without."""

    def __init__(self, command: Sequence[str], sandbox: bool, read: Sequence[str], limits: Limits) -> None:
        self.command, self.sandbox, self.read, self.limits = tuple(command), sandbox, tuple(read), limits
        for path in self.read:
            if not os.path.isabs(path) or "{" in path:
                raise ConfigError(f"--sandbox-read takes absolute paths (no {{field}}), not {path!r}")
        if self.read and not sandbox:
            raise ConfigError("--sandbox-read names what a sandboxed program sees: give --sandbox too")
        self._args: tuple[list[str], list[str]] | None = None  # bubblewrap's, but /etc's and the run's

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_args": None}  # made again where it runs: paths differ by machine

    @property
    def user(self) -> int | None:
        """The uid bubblewrap starts as when it is not the runner's: nobody, for a root runner."""
        return NOBODY if self.sandbox and os.geteuid() == 0 else None

    def check(self) -> None:
        """Once, before the first run: a sandbox can be made here with the program's files (a
        :class:`ConfigError` naming what is missing: the package or the kernel setting)."""
        if self.limits.memory or self.limits.processes:
            controllers()  # looked for now, not on the first rollout
        if not self.sandbox:
            return
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise ConfigError(
                "--sandbox needs bubblewrap and no bwrap command is on PATH: apt-get install bubblewrap"
            )
        for path in self.read:
            if not os.path.exists(path):
                raise ConfigError(f"--sandbox-read {path}: no such file or folder")
        self._args = None
        if self.user is not None:
            for path in (*self.read, *program_paths(self.command, os.environ.get("PATH"))):
                _reachable(path, self.user)
        chosen = rlimits(self.limits, {c.name for c in controllers()})
        argv = [*_starter([], chosen), *self._prefix(), *self._base(), "--", "true"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CHECK_TIMEOUT)
        if done.returncode != 0:
            raise ConfigError(_refusal(done.stderr))

    def launch(self, argv: list[str], env: dict[str, str], scratch: Path, work: Path) -> Launch:
        """How to start this run, its cgroups made (the caller closes the launch)."""
        if self.sandbox and self.user is not None:
            for path in (scratch, work):
                os.chown(path, self.user, self.user)
        limited = self.limits.any or self.sandbox
        limits = RunLimits(self.limits, scratch, exit_offset=self.sandbox) if limited else None
        if not self.sandbox:
            return Launch(argv, env, {} if limits is None else {"preexec_fn": limits.preexec}, limits)
        assert limits is not None
        wrapped = [*_starter(limits.join_files(), limits.rlimits), *self._prefix(), *self._base()]
        wrapped += [
            "--bind",
            str(scratch),
            str(scratch),
            "--chdir",
            str(work),
            "--remount-ro",
            "/",
            "--",
            *argv,
        ]
        return Launch(wrapped, env, {}, limits, sandboxed=True)

    def _prefix(self) -> list[str]:
        """For a root runner, ``setpriv``: bubblewrap runs as nobody, with no capability and no
        group."""
        if self.user is None:
            return []
        user = str(self.user)
        return [_tool("setpriv"), f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]

    def _base(self) -> list[str]:
        """Bubblewrap and its arguments up to the scratch directory."""
        if self._args is None:
            head = [_tool("bwrap"), "--unshare-all", "--share-net", "--die-with-parent"]
            head += ["--uid", str(NOBODY), "--gid", str(NOBODY)]
            for path in SYSTEM_DIRS:
                if os.path.islink(path):
                    head += ["--symlink", os.readlink(path), path]
                elif os.path.isdir(path):
                    head += ["--ro-bind", path, path]
            tail = ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
            for path in (*program_paths(self.command, os.environ.get("PATH")), *self.read):
                tail += ["--ro-bind", path, path]
            self._args = (head, tail)
        head, tail = self._args
        return [*head, "--ro-bind", etc_copy(), "/etc", *tail]


@functools.cache
def _tool(name: str) -> str:
    """The path of a command the sandbox is started through (looked up once)."""
    found = shutil.which(name)
    if found is None:
        package = {"setpriv": "util-linux", "prlimit": "util-linux"}.get(name)
        raise ConfigError(
            f"--sandbox needs the {name} command on PATH" + (f" ({package})" if package else "")
        )
    return found


def _reachable(path: str, uid: int) -> None:
    """Refuse a path that ``uid`` (not in the owner's group) cannot read: bubblewrap, started as
    that user, could not show it to the program."""
    current = Path(path)
    for folder in [*reversed(current.parents), current]:
        try:
            info = folder.stat()
        except OSError:
            return
        need = stat.S_IXOTH if folder != current or stat.S_ISDIR(info.st_mode) else stat.S_IROTH
        if info.st_uid != uid and not info.st_mode & need:
            raise ConfigError(
                f"--sandbox: the runner is root, so the program runs as nobody (uid {uid}), who cannot "
                f"reach {path} ({folder} is mode {stat.filemode(info.st_mode)}): install it where other "
                "users can read it, or make the folder readable (chmod o+rx)"
            )


def _refusal(stderr: str) -> str:
    """One line saying why bubblewrap could not make a sandbox here."""
    line = next((x for x in stderr.splitlines() if x.strip()), "no reason given").strip()
    if any(word in line for word in _NAMESPACE_WORDS):
        return (
            f"--sandbox: this machine refuses the sandbox's user namespaces ({line}); allow them: "
            "sysctl kernel.unprivileged_userns_clone=1 (Debian), user.max_user_namespaces > 0, "
            "or kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu)"
        )
    return f"--sandbox: bubblewrap cannot make a sandbox here: {line}"
