"""``run_as``: a program agent started as an unprivileged user (the runner runs as root here,
as in CI), its scratch directory its own and removed afterwards; the checks made when the
program is built; the runner's warning when its programs would run as root."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.runner.program import Program
from agentbolt.runner.program_io import ProgramFailed
from agentbolt.runner.program_reward import read_result
from agentbolt.runner.run_as import remove_scratch, resolve_run_as
from agentbolt.runner.worker import Runner
from agentbolt.schemas import RolloutCreate, RolloutStatus, Task
from agentbolt.server import ServerConfig, ServerThread

NOBODY = 65534
REPO = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def as_root() -> None:
    assert os.geteuid() == 0, "these tests start programs as other users: they run as root (CI does)"


@pytest.fixture
def server(tmp_path):
    with ServerThread(ServerConfig(db=str(tmp_path / "s.db"))) as srv:
        yield srv


@pytest.fixture
def scratch():
    """A folder of scratch directories that nobody may enter (tmp_path's parents are root's)."""
    folder = Path(tempfile.mkdtemp(prefix="agentbolt-runas-"))
    folder.chmod(0o755)
    yield folder
    remove_scratch(folder)


def _serve_one(server, program: Program, data: dict, n: int = 1) -> tuple[object, list]:
    """Serve ``n`` rollouts of ``data`` with one runner: the first rollout and its events."""
    with Client(server.url) as client:
        [ro, *_] = client.enqueue([RolloutCreate(task=Task(data=data), max_attempts=1) for _ in range(n)])
        runner = Runner(program, server.url, max_rollouts=n, poll_wait=0.2)
        asyncio.run(asyncio.wait_for(runner.run(), 60))
        return client.get_rollout(ro.id), client.all_events(ro.id)


def test_a_user_is_named_or_numbered_and_never_root():
    nobody = resolve_run_as("nobody")
    assert (nobody.uid, nobody.gid, nobody.name, nobody.switch) == (NOBODY, NOBODY, "nobody", True)
    assert resolve_run_as(str(NOBODY)) == nobody
    unnamed = resolve_run_as("54321")  # no such user in the passwd file: its group is its uid
    assert (unnamed.uid, unnamed.gid, unnamed.name) == (54321, 54321, None)
    assert resolve_run_as("54321:54322").gid == 54322
    assert resolve_run_as(None) is None
    for root in ("root", "0", "0:0", "65534:0"):
        with pytest.raises(ConfigError, match="is root"):
            resolve_run_as(root)
    with pytest.raises(ConfigError, match="no user named 'no-such-user-37'"):
        resolve_run_as("no-such-user-37")


def test_a_runner_not_root_may_not_switch_users():
    """Checked when the program is built: one line. As its own user, nothing switches."""
    code = (
        "from agentbolt.runner.run_as import resolve_run_as\n"
        "print(resolve_run_as('65534').switch)\n"
        "try:\n    resolve_run_as('daemon')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), *site_packages]), "PATH": os.environ["PATH"]}
    for python in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        try:
            done = subprocess.run(
                [python, "-c", code],
                capture_output=True,
                text=True,
                env=env,
                cwd="/",
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                timeout=60,
            )
        except OSError:
            continue
        break
    else:
        raise AssertionError("no interpreter of this version that nobody can run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False",
        "ConfigError run_as 'daemon': only a runner run as root can start programs as another user "
        "(this one runs as uid 65534:65534); leave run_as out to run them as this user",
    ]


def test_the_program_runs_as_the_user_in_a_scratch_directory_of_its_own(server, scratch):
    script = (
        'id -u; id -G; echo "$HOME $USER"; touch "$HOME/.rc"; mkdir -p d/e; touch d/e/f; chmod 0 d/e d; '
        'echo 1 > "$AGENTBOLT_RESULT_FILE"'
    )
    program = Program(["sh", "-c", script], run_as="nobody", scratch_root=scratch)
    rollout, events = _serve_one(server, program, {"q": 1})
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    [stdout] = [e.data["content"] for e in events if e.type == "message"]
    uid, groups, home_user = stdout.splitlines()
    assert (uid, groups) == (str(NOBODY), str(NOBODY))
    home, user = home_user.split()
    assert user == "nobody" and Path(home).name == "home" and Path(home).parent.parent == scratch
    assert list(scratch.iterdir()) == []  # removed, what the user made unreadable included


def test_a_result_file_that_links_elsewhere_is_not_followed(server, scratch):
    secret = scratch / "root-only"
    secret.write_text('{"reward": 0.75}')
    secret.chmod(0o600)
    script = f'ln -s {secret} "$AGENTBOLT_RESULT_FILE"'
    program = Program(["sh", "-c", script], run_as="nobody", scratch_root=scratch)
    rollout, events = _serve_one(server, program, {"q": 1})
    assert rollout.status == RolloutStatus.FAILED
    assert rollout.error == "the result file (AGENTBOLT_RESULT_FILE) is a symbolic link (never followed)"
    assert "0.75" not in json.dumps([e.data for e in events])


def test_a_result_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    with pytest.raises(ProgramFailed, match="is not a regular file"):
        read_result(fifo)


def test_a_program_the_user_cannot_run_fails_with_the_reason(server, scratch):
    private = Path(tempfile.mkdtemp())  # 0700, root's
    try:
        (private / "prog").write_text("#!/bin/sh\necho 1 > $AGENTBOLT_RESULT_FILE\n")
        (private / "prog").chmod(0o755)
        program = Program([str(private / "prog")], run_as="nobody", scratch_root=scratch)
        rollout, _ = _serve_one(server, program, {"q": 1})
    finally:
        remove_scratch(private)
    assert rollout.status == RolloutStatus.FAILED
    assert "as uid 65534 (run_as: it must be able to read and run it): Permission denied" in (
        rollout.error or ""
    )


def test_a_root_runner_of_unsandboxed_programs_warns_once(server, scratch, caplog):
    caplog.set_level(logging.WARNING, "agentbolt.runner")
    _serve_one(server, Program("true", reward_later=True, scratch_root=scratch), {"q": 1}, n=2)
    _serve_one(server, Program("true", reward_later=True, run_as="nobody", scratch_root=scratch), {"q": 2})
    said = [r.getMessage() for r in caplog.records if "run as root" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "program agents run as root, unsandboxed: a program can read this runner's memory and "
        "environment (its token); use --sandbox or --run-as USER (e.g. nobody)"
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"}
    argv = [sys.executable, "-m", "agentbolt", "runner", "--server", "http://127.0.0.1:9", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--command", "true", "--run-as", "no-such-user-37"],
            "error: run_as: no user named 'no-such-user-37'",
        ),
        (["--command", "true", "--run-as", "root"], "error: run_as 'root' is root (uid or gid 0)"),
        (["--agent", "m:f", "--run-as", "nobody"], "error: --run-as is for programs this runner starts"),
        (
            ["--command", "true", "--run-as", "nobody", "--sandbox"],
            "error: run_as (--run-as) is for programs run without the sandbox",
        ),
    ],
)
def test_the_runner_command_refuses_a_bad_run_as_in_one_line(args, said):
    done = _cli(*args)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(said), done.stderr
