"""The sandbox of a program agent: bubblewrap (``bwrap``, the sandbox Flatpak uses) around each run.

Each run gets its own user namespace, as uid and gid 65534 (``nobody``) inside; its own PID
namespace (a fresh ``/proc``: no runner, no other rollout); its own IPC, UTS and cgroup
namespaces; the runner's network (the gateway is on its loopback). It dies with the runner.
When the runner is root, bubblewrap itself starts as ``nobody`` too, so the program holds no
capability and no root-owned file's rights anywhere (its files must then be readable by other
users). Its file system holds only:

* the system's directories read-only (``/usr``, ``/bin``, ``/sbin``, ``/lib*``) and the files
  of ``/etc`` that programs need and that hold no secret (``ETC_FILES``: not ``shadow``, not
  ``npmrc`` or ``pip.conf``, which may hold tokens);
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

import os
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.limits import Limits, RunLimits, controllers
from agentbolt.runner.program_io import ProgramFailed

__all__ = ["NOBODY", "Launch", "Runtime", "program_paths", "sandbox_environ"]

NOBODY = 65534
"""The uid and gid the program has inside the sandbox (and outside, when the runner is root)."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "gai.conf",
    "group",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "locale.alias",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "passwd",
    "pki",
    "protocols",
    "resolv.conf",
    "services",
    "ssl",
    "timezone",
)
"""What a program sees of ``/etc``: name resolution, TLS roots, the dynamic linker's cache,
time zones, users and groups (no password hashes: those are in ``shadow``)."""

KEPT_VARIABLES = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM")
"""The runner's variables a sandboxed program keeps (with ``LC_*``); the rest are cleared."""

INSTALL_MARKERS = ("pyvenv.cfg", "lib")
"""What makes the folder above an executable's ``bin/`` an installation to show whole: a
virtualenv, or a Python or Node.js installation (its ``lib/``)."""

_NAMESPACE_WORDS = ("namespace", "uid map", "setting up uid", "Operation not permitted")
_CHECK_TIMEOUT = 30.0


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
    the spawn (the hook that puts the child under its limits, the user it runs as), and its
    limits (None: none)."""

    argv: list[str]
    env: dict[str, str]
    popen: dict[str, Any] = field(default_factory=dict)
    limits: RunLimits | None = None
    sandboxed: bool = False

    def spawned(self) -> None:
        if self.limits is not None:
            self.limits.spawned()

    def failure(self, code: int | None, stderr: str) -> ProgramFailed | None:
        """Why the ended run failed, where it is not the program's own exit: a limit it went
        over, or bubblewrap unable to start it."""
        found = self.limits.failure(code) if self.limits is not None else None
        if found is None and self.sandboxed and code == 1 and stderr.startswith("bwrap: "):
            line = stderr.splitlines()[0]
            kind = "CommandNotFound" if line.startswith("bwrap: execvp ") else "SandboxError"
            found = ProgramFailed(kind, f"the sandbox could not start the program: {line}")
        return found

    def close(self) -> None:
        if self.limits is not None:
            self.limits.close()


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
        self._args: list[str] | None = None  # bubblewrap's arguments before the scratch directory

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
        done = subprocess.run(
            [*self._base(), "--", "true"],
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT,
            **self._user_popen(),
        )
        if done.returncode != 0:
            raise ConfigError(_refusal(done.stderr))

    def launch(self, argv: list[str], env: dict[str, str], scratch: Path, work: Path) -> Launch:
        """How to start this run, its cgroups made (the caller closes the launch)."""
        limited = self.limits.any or self.sandbox
        limits = RunLimits(self.limits, scratch, exit_offset=self.sandbox) if limited else None
        popen: dict[str, Any] = {} if limits is None else {"preexec_fn": limits.preexec}
        if not self.sandbox:
            return Launch(argv, env, popen, limits)
        if self.user is not None:
            popen |= self._user_popen()
            for path in (scratch, work):
                os.chown(path, self.user, self.user)
        where = [str(scratch)] * 2
        wrapped = [*self._base(), "--bind", *where, "--chdir", str(work), "--remount-ro", "/", "--", *argv]
        return Launch(wrapped, env, popen, limits, sandboxed=True)

    def _user_popen(self) -> dict[str, Any]:
        user = self.user
        return {} if user is None else {"user": user, "group": user, "extra_groups": []}

    def _base(self) -> list[str]:
        """Bubblewrap and its arguments up to the scratch directory (the same for every run)."""
        if self._args is not None:
            return self._args
        args = [
            shutil.which("bwrap") or "bwrap",
            "--unshare-all",
            "--share-net",
            "--die-with-parent",
            "--uid",
            str(NOBODY),
            "--gid",
            str(NOBODY),
        ]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for name in ETC_FILES:
            if os.path.exists(f"/etc/{name}"):
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in (*program_paths(self.command, os.environ.get("PATH")), *self.read):
            args += ["--ro-bind", path, path]
        self._args = args
        return args


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
