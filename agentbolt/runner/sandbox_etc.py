"""The sandbox's ``/etc``: a copy of the entries of the host's ``/etc`` that programs need and
that hold no secret, bound in one mount.

One bind per file would cost bubblewrap a mount each (5-7 ms a run for these). The copy is made
when first needed and made again when its sources change (looked at once a minute at most); a
copy a running sandbox may still use is removed only when the runner exits. Only what every
user may read is copied: a folder no other user may enter (``/etc/ssl/private``) is left out.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ETC_FILES", "etc_copy"]

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
time zones, users and groups (no password hashes: those are in ``shadow``). Not ``npmrc``,
``pip.conf``, ``environment`` or ``gitconfig``, which may hold tokens."""

LOOK_EVERY = 60.0
"""Seconds between two looks at whether the sources changed."""

Signature = list[tuple[str, int, int, int]]


@dataclass
class _Current:
    path: str | None = None
    signature: Signature | None = None
    looked: float = 0.0


_lock = threading.Lock()
_made: list[Path] = []
_current = _Current()


def etc_copy(source: Path = Path("/etc")) -> str:
    """The folder to bind as the sandbox's ``/etc``, up to date with ``source``."""
    with _lock:
        now = time.monotonic()
        if _current.path is None or now - _current.looked > LOOK_EVERY:
            _current.looked = now
            signature = _signature(source)
            if _current.path is None or signature != _current.signature:
                _current.path, _current.signature = str(_copy(source)), signature
        return _current.path


def _signature(source: Path) -> Signature:
    """What changes when an entry to copy is changed, added or removed."""
    found = []
    for name in ETC_FILES:
        for root, dirs, files in _walk(source / name):
            for entry in [root, *(os.path.join(root, f) for f in dirs + files)]:
                with contextlib.suppress(OSError):
                    info = os.lstat(entry)
                    found.append((entry, info.st_mtime_ns, info.st_ino, info.st_size))
    return found


def _walk(path: Path) -> list[tuple[str, list[str], list[str]]]:
    if path.is_dir() and not path.is_symlink():
        return list(os.walk(path))
    return [(str(path), [], [])] if os.path.lexists(path) else []


def _copy(source: Path) -> Path:
    target = Path(tempfile.mkdtemp(prefix="agentbolt-etc-"))
    target.chmod(0o755)  # bubblewrap binds it as any user
    if not _made:
        atexit.register(_remove_all)
    _made.append(target)
    for name in ETC_FILES:
        path = source / name
        with contextlib.suppress(OSError):
            if path.is_symlink() and os.path.realpath(path).startswith("/usr/"):
                os.symlink(os.readlink(path), target / name)  # /usr is in the sandbox too
            elif path.is_dir():
                shutil.copytree(path, target / name, symlinks=True, ignore=_private)
            elif _readable(path.stat()):
                shutil.copyfile(path, target / name)
                (target / name).chmod(0o644)
    return target


def _private(folder: str, names: list[str]) -> set[str]:
    """The entries of ``folder`` not every user may read (or enter)."""
    hidden = set()
    for name in names:
        try:
            info = os.lstat(os.path.join(folder, name))
        except OSError:
            hidden.add(name)
            continue
        if not stat.S_ISLNK(info.st_mode) and not _readable(info):
            hidden.add(name)
    return hidden


def _readable(info: os.stat_result) -> bool:
    need = stat.S_IROTH | stat.S_IXOTH if stat.S_ISDIR(info.st_mode) else stat.S_IROTH
    return info.st_mode & need == need


def _remove_all() -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
