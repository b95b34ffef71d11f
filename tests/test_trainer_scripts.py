"""``Trainer(...).fit(agent)`` from every kind of main program, and runner processes that end
with their parent however it ends.

Each test runs a real program in a fresh interpreter (this checkout on its PYTHONPATH): the
Trainer's embedded server on 127.0.0.1 and its runner processes, which run the rollouts. A
runner process that imported the main program again would run its top level again: each
program prints a line there, which must show once.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TASKS = '[{"id": f"t{i}", "x": i, "y": 2 * i if i % 2 else 0} for i in range(4)]'  # rewards 1, 1, 0, 1

USER_MODULE = """
from agentbolt import LitAgent


class Doubler(LitAgent):
    def execute_rollout(self, task):
        return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0
"""

# the README's quick start: an agent class of the script itself, no main guard
IN_SCRIPT_CLASS = f"""
from agentbolt import Evaluate, LitAgent, Trainer

print("top level ran", flush=True)


class Doubler(LitAgent):
    def execute_rollout(self, task):
        return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0


trainer = Trainer(Evaluate(timeout=60), n_runners=2, run_dir="run")
summary = trainer.fit(Doubler(), {TASKS})
print("result", trainer.start_method, summary.count, summary.succeeded, summary.mean_reward)
"""

FROM_USER_MODULE = f"""
from agentbolt import Evaluate, Trainer
from user_agents import Doubler

print("top level ran", flush=True)
trainer = Trainer(Evaluate(timeout=60), n_runners=2, run_dir="run")
summary = trainer.fit(Doubler(), {TASKS})
print("result", trainer.start_method, summary.count, summary.succeeded, summary.mean_reward)
"""

# a @rollout function of the script, with string annotations and a helper and a constant of its own
IN_SCRIPT_FUNCTION = f"""
from __future__ import annotations

from agentbolt import Evaluate, Task, Trainer, rollout

print("top level ran", flush=True)
FACTOR = 2


def expected(x: int) -> int:
    return x * FACTOR


@rollout
def doubler(task: Task) -> float:
    return 1.0 if expected(task.data["x"]) == task.data["y"] else 0.0


trainer = Trainer(Evaluate(timeout=60), n_runners=1, runner_concurrency=2, run_dir="run")
summary = trainer.fit(doubler, {TASKS})
print("result", trainer.start_method, summary.count, summary.succeeded, summary.mean_reward)
"""

# what an IPython kernel does: its own __main__ module, without __file__, in which each cell
# runs, compiled under a file name that does not exist
KERNEL = """
import os
import sys
import types

main = types.ModuleType("__main__")
main.__dict__["__builtins__"] = __builtins__
sys.modules["__main__"] = main
sys.argv = ["/nonexistent/ipykernel_launcher.py", "-f", "/nonexistent/kernel-1.json"]
cells = sys.stdin.read().split("# %% cell\\n")
for number, cell in enumerate(cells):
    exec(compile(cell, f"/tmp/ipykernel_{os.getpid()}/{number}.py", "exec"), main.__dict__)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=240, env=_env()
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _check(stdout: str) -> None:
    lines = stdout.splitlines()
    assert lines.count("top level ran") == 1, stdout  # no runner ran the program again
    assert "result subprocess 4 4 0.75" in lines, stdout  # every rollout ran in a runner process


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "user_agents.py").write_text(USER_MODULE)
    return tmp_path


def test_a_script_without_a_main_guard_with_the_agent_of_a_module_of_its_own(workdir: Path) -> None:
    (workdir / "train.py").write_text(FROM_USER_MODULE)
    _check(_run(["train.py"], workdir))


def test_a_script_without_a_main_guard_with_the_agent_defined_in_it(workdir: Path) -> None:
    (workdir / "train.py").write_text(IN_SCRIPT_CLASS)
    _check(_run(["train.py"], workdir))


