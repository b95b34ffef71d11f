"""Issue 37, "programs run sandboxed": a hostile program agent under ``agentbolt runner --sandbox``
(started as the docs say, its token in ``AGENTBOLT_TOKEN``) against a server with tokens. Each
probe (tests/security/sandbox_probe.py) tries one thing; each test asserts it was refused or
contained, with the failure kind naming the limit where one applies, and that the runner then
served the next rollout. The limits are low (256 MB, 32 processes, 10 MB files, 1 CPU second),
so a containment that failed could not exhaust the machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentbolt.client import Client
from agentbolt.runner.limits import Limits, controllers, rlimits
from agentbolt.runner.program import Program
from agentbolt.runner.sandbox import NOBODY, _refusal
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread
from tests.conftest import need

ADMIN, RUNNER = "adm-token-sandbox-1", "run-token-sandbox-2"
REPO = Path(__file__).parents[2]
PROBE = Path(__file__).with_name("sandbox_probe.py")
PYTHON = "/usr/bin/python3"  # the system's: a root runner's program runs as nobody, who must read it
NODE_AGENT = REPO / "examples" / "node_agent"
# a fork bomb's processes each hold a few MB of their own (the pages Python writes after a fork):
# under load its 32 went over 64 MB before the process limit once; 256 MB leaves them room
LOW = ["--limit-memory", "256M", "--limit-processes", "32", "--limit-file-size", "10M", "--limit-cpu-s", "1"]
DOCUMENTED = {
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_MODEL",
    "AGENTBOLT_MODEL",
    "AGENTBOLT_TASK_FILE",
    "AGENTBOLT_TASK_ID",
    "AGENTBOLT_ROLLOUT_ID",
    "AGENTBOLT_ATTEMPT_ID",
    "AGENTBOLT_EVENTS_URL",
    "AGENTBOLT_RESULT_FILE",
    "AGENTBOLT_LLM_LLM_BASE_URL",  # the LLM resource named llm, as a role (docs/agents.md)
    "AGENTBOLT_LLM_LLM_MODEL",
    "HOME",
    "TMPDIR",
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "PWD",  # bubblewrap's, for the working directory it starts the program in
}


def _need_sandbox() -> None:
    need(shutil.which("bwrap") is not None, "bubblewrap: apt-get install bubblewrap")
    need(os.path.exists(PYTHON), f"the system's Python at {PYTHON}")


@dataclass
class Served:
    """A server with tokens, an admin client, and a sandboxing runner started from the CLI."""

    url: str
    admin: Client
    runner: subprocess.Popen[str]
    token_file: Path
    outside: Path
    uid: int
    """The runner's uid: 0, or nobody's."""

    def run(self, probe: str, **fields: Any) -> tuple[Any, dict[str, Any] | None, list[str]]:
        """Run one probe: its rollout, what it printed (None if it printed nothing), and the
        kinds of the failures recorded."""
        return self.finish(self.start(probe, **fields))

    def start(self, probe: str, **fields: Any) -> str:
        data = {
            "probe": probe,
            "runner_pid": self.runner.pid,
            "token_file": str(self.token_file),
            "runner_home": str(Path.home()),
            "outside": str(self.outside),
            **fields,
        }
        [rollout] = self.admin.enqueue([RolloutCreate(task=Task(data=data))])
        return rollout.id

    def finish(self, rollout_id: str) -> tuple[Any, dict[str, Any] | None, list[str]]:
        done = self.admin.wait([rollout_id], 40)
        assert done.done, (
            f"the runner did not finish the rollout (runner alive: {self.runner.poll() is None})"
        )
        [rollout] = done.rollouts
        events = self.admin.all_events(rollout_id)
        stdout = [e.data["content"] for e in events if e.type == "message" and e.data["role"] == "stdout"]
        found = json.loads(stdout[0])["found"] if stdout else None
        kinds = [e.data["type"] for e in events if e.type == "exception"]
        return rollout, found, kinds

    def serves_the_next_rollout(self) -> None:
        rollout, found, kinds = self.run("ok")
        assert rollout.status == RolloutStatus.SUCCEEDED, (rollout.error, kinds)
        assert found == {"ok": True} and rollout.reward == 1.0


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def served(request, tmp_path_factory, upstream) -> Iterator[Served]:
    """The runner as root (as CI runs it), or as nobody in a cgroup delegated to it (as a
    systemd service with ``Delegate=yes`` runs)."""
    _need_sandbox()
    tmp = tmp_path_factory.mktemp("sandbox")
    token_file = tmp / "runner-token"
    token_file.write_text(RUNNER)
    config = ServerConfig(db=str(tmp / "store.db"), tokens={ADMIN: Role.ADMIN, RUNNER: Role.RUNNER})
    with (
        ServerThread(config) as server,
        Client(server.url, ADMIN) as admin,
        (tmp / "runner.log").open("w") as log,
    ):
        admin.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
        argv = ["-m", "agentbolt", "runner", "--sandbox", "--command", f"{PYTHON} {PROBE}"]
        argv += [*LOW, "--concurrency", "2", "--timeout", "30", "--server", server.url]
        env = {**os.environ, "AGENTBOLT_TOKEN": RUNNER, "PYTHONPATH": str(REPO)}
        with _delegated_cgroups() if request.param == "unprivileged" else contextlib.nullcontext() as start:
            if start is None:
                runner = subprocess.Popen(
                    [sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            else:
                env |= {"HOME": "/tmp", "PYTHONPATH": f"{REPO}:{_site_packages()}"}
                runner = subprocess.Popen(
                    [*start, PYTHON, *argv], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            try:
                uid = 0 if start is None else NOBODY
                yield Served(server.url, admin, runner, token_file, tmp / "written-from-the-sandbox", uid)
            finally:
                runner.send_signal(signal.SIGINT)
                try:
                    runner.wait(20)
                except subprocess.TimeoutExpired:
                    runner.kill()
                    runner.wait()


@contextlib.contextmanager
def _delegated_cgroups() -> Iterator[list[str]]:
    """Memory and pids cgroups owned by nobody, and the command that starts a process in them
    as nobody (the system's Python, which nobody can read; the packages come from PYTHONPATH)."""
    need(os.geteuid() == 0, "root, to delegate cgroups to nobody")
    made = [c.parent / f"agentbolt-test-{os.getpid()}" for c in controllers()]
    assert len(made) == 2, "this machine has writable memory and pids controllers"
    for path in made:
        path.mkdir()
        for item in [path, *path.iterdir()]:
            os.chown(item, NOBODY, NOBODY)
    join = " && ".join(f"echo $$ > {path}/cgroup.procs" for path in made)
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    try:
        yield ["sh", "-c", f'{join} && exec "$@"', "sh", *drop]
    finally:
        for path in made:
            for child in sorted(path.glob("agentbolt-*"), reverse=True):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                path.rmdir()


def _site_packages() -> str:
    import pydantic

    return str(Path(pydantic.__file__).parents[1])


def _no_token(found: Any) -> None:
    assert RUNNER not in json.dumps(found)


# ---------------------------------------------------------------------- credentials


def test_the_environment_holds_only_the_documented_variables(served: Served) -> None:
    rollout, found, _ = served.run("credentials")
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    assert found is not None
    _no_token(found["environ"])
    assert set(found["environ"]) <= DOCUMENTED, set(found["environ"]) - DOCUMENTED
    assert found["environ"]["HOME"] == os.path.dirname(found["environ"]["AGENTBOLT_TASK_FILE"])
    assert found["environ"]["OPENAI_API_KEY"].startswith("ak_")  # the attempt's key, not the runner's
    status = Path(f"/proc/{served.runner.pid}/status").read_text()
    assert re.search(r"^Uid:\s+(\d+)", status, re.M).group(1) == str(served.uid)  # type: ignore[union-attr]
    served.serves_the_next_rollout()


@pytest.mark.parametrize("name", ["environ", "cmdline", "mem"])
def test_the_runners_proc_files_are_out_of_sight(served: Served, name: str) -> None:
    """/proc/PPID is the sandbox's own init (which holds nothing of the runner's), and the
    runner's pid names no process: the sandbox has its own PID namespace."""
    rollout, found, _ = served.run("credentials")
    assert found is not None and rollout.status == RolloutStatus.SUCCEEDED
    _no_token(found)
    assert found["pids"]["parent"] == 1  # bubblewrap's init in the sandbox's PID namespace
    assert str(served.runner.pid) not in found["proc"]
    assert found[f"runner/{name}"] == {"refused": "FileNotFoundError", "errno": 2}
    served.serves_the_next_rollout()


def test_no_token_file_and_no_home_is_visible(served: Served) -> None:
    rollout, found, _ = served.run("credentials")
    assert found is not None and rollout.status == RolloutStatus.SUCCEEDED
    assert found["token_file"] == {"refused": "FileNotFoundError", "errno": 2}
    for home, seen in found["home"].items():
        assert "refused" in seen, (home, seen)
    served.serves_the_next_rollout()


# ---------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("probe", "kind"),
    [
        ("fork_bomb", "ProcessLimit"),
        ("memory_hog", "MemoryLimit"),
        ("giant_file", "FileSizeLimit"),
        ("cpu_spin", "CpuLimit"),
    ],
)
def test_a_run_over_a_limit_fails_with_the_limits_kind(served: Served, probe: str, kind: str) -> None:
    started = time.monotonic()
    rollout, found, kinds = served.run(probe)
    assert rollout.status == RolloutStatus.FAILED
    assert kinds == [kind], (kinds, rollout.error)
    assert found is None  # it never got to report
    assert time.monotonic() - started < 20  # ended by its limit, not by the 30 s timeout
    _nothing_left_running(served.runner.pid)
    served.serves_the_next_rollout()


