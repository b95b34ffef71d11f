"""Program agents: any executable, in any language, trained without changing it.

A :class:`Program` is an agent the :class:`~agentbolt.runner.worker.Runner` runs like any
other. Each rollout runs its command as a child process in a new process group (its own
session), in a scratch working directory, with the attempt's gateway and credential in the
variables every OpenAI-compatible client reads, and the task as a JSON file (and on stdin if
asked). The contract a program sees is written down in docs/agents.md.

The reward comes from the sources ``reward_from`` names (the rewards the program posted to its
events URL, the result file it wrote, the scorer the user gave): by default the scorer alone
when one is given (the program cannot grade itself), else the program's own report. A source
present but not chosen is recorded as a claim beside the reward, never trained on
(:mod:`agentbolt.runner.program_reward`). With no reward, the attempt fails ("no reward") unless
``reward_later``.

Isolation: the runner's token never enters the child's environment (variables named for it, or
holding its value, are dropped); the child holds only the attempt's agent key. The process
group is killed when the program ends, times out or is stopped, so nothing it started outlives
the rollout (a child that starts its own session escapes this, unless sandboxed). With
``run_as``, the program runs as that unprivileged user, its scratch directory its own
(:mod:`agentbolt.runner.run_as`): a program run as root could read the runner's memory. With
``sandbox=True`` each run is a bubblewrap sandbox (:mod:`agentbolt.runner.sandbox`: no runner
to see, no file but the system's and its own, an unprivileged user) under resource limits
(:mod:`agentbolt.runner.limits`); untrusted code runs there. The scratch directory is removed
afterwards, whatever the outcome: what a run leaves for debugging is its recorded output, exit
code and result file, all in the attempt's events.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.agent import LitAgent, RolloutContext
from agentbolt.runner.limits import SANDBOX_LIMITS, Limits
from agentbolt.runner.program_io import (
    OUTPUT_LIMIT,
    CappedOutput,
    ProgramFailed,
    check_template,
    prompt_variables,
    render,
    role_variables,
    secret_free_environ,
)
from agentbolt.runner.program_reward import (
    AttemptAccess,
    ProgramRun,
    Scorer,
    choose_reward,
    reward_sources,
)
from agentbolt.runner.run_as import RunAs, remove_scratch, resolve_run_as
from agentbolt.runner.sandbox import Launch, Runtime, sandbox_environ
from agentbolt.schemas import LLM, EventType, Resources, Task

__all__ = ["AttemptAccess", "Program", "ProgramFailed", "ProgramRun"]

PLACEHOLDER_KEY = "agentbolt"
"""The OPENAI_API_KEY a child gets from a server that mints no agent key (it is not the
runner's token: that one never reaches the child). Such a server's gateway accepts it only
without auth."""

TERM_WAIT = 0.5
"""Seconds a timed-out or stopped program gets between SIGTERM and SIGKILL of its group."""

DRAIN_WAIT = 2.0
"""Seconds to finish reading output after the group is killed (a process that escaped the
group may hold the pipes open: its output is then cut there)."""

STDERR_TAIL = 2000
"""Characters of stderr quoted in the failure message of a program that exited non-zero."""


@dataclass(frozen=True)
class _Paths:
    """A rollout's scratch directory: ``work/`` is the program's working directory; the task
    and the result file lie beside it, so the program's own files cannot collide with them."""

    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def task(self) -> Path:
        return self.root / "task.json"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def home(self) -> Path:
        return self.root / "home"


@dataclass
class _Exit:
    """How the program ended, and what it printed."""

    code: int | None
    timed_out: bool
    stdout: CappedOutput
    stderr: CappedOutput
    seconds: float
    failure: ProgramFailed | None = None
    """A limit the run went over, or a sandbox that could not start it."""


class Program(LitAgent):
    """Run ``command`` (an argv template: a list, or a string split like a shell would, with
    ``{field}`` replaced by the task's fields; no shell runs it) as each rollout's agent.

    * ``stdin``: also write the task as JSON to the program's standard input;
    * ``env``: extra variables, ``{"NAME": "template"}``, rendered from the task like the argv;
    * ``timeout``: seconds before its process group is killed and the attempt fails;
    * ``scorer``: ``fn(run: ProgramRun) -> float | None`` (plain or async), or
      ``scorer_command``: a command that reads the run as JSON on stdin and prints a number;
    * ``reward_from``: which sources make up the reward, first present wins: ``scorer``,
      ``program`` (what it posted), ``result_file``, comma-separated or a list (default: the
      scorer when one is given, else ``program,result_file``); the others are recorded as claims;
    * ``reward_later``: an attempt without a reward succeeds, its reward left to come later;
    * ``output_limit``: bytes of stdout and of stderr recorded (each; the cut is said);
    * ``llm``: which LLM resource the program's variables point at (default: ``llm``, else
      the first);
    * ``scratch_root``: where scratch directories are made (default: the system's temp dir);
    * ``run_as``: run the program as this unprivileged user (a name, or ``uid[:gid]``; the
      runner runs as root), no supplementary groups, ``HOME`` in its scratch directory.
    * ``sandbox``: run each rollout in a bubblewrap sandbox (docs/agents.md), with default limits;
    * ``sandbox_read``: more absolute paths a sandboxed program sees, read-only;
    * ``limit_memory``: memory of a run, e.g. 2G (sandboxed: 4G; 0: none);
    * ``limit_processes``: processes and threads of a run (sandboxed: 512; 0: none);
    * ``limit_cpu_s``: CPU seconds of each process of a run (sandboxed: 3600; 0: none);
    * ``limit_file_size``: largest file a run writes, e.g. 100M (sandboxed: 1G; 0: none);
    * ``limit_open_files``: open files per process (sandboxed: 4096; 0: none).
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        stdin: bool = False,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        scorer: Callable[[ProgramRun], Any] | None = None,
        scorer_command: str | Sequence[str] | None = None,
        reward_from: str | Sequence[str] | None = None,
        reward_later: bool = False,
        output_limit: int = OUTPUT_LIMIT,
        llm: str | None = None,
        scratch_root: str | Path | None = None,
        run_as: str | None = None,
        sandbox: bool = False,
        sandbox_read: Sequence[str] = (),
        limit_memory: int | str | None = None,
        limit_processes: int | None = None,
        limit_cpu_s: float | None = None,
        limit_file_size: int | str | None = None,
        limit_open_files: int | None = None,
    ) -> None:
        super().__init__()
        self.argv = _split(command, "command")
        for arg in self.argv:
            check_template(arg, "the command")
        self.env = dict(env or {})
        for name, template in self.env.items():
            check_template(template, f"variable {name}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be positive, not {timeout}")
        if output_limit < 1:
            raise ConfigError(f"output_limit must be at least 1 byte, not {output_limit}")
        if scorer is not None and (scorer_command is not None or not callable(scorer)):
            raise ConfigError("scorer must be a callable, and only one of scorer and scorer_command is given")
        scorer_argv = _split(scorer_command, "scorer command") if scorer_command is not None else None
        self.scorer = Scorer(scorer, scorer_argv, timeout)
        self.reward_from = reward_sources(reward_from, self.scorer.present)
        self.stdin, self.timeout, self.reward_later = stdin, timeout, reward_later
        self.output_limit, self.llm = output_limit, llm
        self.scratch_root = Path(scratch_root) if scratch_root is not None else None
        if run_as is not None and sandbox:
            raise ConfigError(
                "run_as (--run-as) is for programs run without the sandbox: a sandboxed program "
                "already runs as an unprivileged user (nobody)"
            )
        self.run_as: RunAs | None = resolve_run_as(run_as)
        limits = Limits.of(
            SANDBOX_LIMITS if sandbox else Limits(),
            limit_memory,
            limit_processes,
            limit_cpu_s,
            limit_file_size,
            limit_open_files,
        )
        self.runtime = Runtime(self.argv, sandbox, sandbox_read, limits)

    def __repr__(self) -> str:
        return f"Program({shlex.join(self.argv)!r})"

    def preflight(self) -> None:
        """Before the first run (the Runner calls it once): the sandbox and limits asked for can
        be had here, else a :class:`ConfigError` that says what is missing."""
        self.runtime.check()

    async def execute_rollout(self, task: Task) -> float | None:  # type: ignore[override]
        raise ConfigError(
            "a Program runs under a Runner, which hands it the attempt's credential: "
            "Runner(Program(...), server_url).run_sync() or agentbolt runner --command '...'"
        )

    async def run_attempt(self, ctx: RolloutContext, access: AttemptAccess) -> float | None:
        """Run the program for this attempt; its reward (None: left to come later), or
        :class:`ProgramFailed` with the reason."""
        argv = [render(arg, ctx.task.data, "the command") for arg in self.argv]
        paths = _Paths(Path(tempfile.mkdtemp(prefix=f"agentbolt-{ctx.attempt.id}-", dir=self.scratch_root)))
        try:
            paths.work.mkdir()
            if self.run_as is not None and self.run_as.switch:
                paths.home.mkdir()
                self.run_as.hand_over(paths.root, paths.work, paths.home)
            task_json = json.dumps(ctx.task.data).encode()
            paths.task.write_bytes(task_json)
            env = self._environment(ctx, access, paths)
            ended = await self._run(argv, env, paths, task_json if self.stdin else None)
            _record(ctx, argv, ended)
            run = ProgramRun(ctx.task, ended.stdout.text(), ended.stderr.text(), ended.code, paths.work)
            return await choose_reward(
                ctx, access, run, paths.result, self.scorer, self.reward_later, self.reward_from
            )
        finally:
            # Synchronous on purpose: it must also happen while the task is being cancelled.
            remove_scratch(paths.root)

    # ------------------------------------------------------------------ the environment

    def _environment(self, ctx: RolloutContext, access: AttemptAccess, paths: _Paths) -> dict[str, str]:
        base = sandbox_environ(os.environ, paths.root) if self.runtime.sandbox else os.environ
        env = secret_free_environ(base, access.secrets)
        llm = self._llm_resource(ctx)
        for name in ("OPENAI_BASE_URL", "OPENAI_MODEL", "AGENTBOLT_MODEL"):
            env.pop(name, None)  # with no LLM resource, nothing points past the gateway
        if llm is not None:
            env.update(OPENAI_BASE_URL=llm.base_url, OPENAI_MODEL=llm.model, AGENTBOLT_MODEL=llm.model)
        rollout_id, attempt_id = ctx.rollout.id, ctx.attempt.id
        env.update(
            OPENAI_API_KEY=access.agent_key or PLACEHOLDER_KEY,
            AGENTBOLT_TASK_FILE=str(paths.task),
            AGENTBOLT_TASK_ID=ctx.task.id,
            AGENTBOLT_ROLLOUT_ID=rollout_id,
            AGENTBOLT_ATTEMPT_ID=attempt_id,
            AGENTBOLT_EVENTS_URL=f"{access.server_url}/agent/{rollout_id}/{attempt_id}/events",
            AGENTBOLT_RESULT_FILE=str(paths.result),
        )
        env.update(prompt_variables(ctx.resources, paths.root / "prompts"))
        env.update(role_variables(ctx.resources, lambda _, resource: resource.base_url))
        if self.run_as is not None:
            env.update(self.run_as.environment(paths.home))
        for name, template in self.env.items():
            env[name] = render(template, ctx.task.data, f"variable {name}")
        return env

    def _llm_resource(self, ctx: RolloutContext) -> LLM | None:
        return llm_of(ctx.resources, self.llm)

    # ------------------------------------------------------------------ the process

    async def _run(self, argv: list[str], env: dict[str, str], paths: _Paths, stdin: bytes | None) -> _Exit:
        launch = self.runtime.launch(argv, env, paths.root, paths.work)
        try:
            return await self._watch(launch, paths, stdin)
        finally:
            launch.close()

    async def _watch(self, launch: Launch, paths: _Paths, stdin: bytes | None) -> _Exit:
        loop = asyncio.get_running_loop()
        started = loop.time()
        as_user = self.run_as.spawn_options() if self.run_as is not None else {}
        try:
            proc = await _spawn(
                launch.argv, launch.env, paths.work, stdin is not None, {**launch.popen, **as_user}
            )
        finally:
            launch.spawned()
        out, err = CappedOutput(self.output_limit), CappedOutput(self.output_limit)
        assert proc.stdout is not None and proc.stderr is not None
        io = [
            asyncio.create_task(out.drain(proc.stdout)),
            asyncio.create_task(err.drain(proc.stderr)),
        ]
        if stdin is not None:
            io.append(asyncio.create_task(_feed(proc, stdin)))
        timed_out = False
        watch = asyncio.ensure_future(launch.limits.watch()) if launch.limits is not None else None
        try:  # a limit reached ends the run at once (a fork bomb stops at its process limit)
            await asyncio.wait_for(_first(_exited(proc), watch), self.timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if watch is not None:
                watch.cancel()
            await _end_group(proc)
            await _finish_io(proc, io)
        failure = launch.failure(proc.returncode, err.text())
        return _Exit(proc.returncode, timed_out, out, err, loop.time() - started, failure)


def llm_of(resources: Resources | None, name: str | None) -> LLM | None:
    """The LLM resource a program is pointed at: the one named ``name``, else ``llm``, else
    the first; a named one that is missing fails the attempt."""
    given = resources.resources if resources else {}
    if name is not None:
        chosen = given.get(name)
        if not isinstance(chosen, LLM):
            raise ProgramFailed("ConfigError", f"no LLM resource named {name!r} in this rollout")
        return chosen
    named = given.get("llm")
    if isinstance(named, LLM):
        return named
    return next((r for r in given.values() if isinstance(r, LLM)), None)


def _split(command: str | Sequence[str], what: str) -> list[str]:
    try:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    except ValueError as exc:
        raise ConfigError(f"{what} {command!r} cannot be split into arguments: {exc}") from None
    if not argv:
        raise ConfigError(f"the {what} is empty")
    return argv


async def _first(exited: Any, watch: asyncio.Future[str] | None) -> None:
    """Until the program has ended, or a limit was reached."""
    if watch is None:
        return await exited
    ended = asyncio.ensure_future(exited)
    try:
        await asyncio.wait([ended, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()


async def _spawn(
    argv: list[str], env: dict[str, str], cwd: Path, with_stdin: bool, popen: Mapping[str, Any]
) -> Any:
    """Start the program in a new session (so its own process group, which it leads);
    ``popen``: the sandbox's and limits' own spawn arguments."""
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            **popen,
        )
    except FileNotFoundError:
        raise ProgramFailed("CommandNotFound", f"command not found: {argv[0]!r}") from None
    except PermissionError as exc:
        who = (
            f" as uid {popen['user']} (run_as: it must be able to read and run it)" if "user" in popen else ""
        )
        raise ProgramFailed("CommandNotFound", f"cannot execute {argv[0]!r}{who}: {exc.strerror}") from None
    except OSError as exc:
        raise ProgramFailed("CommandNotFound", f"cannot start {argv[0]!r}: {exc}") from None
    except subprocess.SubprocessError as exc:  # the limits' hook failed in the child
        raise ProgramFailed("LimitSetup", f"cannot put the program under its limits: {exc}") from None


async def _feed(proc: Any, data: bytes) -> None:
    """Write the task to stdin and close it; a program that exits without reading is fine."""
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        proc.stdin.close()


def _kill_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal the program's whole group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


async def _exited(proc: Any) -> None:
    """Until the program's own process has ended. (``proc.wait()`` also waits for its pipes
    to close, which a process it started may hold open for as long as it likes.)"""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds here, or the process is already reaped
        pidfd = None
    if pidfd is not None:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(pidfd, wake)
        try:
            await readable
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    # The child watcher reaps it and sets the code a moment later (at once after a pidfd).
    while proc.returncode is None:
        await asyncio.sleep(0.001 if pidfd is not None else 0.01)


async def _end_group(proc: Any) -> None:
    """Leave nothing of the program running. A program still running (timed out, stopped)
    gets SIGTERM and ``TERM_WAIT`` seconds; then the group (what it started included) gets
    SIGKILL."""
    try:
        if proc.returncode is None and _kill_group(proc.pid, signal.SIGTERM):
            await asyncio.wait_for(_exited(proc), TERM_WAIT)
    except TimeoutError:
        pass
    finally:
        _kill_group(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            # SIGKILL cannot be ignored: the wait is short. Shielded so that a cancellation
            # arriving now does not leave the process unreaped.
            await asyncio.shield(_exited(proc))


async def _finish_io(proc: Any, tasks: list[asyncio.Task[None]]) -> None:
    """Read the output to its end and let the process's transport close; a process that
    escaped the group (its own session) and holds the pipes cuts the output here."""
    closed = asyncio.ensure_future(proc.wait())
    _, pending = await asyncio.wait([*tasks, closed], timeout=DRAIN_WAIT)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, closed, return_exceptions=True)


def _record(ctx: RolloutContext, argv: list[str], ended: _Exit) -> None:
    """Record the program's output and exit; fail the attempt if it timed out or exited
    non-zero."""
    for name, output in (("stdout", ended.stdout), ("stderr", ended.stderr)):
        if output.total:
            ctx.emit(EventType.MESSAGE, {"role": name, "content": output.text(), **output.sizes()})
    ctx.emit(
        "program_exit",
        {"argv": argv, "exit_code": ended.code, "timed_out": ended.timed_out, "seconds": ended.seconds},
    )
    if ended.failure is not None:
        raise ended.failure
    if ended.timed_out:
        raise ProgramFailed(
            "Timeout",
            f"the program ran past its timeout ({ended.seconds:.1f} s): its process group was killed",
        )
    if ended.code:
        raise ProgramFailed("ProgramExit", f"{_exit_words(ended.code)}{_tail(ended.stderr)}")


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"the program was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the program was killed by signal {-code}"
    return f"the program exited with code {code}"


def _tail(stderr: CappedOutput) -> str:
    text = stderr.text().strip()
    if not text:
        return " (stderr empty)"
    return f"; stderr ends: {text[-STDERR_TAIL:]}"
