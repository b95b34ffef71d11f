"""What ``agentbolt server`` checks before it binds: a server reachable from other machines
without a token lets anyone write rewards and read every rollout, so it refuses unless told
``--insecure``; and ``--token-file`` gives a container a token without one in its command line.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from agentbolt.errors import ConfigError

__all__ = ["exposure_problem", "is_loopback", "token_from_file"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to anything


def exposure_problem(host: str, has_token: bool, insecure: bool) -> str | None:
    """The one line refusing to serve ``host`` without a token; None when it may."""
    if has_token or insecure or is_loopback(host):
        return None
    return (
        f"refusing to serve {host} without a token: anyone who reaches it could write rewards "
        "and read every rollout; give --token (or AGENTBOLT_TOKEN, or --token-file), "
        "or --insecure to serve it open"
    )


def token_from_file(path: Path) -> tuple[str, bool]:
    """The admin token kept in ``path``, made (random, readable by its owner only) when the
    file is missing; and whether it was made now."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    else:
        if not text:
            raise ConfigError(f"--token-file {path}: the file is empty (delete it to have a token made)")
        return text, False
    return _make(path), True


def _make(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"--token-file {path}: cannot create it ({exc.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