def _nothing_left_running(runner_pid: int) -> None:
    """No process of the run is left: the runner's cgroups that remain (kept for the next runs;
    one still emptying when the run ended is removed a moment later) are empty. (That the limits
    were cgroups shows in the kinds: only a cgroup says MemoryLimit or ProcessLimit.)"""
    cgroups = [
        p for root in Path("/sys/fs/cgroup").glob("*") for p in root.rglob(f"agentbolt-{runner_pid}-*")
    ]
    deadline = time.monotonic() + 5
    while (left := [p for p in cgroups if _holds_processes(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left


def _holds_processes(cgroup: Path) -> bool:
    try:
        return bool((cgroup / "cgroup.procs").read_text().strip())
    except FileNotFoundError:  # removed
        return False


def test_the_default_limits_leave_address_space_alone(served: Served) -> None:
    """The rlimits a sandboxed run has: those given, the default open files, and never an
    address-space limit (Node.js would not start)."""
    rollout, found, _ = served.run("limits")
    assert rollout.status == RolloutStatus.SUCCEEDED, rollout.error
    assert found is not None
    limits = {line[:26].strip(): line[26:].split()[:2] for line in found["limits"].splitlines()[1:]}
    assert limits["Max address space"] == ["unlimited", "unlimited"]
    assert limits["Max file size"] == [str(10 << 20)] * 2
    assert limits["Max cpu time"] == ["1", "2"]
    assert limits["Max open files"] == ["4096", "4096"]
    assert limits["Max core file size"] == ["0", "0"]
    assert found["uid"] == [NOBODY] * 4


def test_rlimits_stand_in_for_memory_and_processes_without_a_cgroup() -> None:
    chosen = dict(rlimits(Limits(memory=64 << 20, processes=32), covered=set()))
    import resource

    assert chosen[resource.RLIMIT_DATA] == (64 << 20, 64 << 20)
    assert chosen[resource.RLIMIT_NPROC] == (32, 32)
    assert resource.RLIMIT_AS not in chosen
    covered = dict(rlimits(Limits(memory=64 << 20, processes=32), covered={"memory", "pids"}))
    assert resource.RLIMIT_DATA not in covered and resource.RLIMIT_NPROC not in covered


# ---------------------------------------------------------------------- the file system


def test_writes_outside_the_scratch_directory_fail(served: Served) -> None:
    before = PROBE.read_bytes()
    rollout, found, _ = served.run("write_outside")
    assert rollout.status == RolloutStatus.SUCCEEDED and found is not None
    for path, outcome in found.items():
        assert "refused" in outcome, (path, outcome)
    assert PROBE.read_bytes() == before
    assert not served.outside.exists()
    assert not Path("/usr/agentbolt-probe").exists() and not Path("/etc/agentbolt-probe").exists()
    served.serves_the_next_rollout()


def test_another_rollouts_scratch_directory_is_out_of_reach(served: Served) -> None:
    """Two rollouts at once: one keeps a secret in its scratch directory; the other, told the
    exact path, cannot read it, nor list the folder both directories lie in."""
    secret = f"secret-{os.getpid()}-{time.time()}"
    holder = served.start("hold", secret=secret)
    scratch = _scratch_holding(secret)
    if os.geteuid() == 0:  # a root runner's programs (and their bubblewrap) are nobody outside too
        assert _uids_of_probes(served.runner.pid) == {NOBODY}
    rollout, found, _ = served.run("snoop", other_scratch=str(scratch))
    assert rollout.status == RolloutStatus.SUCCEEDED and found is not None
    assert found["other"] == {"refused": "FileNotFoundError", "errno": 2}
    listed = found["listed"]["got"]
    # its own directory only, beside what the sandbox binds read-only for the interpreter when
    # the checkout or the virtualenv lies in the scratch root too (a clone under /tmp)
    root = scratch.parent
    bound = {Path(p).relative_to(root).parts[0] for p in (sys.prefix, REPO) if Path(p).is_relative_to(root)}
    own = [name for name in listed if name not in bound]
    assert scratch.name not in listed and len(own) == 1 and own[0].startswith("agentbolt-"), listed
    (scratch / "work" / "release").write_text("")  # the holder may end now
    held, found, _ = served.finish(holder)
    assert held.status == RolloutStatus.SUCCEEDED and found == {"scratch": str(scratch)}
    assert not scratch.exists()  # removed once the run ended
    served.serves_the_next_rollout()


def _scratch_holding(secret: str) -> Path:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for path in Path("/tmp").glob("agentbolt-*/work/secret.txt"):
            try:
                if path.read_text() == secret:
                    return path.parents[1]
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError("the holding rollout never wrote its secret")


def _uids_of_probes(runner_pid: int) -> set[int]:
    """The real uids, seen from outside, of the processes running the probe (bubblewrap's
    included) under this test's runner, the runner left out (other tests on other workers run
    probes too)."""
    parents: dict[int, int] = {}
    uids: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            cmdline = (status.parent / "cmdline").read_bytes()
            text = status.read_text()
            pid = int(status.parent.name)
            parents[pid] = int(re.search(r"^PPid:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
            if PROBE.name.encode() in cmdline and pid != runner_pid:
                uids[pid] = int(re.search(r"^Uid:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError, ValueError):
            continue
    return {uid for pid, uid in uids.items() if _descends_from(pid, runner_pid, parents)}


def _descends_from(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    seen = set()
    while pid in parents and pid not in seen:
        seen.add(pid)
        pid = parents[pid]
        if pid == ancestor:
            return True
    return False


# ---------------------------------------------------------------------- programs that must work


def test_the_node_example_runs_sandboxed_with_the_default_limits(tmp_path: Path, upstream) -> None:
    """The Node.js agent on the npm ``openai`` package (its ``fetch`` reserves WebAssembly
    memory, which an address-space limit would refuse) calls the gateway and posts its reward."""
    _need_sandbox()
    need(shutil.which("node") is not None, "node is not installed")
    need(
        (NODE_AGENT / "node_modules" / "openai" / "package.json").exists(),
        "the openai npm package: npm ci --prefix examples/node_agent",
    )
    program = Program(["node", str(NODE_AGENT / "agent.mjs")], sandbox=True, sandbox_read=[str(NODE_AGENT)])
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server, Client(server.url) as client:
        client.publish_resources({"llm": LLM(base_url=upstream.base_url, model="double")})
        [rollout] = client.enqueue([RolloutCreate(task=Task(data={"question": "6*7?", "answer": "42"}))])
        runner = Runner(program, server.url, max_rollouts=1, flush_interval=0.1)
        asyncio.run(asyncio.wait_for(runner.run(), 60))
        [done] = client.wait([rollout.id], 10).rollouts
        events = client.all_events(rollout.id)
    assert done.status == RolloutStatus.SUCCEEDED, (
        done.error,
        [e.data for e in events if e.type == "message"],
    )
    assert [e.data["name"] for e in events if e.type == "reward" and "name" in e.data] == ["program"]
    assert [e for e in events if e.type == "llm_call"]  # through the gateway, from inside the sandbox


def test_without_bubblewrap_the_runner_says_which_package_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(REPO)}  # no bwrap on this PATH
    argv = [sys.executable, "-m", "agentbolt", "runner", "--sandbox", "--command", "true"]
    done = subprocess.run(
        [*argv, "--server", "http://127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    message = " ".join(done.stderr.split())
    assert message.startswith("error: --sandbox needs bubblewrap") and "apt-get install bubblewrap" in message


def test_refused_user_namespaces_name_the_setting() -> None:
    said = _refusal(
        "bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
        "non-privileged user namespaces.\n"
    )
    assert "kernel.unprivileged_userns_clone" in said and "user.max_user_namespaces" in said
    assert "\n" not in said


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--kubernetes", "job.yaml", "--command", "true"], "each rollout's pod is its sandbox"),
        (["--agent", "x:y"], "apply to a program (--command), not to --agent"),
    ],
)
def test_the_sandbox_flags_are_refused_where_they_cannot_apply(extra: list[str], said: str) -> None:
    argv = [sys.executable, "-m", "agentbolt", "runner", "--sandbox", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert said in " ".join(done.stderr.split())


def test_the_limits_and_paths_given_are_checked() -> None:
    from agentbolt.errors import ConfigError

    program = Program(["true"], sandbox=True, limit_memory="64M", limit_file_size="1.5k", limit_processes=0)
    assert program.runtime.limits == Limits(
        memory=64 << 20, processes=None, cpu_s=3600, file_size=1536, open_files=4096
    )
    assert not Program(["true"]).runtime.limits.any  # without the sandbox: none unless given
    for bad in (
        {"limit_memory": "lots"},
        {"limit_cpu_s": -1},
        {"sandbox_read": ["relative/path"]},
        {"sandbox_read": ["/{field}"]},
    ):
        with pytest.raises(ConfigError):
            Program(["true"], sandbox=True, **bad)
    with pytest.raises(ConfigError, match="give --sandbox too"):
        Program(["true"], sandbox_read=["/usr"])


def test_limits_apply_without_the_sandbox_too(tmp_path: Path) -> None:
    """A limit given to an unsandboxed program: its cgroup and rlimits are set by a hook in the
    child before it executes."""
    program = Program([PYTHON, str(PROBE)], limit_file_size="1M", limit_memory="256M")
    with ServerThread(ServerConfig(db=str(tmp_path / "store.db"))) as server, Client(server.url) as client:
        ids = [
            r.id
            for r in client.enqueue(
                [RolloutCreate(task=Task(data={"probe": p})) for p in ("giant_file", "ok")]
            )
        ]
        asyncio.run(
            asyncio.wait_for(Runner(program, server.url, max_rollouts=2, flush_interval=0.1).run(), 60)
        )
        giant, ok = client.wait(ids, 10).rollouts
        kinds = [e.data["type"] for e in client.all_events(giant.id) if e.type == "exception"]
    assert giant.status == RolloutStatus.FAILED and kinds == ["FileSizeLimit"], giant.error
    assert "1 MiB" in (giant.error or "")
    assert ok.status == RolloutStatus.SUCCEEDED
