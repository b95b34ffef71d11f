""".ci/install-chromium.sh, run with a PATH whose ``apt-get`` (and ``sudo``) are stubs, and with
AGENTBOLT_CHROMIUM pointing into a temporary folder: each branch, without touching the machine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / ".ci" / "install-chromium.sh"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _run(tmp_path: Path, apt_get: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the script with ``apt-get`` replaced by a shell body; returns the result and the
    Chromium path the script was told to look for."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "apt-get", apt_get)
    _stub(bin_dir, "sudo", 'exec "$@"')  # in case the tests run as a user, not root
    chromium = tmp_path / "chromium"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "AGENTBOLT_CHROMIUM": str(chromium),
        "CHROMIUM_STUB": str(chromium),
    }
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return result, chromium


def test_apt_failure_is_one_clear_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    apt_get = (
        '[ "$1" = update ] && { echo "Hit:1 http://deb.debian.org"; exit 0; }\n'
        'echo "Reading package lists..."\necho "E: Unable to locate package chromium" >&2\nexit 100'
    )
    result, chromium = _run(tmp_path, apt_get)
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).splitlines()
    assert lines == [
        f"install-chromium: cannot install Chromium at {chromium}: 'apt-get install chromium' failed "
        "(E: Unable to locate package chromium) (the dashboard tests need it; install it, or set "
        "AGENTBOLT_CHROMIUM to a Chromium binary)"
    ]


def test_a_failed_update_is_named_too(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, 'echo "E: Could not get lock /var/lib/apt/lists/lock" >&2\nexit 100')
    assert result.returncode == 1
    assert "'apt-get update' failed (E: Could not get lock" in result.stderr
    assert result.stdout == ""


def test_apt_success_that_leaves_no_binary_fails(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, "exit 0")
    assert result.returncode == 1
    assert "installed the chromium package but" in result.stderr


def test_apt_installs_it(tmp_path: Path) -> None:
    apt_get = '[ "$1" = install ] && { printf "#!/bin/sh\\n" > "$CHROMIUM_STUB"; chmod +x "$CHROMIUM_STUB"; }\nexit 0'
    result, chromium = _run(tmp_path, apt_get)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"install-chromium: installed {chromium}\n"


def test_present_binary_needs_no_apt(tmp_path: Path) -> None:
    chromium = tmp_path / "chromium"
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    result, _ = _run(tmp_path, 'echo "apt-get must not run" >&2\nexit 1')
    assert result.returncode == 0 and result.stdout == f"install-chromium: {chromium} is present\n"


def test_default_path_is_debians() -> None:
    assert 'CHROMIUM="${AGENTBOLT_CHROMIUM:-/usr/bin/chromium}"' in SCRIPT.read_text()
