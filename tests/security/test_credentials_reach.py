"""Issue 37, item 3: the runner's token reaches no program agent by any path. A hostile program
(``programs/reach_probe.py``) run, unsandboxed, by a real ``agentbolt runner`` started as the
docs say (``AGENTBOLT_TOKEN=... agentbolt runner --command ...``) against a server with tokens
tries each path: its own environment, the runner's ``/proc/<pid>/environ``, ``cmdline`` and
``mem``, every process found in ``/proc``, the server's token file. Each probe runs against:

* a root runner with ``--run-as nobody``: the program is another, unprivileged uid with no
  capabilities, so the kernel's ptrace check keeps it out of the runner's ``environ`` and ``mem``
  (a root program would read them whatever ``PR_SET_DUMPABLE`` says);
* a runner run as ``nobody`` itself (an unprivileged runner: no ``--run-as`` needed, the program
  is the same uid): the runner's ``PR_SET_DUMPABLE`` 0 is what keeps the program out.

Each test asserts the token appears nowhere in what the probe reported (its stdout, stored as
the attempt's events) and that the runner then served the next rollout. The first test shows the
probe is not toothless: run as root against a process holding a token, it finds it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbolt.cli.server_guard import token_from_file
from agentbolt.client import Client
from agentbolt.schemas import RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread

# one token per test process: under pytest-xdist another worker's runner, run as nobody too, is
# readable by this probe while it starts (before it makes itself undumpable); its token is its
# own, not the one this test guards
RUNNER = f"run-token-reach-{os.getpid()}"
NOBODY = 65534
REPO = Path(__file__).parents[2]
PROGRAMS = Path(__file__).parent / "programs"
AS_NOBODY: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
"""How a process is started as nobody here: as the runner starts a --run-as program."""
CONFIGS = ["root runner, --run-as nobody", "runner run as nobody"]


def _as_nobody(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd="/", **AS_NOBODY)


def _python_for_nobody(imports: str, env: dict[str, str]) -> str:
    """An interpreter of this Python version that nobody may run and that imports ``imports``
    (this venv's may live under a home only root can enter)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        try:
            if _as_nobody([candidate, "-c", imports], env).returncode == 0:
                return candidate
        except OSError:  # missing, or nobody may not run it
            continue
    raise AssertionError(
        f"no python{version} that the user nobody can run and that imports {imports!r}: "
        "these probes need one (the runner run as nobody imports agentbolt from this checkout)"
    )


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A folder every user may read: the probe and the server's token file live there."""
    if os.geteuid() != 0:
        raise AssertionError("these probes run as root (CI does): they start processes as nobody")
    folder = Path(tempfile.mkdtemp(prefix="agentbolt-reach-"))
    folder.chmod(0o755)
    shutil.copy(PROGRAMS / "reach_probe.py", folder / "reach_probe.py")
    (folder / "reach_probe.py").chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def token_file(shared: Path) -> Path:
    path = shared / "admin.token"
    token_from_file(path)  # as `agentbolt server --token-file` makes it: its owner's only
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, token_file: Path) -> Iterator[Any]:
    admin = token_file.read_text().strip()
    db = tmp_path_factory.mktemp("reach") / "store.db"
    config = ServerConfig(db=str(db), tokens={admin: Role.ADMIN, RUNNER: Role.RUNNER})
    with ServerThread(config) as srv:
        srv.admin = admin
        yield srv