def test_a_script_read_from_stdin(workdir: Path) -> None:
    _check(_run(["-"], workdir, stdin=IN_SCRIPT_FUNCTION))


def test_python_dash_c(workdir: Path) -> None:
    _check(_run(["-c", IN_SCRIPT_CLASS], workdir))


def test_a_notebook_kernel(workdir: Path) -> None:
    """A kernel simulated (ipykernel is not a dependency): cells run in a ``__main__`` without
    ``__file__``; the agent is defined in one cell, trained in the next."""
    cells = IN_SCRIPT_FUNCTION.split("trainer = Trainer")
    _check(_run(["-c", KERNEL], workdir, stdin=cells[0] + "# %% cell\ntrainer = Trainer" + cells[1]))


# ---------------------------------------------------------------------------- nothing left behind

SLOW = """
import faulthandler
import os
import signal
import time

from agentbolt import Evaluate, Trainer, rollout

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's report if this ever hangs


@rollout
def slow(task):
    os.write(1, f"runner {os.getpid()}\\n".encode())  # one write: both runners share the pipe
    time.sleep(600)
    return 1.0


Trainer(Evaluate(timeout=600), n_runners=2, run_dir="run", lease_seconds=60).fit(slow, [{"id": "a"}, {"id": "b"}])
"""


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie no one has reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ended(proc: subprocess.Popen[bytes], timeout: float, lines: list[str]) -> int:
    """``proc``'s exit status; past ``timeout`` a failure that shows where each of its threads
    stood (the script dumps them on SIGUSR1) and what it had printed."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        masks = [
            f"{task.name}: "
            + " ".join(
                line.replace("\t", "=")
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Sig")
            )
            for task in Path(f"/proc/{proc.pid}/task").iterdir()
        ]
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        report = [f"still running {timeout:g} s after the signal", *masks, *lines]
        raise AssertionError("\n".join(report)) from None


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``, and theirs."""
    found: set[int] = set()
    parents = {pid}
    while parents:
        new: set[int] = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) in parents and int(entry.name) not in found:
                    new.add(int(entry.name))
        found |= new
        parents = new
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_runner_processes_end_with_the_trainer(tmp_path: Path, sig: signal.Signals) -> None:
    """The trainer's process, with both runners in a rollout, gets a signal: it ends by that
    signal, every process it started ends, and nothing holds its stdout open."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SLOW))
    proc = subprocess.Popen(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # a suite started in the background by a non-interactive shell ignores SIGINT, and an
        # ignored signal stays ignored across exec: Python would install no KeyboardInterrupt
        preexec_fn=_default_sigint,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    closed = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            lines.append(line.decode(errors="replace").rstrip())
        closed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while sum(line.startswith("runner ") for line in lines) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines)
            time.sleep(0.1)
        runners = {int(line.split()[1]) for line in lines if line.startswith("runner ")}
        started = _children(proc.pid)
        assert runners <= started, (runners, started)
        proc.send_signal(sig)
        # 60 s: about 3 s when quiet; a loaded 2-core machine once took more than 20 (SIGINT)
        assert _ended(proc, 60, lines) == -sig, "\n".join(lines)
        # the parent is gone: what it started must follow within seconds, and let go of its stdout
        assert closed.wait(10), f"the trainer's stdout is still held open\n{lines}"
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in started if not _gone(pid)] == []
    finally:
        for pid in [proc.pid, *started]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


SERVER_PROCESS = """
import time

from agentbolt.server import ServerConfig, ServerProcess

server = ServerProcess(ServerConfig(db=":memory:")).start()
print("server", server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_process_ends_with_its_parent(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_PROCESS], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pid = 0
    try:
        line = proc.stdout.readline()
        assert line.startswith("server "), line
        pid = int(line.split()[1])
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid)
        # end of file: no child holds the parent's stdout
        assert select.select([proc.stdout], [], [], 5)[0] and proc.stdout.read() == ""
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)
