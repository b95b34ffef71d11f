"""A program agent's reward: from the events it posted, its result file, or a scorer.

The program is untrusted: an agent under training explores, and one that can write its own
grade (``curl $AGENTBOLT_EVENTS_URL -d '{"value": 1}'``) will. So the user says which sources
make up the reward (``reward_from``); by default, when a scorer is given, the scorer alone.
Each chosen source that is present is recorded as a ``reward`` event named after it
(``program``, ``result_file``, ``scorer``) and the rollout's reward is the first present, in the
order chosen. A source present but not chosen is a claim: recorded as a ``reward_claim`` event
(with the reward it was set against and whether the two disagree), which no algorithm trains
on. A source that is present but malformed (a result file that is not JSON, a scorer that prints
no number) fails the attempt: a broken reward is never read as "no reward".
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbolt.client import AsyncClient
from agentbolt.errors import ConfigError
from agentbolt.runner.agent import RolloutContext
from agentbolt.runner.program_io import ProgramFailed, secret_free_environ
from agentbolt.schemas import EventType, Task

__all__ = [
    "CLAIM_EVENT",
    "SOURCES",
    "AttemptAccess",
    "ProgramRun",
    "Scorer",
    "choose_reward",
    "read_result",
    "reward_sources",
]

SOURCES = ("program", "result_file", "scorer")
"""Where a program's reward can come from: what it posted, its result file, the user's scorer."""

CLAIM_EVENT: str = EventType.REWARD_CLAIM
"""The event type of a source present but not chosen: recorded and shown, never trained on."""

RESULT_LIMIT = 1 << 20
"""Bytes of a result file read; a larger one is malformed."""


@dataclass(frozen=True)
class AttemptAccess:
    """What the runner hands a program agent for one attempt."""

    agent_key: str | None
    """The attempt's own credential (None from a server that mints none)."""
    server_url: str
    client: AsyncClient
    """The runner's client: reads back what the program posted; never handed to the program."""
    secrets: tuple[str, ...] = ()
    """The runner's tokens: no variable holding one reaches the program."""


@dataclass(frozen=True)
class ProgramRun:
    """What a scorer sees of one run (its working directory still holds what it wrote)."""

    task: Task
    stdout: str
    stderr: str
    exit_code: int | None
    workdir: Path
    llm_calls: list[dict[str, Any]] = field(default_factory=list)
    """The data of the attempt's ``llm_call`` events, in order."""
    result: Any = None
    """The result file's content, if the program wrote one."""

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task.model_dump(mode="json"),
            "stdout": self.stdout,
            "stderr": self.stderr,
            "exit_code": self.exit_code,
            "llm_calls": self.llm_calls,
            "result": self.result,
        }