@pytest.fixture(scope="module", params=CONFIGS)
def runner(request, server, shared: Path) -> Iterator[str]:
    """A real ``agentbolt runner`` process serving the probe; yields its configuration's name."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOLT_")}
    env = {**base, "AGENTBOLT_TOKEN": RUNNER, "PYTHONPATH": str(REPO)}
    probe_python = _python_for_nobody("import json", env)
    command = f"{probe_python} {shared / 'reach_probe.py'} {{probe}} {{path}}"
    args = ["-m", "agentbolt", "runner", "--server", server.url, "--command", command]
    as_user: dict[str, Any] = {}
    if request.param == CONFIGS[0]:
        argv = [sys.executable, *args, "--run-as", "nobody"]
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *site.getsitepackages()])
        env["HOME"] = str(shared)
        argv, as_user = [_python_for_nobody("import agentbolt.cli.main", env), *args], AS_NOBODY
    proc = subprocess.Popen(
        argv, env=env, cwd=shared, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **as_user
    )
    try:
        yield request.param
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        assert "Traceback" not in out, out
        assert RUNNER not in out and server.admin not in out


def _run(server, data: dict[str, Any]) -> tuple[Any, str]:
    """Enqueue one rollout, wait for it to end: the rollout, and everything stored about it."""
    with Client(server.url, server.admin) as client:
        [ro] = client.enqueue([RolloutCreate(task=Task(data=data), max_attempts=1)])
        deadline = time.monotonic() + 60
        while not client.wait([ro.id], 10).done:
            assert time.monotonic() < deadline, "the runner served no rollout in 60 s"
        rollout = client.get_rollout(ro.id)
        events = client.all_events(ro.id)
    stored = rollout.model_dump_json() + "".join(e.model_dump_json() for e in events)
    return rollout, stored


def _probe(server, kind: str, token_file: Path) -> dict[str, Any]:
    """Run the probe ``kind``; check that neither token is in anything stored about it and that
    the runner serves the next rollout. What the probe reported."""
    rollout, stored = _run(server, {"probe": kind, "path": str(token_file)})
    assert rollout.status == RolloutStatus.SUCCEEDED, stored
    for secret in (RUNNER, server.admin):
        assert secret not in stored
    with Client(server.url, server.admin) as client:
        messages = [e.data for e in client.all_events(rollout.id) if e.data.get("role") == "stdout"]
    assert len(messages) == 1 and messages[0]["cut_bytes"] == 0, messages  # nothing cut away
    report: dict[str, Any] = json.loads(messages[0]["content"])
    assert report["probe"] == kind
    following, _ = _run(server, {"probe": "noop", "path": ""})
    assert following.status == RolloutStatus.SUCCEEDED
    return report


def test_the_probe_finds_a_token_where_it_is_readable(shared):
    """The control: as root, against a process holding a token in its environment and memory,
    the probe reports it (so its silence in the tests below means something)."""
    secret = "control-secret-0123456789"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; h = 'Bearer ' + {secret!r}; time.sleep(30)"],
        env={"AGENTBOLT_TOKEN": secret, "PATH": os.environ["PATH"]},
    )
    try:
        time.sleep(0.3)
        found = {}
        for kind in ("ppid_environ", "ppid_mem"):
            done = subprocess.run(
                [sys.executable, str(shared / "reach_probe.py"), kind],
                env={**os.environ, "PROBE_TARGET": str(holder.pid), "AGENTBOLT_RESULT_FILE": os.devnull},
                capture_output=True,
                text=True,
                timeout=60,
            )
            found[kind] = json.loads(done.stdout)["found"]
    finally:
        holder.kill()
        holder.wait()
    assert secret in found["ppid_environ"]
    assert secret in found["ppid_mem"]


def test_the_program_runs_as_an_unprivileged_user_without_capabilities(server, runner, token_file):
    status = _probe(server, "caps", token_file)["status"]
    assert status["Uid"].split() == [str(NOBODY)] * 4
    assert status["Gid"].split() == [str(NOBODY)] * 4
    assert status["Groups"] == ""
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapAmb"], 16) == 0


def test_its_own_environment_holds_no_token(server, runner, token_file):
    report = _probe(server, "environ", token_file)
    assert not any("TOKEN" in name for name in report["environ"])
    # what looks like a credential there is its own attempt's agent key, and only that
    assert set(report["found"]) == {report["environ"]["OPENAI_API_KEY"]}


def test_the_runners_proc_environ_is_refused(server, runner, token_file):
    report = _probe(server, "ppid_environ", token_file)
    assert report["read"] == [] and report["found"] == []
    assert report["denied"] == ["environ: PermissionError: Permission denied"]


def test_the_runners_cmdline_holds_no_token(server, runner, token_file):
    report = _probe(server, "ppid_cmdline", token_file)
    assert report["read"] == ["cmdline"] and report["found"] == []  # world-readable, token-free
    assert "runner" in report["cmdline"] and "--command" in report["cmdline"]


def test_the_runners_memory_is_refused(server, runner, token_file):
    report = _probe(server, "ppid_mem", token_file)
    assert report["read"] == [] and report["found"] == []
    assert report["denied"] == ["mem: PermissionError: Permission denied"]


def test_no_process_found_in_proc_gives_the_token_away(server, runner, token_file):
    report = _probe(server, "scan_proc", token_file)
    assert RUNNER not in report["found"] and server.admin not in report["found"]


def test_the_servers_token_file_is_refused(server, runner, token_file):
    report = _probe(server, "token_file", token_file)
    assert report["found"] == []
    assert report["denied"] == ["token file: PermissionError: Permission denied"]


@pytest.fixture
def lone_server(tmp_path, token_file: Path) -> Iterator[Any]:
    """A server of its own: no runner of the probes above claims its rollouts."""
    admin = token_file.read_text().strip()
    config = ServerConfig(db=str(tmp_path / "store.db"), tokens={admin: Role.ADMIN, RUNNER: Role.RUNNER})
    with ServerThread(config) as srv:
        srv.admin = admin
        yield srv


def _runner_once(server, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "agentbolt", "runner", "--server", server.url, *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOLT_")}
    return subprocess.Popen(
        argv,
        env={**base, "PYTHONPATH": str(REPO), "COLUMNS": "300", **env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_an_in_process_agent_finds_no_token_in_the_environment(lone_server):
    """In-process agents share the runner's memory (trusted code); what they must not find
    lying about is the token in ``os.environ`` or in the block ``/proc/self/environ`` shows."""
    proc = _runner_once(
        lone_server,
        "--agent",
        f"{PROGRAMS / 'env_agent.py'}:env_probe",
        "--max-rollouts",
        "2",
        env={"AGENTBOLT_TOKEN": RUNNER, "ALSO_HOLDS_IT": f"Bearer {RUNNER}"},
    )
    try:
        rollout, stored = _run(lone_server, {"probe": "in-process"})
        following, _ = _run(lone_server, {"probe": "in-process"})
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert rollout.status == following.status == RolloutStatus.SUCCEEDED
    assert RUNNER not in stored
    with Client(lone_server.url, lone_server.admin) as client:
        [message] = [e.data for e in client.all_events(rollout.id) if e.type == "message"]
    report = json.loads(message["content"])
    assert "AGENTBOLT_TOKEN" not in report["environ"] and "ALSO_HOLDS_IT" not in report["environ"]
    # the initial block keeps its variables' names; the values are overwritten
    assert "AGENTBOLT_TOKEN=" + "*" * len(RUNNER) in report["block"]
    assert "ALSO_HOLDS_IT=" + "*" * len(f"Bearer {RUNNER}") in report["block"]


def test_a_token_flag_warns_and_leaves_the_command_line(lone_server, shared):
    """``--token`` on the command line: one warning line naming the variable to use, and the
    value overwritten in what ``/proc/<pid>/cmdline`` (``ps``) shows once the runner runs."""
    command = '/bin/sh -c \'tr "\\\\0" " " < /proc/$PPID/cmdline; echo 1 > $AGENTBOLT_RESULT_FILE\''
    proc = _runner_once(
        lone_server,
        "--command",
        command,
        "--run-as",
        "nobody",
        "--token",
        RUNNER,
        "--max-rollouts",
        "1",
        env={},
    )
    try:
        rollout, stored = _run(lone_server, {"probe": "argv"})
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert rollout.status == RolloutStatus.SUCCEEDED, stored
    assert RUNNER not in stored
    assert "--token " + "*" * len(RUNNER) in stored  # what the program saw of the runner's argv
    warnings = [line for line in err.splitlines() if "shows in `ps`" in line]
    assert warnings == [
        "warning: --token on the command line shows in `ps` to every user of this machine; "
        "give it in the environment variable AGENTBOLT_TOKEN instead"
    ]


def test_the_token_from_the_environment_gives_no_warning(lone_server):
    proc = _runner_once(
        lone_server, "--command", "true", "--max-rollouts", "0", env={"AGENTBOLT_TOKEN": RUNNER}
    )
    _, err = proc.communicate(timeout=60)
    assert "shows in `ps`" not in err