@dataclass(frozen=True)
class Scorer:
    """The user's scorer: a Python callable or a command (at most one), or none."""

    fn: Callable[[ProgramRun], Any] | None = None
    argv: Sequence[str] | None = None
    timeout: float | None = None

    @property
    def present(self) -> bool:
        return self.fn is not None or self.argv is not None

    async def score(self, run: ProgramRun, secrets: Sequence[str]) -> float | None:
        if self.fn is not None:
            value = await _call(self.fn, run)
            return _number(value, "the scorer returned")
        if self.argv is not None:
            return await self._command(run, secrets)
        return None

    async def _command(self, run: ProgramRun, secrets: Sequence[str]) -> float | None:
        env = secret_free_environ(os.environ, secrets)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv or (),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=run.workdir,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise ProgramFailed("ScorerFailed", f"cannot start the scorer command: {exc}") from None
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(json.dumps(run.as_json()).encode()), self.timeout
            )
        except TimeoutError:
            raise ProgramFailed("ScorerFailed", f"the scorer command ran past {self.timeout} s") from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
        if proc.returncode:
            stderr = err.decode(errors="replace").strip()[-1000:]
            raise ProgramFailed("ScorerFailed", f"the scorer command exited with {proc.returncode}: {stderr}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        return _number(lines[-1].strip(), "the scorer command printed") if lines else None


async def _call(fn: Callable[[ProgramRun], Any], run: ProgramRun) -> Any:
    """Call the scorer; a plain one in a thread (it may be slow), an async one on the loop."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(run)
        return await asyncio.to_thread(fn, run)
    except Exception as exc:
        raise ProgramFailed("ScorerFailed", f"the scorer raised {type(exc).__name__}: {exc}") from exc


def _number(value: Any, said: str) -> float | None:
    """A finite reward from what a source gave (None stays None); else the attempt fails."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ProgramFailed("InvalidReward", f"{said} {str(value)[:200]!r}, not a number") from None
    if not math.isfinite(number):
        raise ProgramFailed("InvalidReward", f"{said} {number}, not a finite number")
    return number


def read_result(path: Path) -> tuple[float | None, Any]:
    """The result file's reward and content: ``{"reward": x, ...}`` or a bare number.
    ``(None, None)`` when the program wrote none."""
    where = "the result file (AGENTBOLT_RESULT_FILE)"
    try:  # never a link (to a file the program could not read itself), nor a pipe that blocks
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        raise ProgramFailed("MalformedResult", f"{where} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ProgramFailed("MalformedResult", f"{where} is not a regular file")
        raw = f.read(RESULT_LIMIT + 1)
    if len(raw) > RESULT_LIMIT:
        raise ProgramFailed("MalformedResult", f"{where} is larger than {RESULT_LIMIT} bytes")
    try:
        content = json.loads(raw)
    except ValueError as exc:
        snippet = raw[:200].decode(errors="replace")
        raise ProgramFailed("MalformedResult", f"{where} is not JSON ({exc}): {snippet!r}") from None
    if isinstance(content, dict):
        return _number(content.get("reward"), f"{where} holds reward"), content
    if isinstance(content, int | float) and not isinstance(content, bool):
        return _number(content, f"{where} holds"), content
    raise ProgramFailed(
        "MalformedResult", f'{where} must hold {{"reward": <number>, ...}}, not {raw[:200]!r}'
    )


async def _posted(
    ctx: RolloutContext, access: AttemptAccess, with_calls: bool
) -> tuple[float | None, list[Any]]:
    """The sum of the rollout-level rewards the program posted to its events URL (None if
    none), and its recorded model calls when a scorer will want them."""
    types = [EventType.REWARD.value, EventType.LLM_CALL.value] if with_calls else [EventType.REWARD.value]
    events = await access.client.all_events(ctx.rollout.id, attempt_id=ctx.attempt.id, type=types)
    rewards = [
        e.data.get("value") for e in events if e.type == EventType.REWARD and "llm_call_id" not in e.data
    ]
    calls = [e.data for e in events if e.type == EventType.LLM_CALL]
    numbers = [_number(v, "the program posted reward") for v in rewards]
    present = [n for n in numbers if n is not None]
    return (math.fsum(present) if present else None), calls


def reward_sources(reward_from: str | Sequence[str] | None, has_scorer: bool) -> tuple[str, ...]:
    """The sources the reward is read from, in order of preference: ``reward_from`` checked
    (``"scorer"``, ``"program,result_file"`` or a list), or the default: the scorer alone when
    there is one, else the program's own report (its posted reward, then its result file)."""
    if reward_from is None:
        return ("scorer",) if has_scorer else ("program", "result_file")
    names = reward_from.split(",") if isinstance(reward_from, str) else list(reward_from)
    chosen = tuple(str(n).strip() for n in names if str(n).strip())
    wrong = [n for n in chosen if n not in SOURCES]
    if wrong or not chosen:
        raise ConfigError(
            f"reward_from: {', '.join(wrong) or 'nothing'} given; choose from {', '.join(SOURCES)}"
        )
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"reward_from: a source is named twice in {', '.join(chosen)}")
    if "scorer" in chosen and not has_scorer:
        raise ConfigError("reward_from names the scorer, but no scorer (or scorer command) is given")
    return chosen


async def choose_reward(
    ctx: RolloutContext,
    access: AttemptAccess,
    run: ProgramRun,
    result_path: Path,
    scorer: Scorer,
    reward_later: bool,
    sources: Sequence[str] | None = None,
) -> float | None:
    """Read every source; the first present of ``sources`` (default: :func:`reward_sources`) is
    the reward. Chosen ones are recorded as named reward events, the others as claims."""
    chosen = tuple(sources) if sources is not None else reward_sources(None, scorer.present)
    posted, calls = await _posted(ctx, access, scorer.present)
    from_file, content = read_result(result_path)
    if content is not None:
        ctx.emit("program_result", {"content": content})
    scored = None
    if scorer.present:
        full = ProgramRun(run.task, run.stdout, run.stderr, run.exit_code, run.workdir, calls, content)
        scored = await scorer.score(full, access.secrets)
    values = {"program": posted, "result_file": from_file, "scorer": scored}
    reward = next((values[n] for n in chosen if values[n] is not None), None)
    _record(ctx, values, chosen, reward)
    if reward is None and not reward_later:
        raise ProgramFailed("NoReward", _no_reward(scorer, chosen))
    return reward


def _record(
    ctx: RolloutContext, values: dict[str, float | None], chosen: Sequence[str], reward: float | None
) -> None:
    """Each present source: a named reward event when chosen, else a claim set against the reward."""
    for name, value in values.items():
        if value is None:
            continue
        if name in chosen:
            ctx.emit(EventType.REWARD, {"value": value, "name": name})
        else:
            ctx.emit(
                CLAIM_EVENT,
                {"name": name, "value": value, "reward": reward, "disputed": disputed(value, reward)},
            )


def disputed(claim: float, reward: float | None) -> bool:
    """Whether a claim disagrees with the reward given (no reward: nothing to disagree with)."""
    return reward is not None and not math.isclose(claim, reward, rel_tol=1e-9, abs_tol=1e-9)


def _no_reward(scorer: Scorer, chosen: Sequence[str]) -> str:
    if tuple(chosen) == ("scorer",):
        return "no reward: the scorer gave none (or ask for the reward later)"
    if tuple(chosen) != ("program", "result_file"):
        return f"no reward: none of {', '.join(chosen)} (reward_from) gave one (or ask for the reward later)"
    ways = "posted no reward to AGENTBOLT_EVENTS_URL and wrote no AGENTBOLT_RESULT_FILE"
    tail = "the scorer gave none" if scorer.present else "no scorer is set"
    return f"no reward: the program {ways}, and {tail} (or ask for the reward later)"
