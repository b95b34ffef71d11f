"""The agent API: what a user writes, and the per-rollout context it runs in.

Two shapes:

* subclass :class:`LitAgent` and implement ``execute_rollout(self, task)`` (sync or async),
  reading resources with ``self.get_resource("system_prompt")`` — the seed article's shape;
* decorate a plain function with :func:`rollout`; its parameters are filled from the task and
  the resources, by name first and then by type annotation.

Inside a rollout, :func:`emit_reward`, :func:`emit_state`, :func:`emit_message`,
:func:`emit_tool_call` and :func:`emit_event` record events from anywhere (any depth, any thread or task started from it):
the current rollout lives in a :mod:`contextvars` variable, which both ``asyncio`` tasks and
``run_in_executor``/``to_thread`` copy. A plain ``threading.Thread`` does not copy it: there
``emit_*`` reaches the one rollout running in this process, and raises when several run (start
such threads with :func:`rollout_thread`, which hands the context over).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, get_type_hints

from agentbolt.errors import ConfigError
from agentbolt.schemas import (
    LLM,
    Attempt,
    EventCreate,
    EventType,
    ModelWeights,
    PromptTemplate,
    Resources,
    Rollout,
    Task,
    Trajectory,
)

__all__ = [
    "LitAgent",
    "RolloutContext",
    "active_rollout",
    "call_id_of",
    "current_rollout",
    "emit_event",
    "emit_exception",
    "emit_message",
    "emit_reward",
    "emit_state",
    "emit_tool_call",
    "rollout",
    "rollout_thread",
]

_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "agentbolt_rollout", default=None
)
# Rollouts whose agent is running in this process (an abandoned sync agent's thread included,
# until it returns): what a thread that did not inherit the context can still be told apart by.
_running: set[RolloutContext] = set()
_running_lock = threading.Lock()


class RolloutContext:
    """The rollout being run: its task, attempt, resources, and a thread-safe event buffer.

    Events get their per-attempt sequence number when emitted, so re-sending a batch after a
    network error cannot duplicate them.
    """

    def __init__(self, rollout: Rollout, attempt: Attempt, resources: Resources | None) -> None:
        self.rollout, self.attempt, self.resources = rollout, attempt, resources
        self._lock = threading.Lock()
        self._pending: list[EventCreate] = []
        self._next_seq = 0
        self.rewards: list[float] = []  # rollout-level rewards emitted so far
        self.listeners: list[Callable[[EventCreate], None]] = []  # e.g. the OpenTelemetry tracer

    @property
    def task(self) -> Task:
        return self.rollout.task

    def emit(self, type: str, data: dict[str, Any]) -> EventCreate:
        with self._lock:
            event = EventCreate(sequence=self._next_seq, type=type, timestamp=time.time(), data=data)
            self._next_seq += 1
            self._pending.append(event)
        for listener in self.listeners:
            listener(event)
        return event

    def take_pending(self) -> list[EventCreate]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def put_back(self, events: list[EventCreate]) -> None:
        """Return events whose upload failed, to be sent with the next batch."""
        with self._lock:
            self._pending[:0] = events

    @property
    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def resource(self, name: str) -> Any:
        if self.resources is None or name not in self.resources.resources:
            have = sorted(self.resources.resources) if self.resources else []
            raise ConfigError(f"no resource named {name!r} in this rollout (available: {have or 'none'})")
        return self.resources.resources[name]

    def activate(self) -> contextvars.Token[RolloutContext | None]:
        return _current.set(self)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Mark the agent of this rollout as running in this process while the block runs."""
        with _running_lock:
            _running.add(self)
        try:
            yield
        finally:
            with _running_lock:
                _running.discard(self)


def active_rollout() -> RolloutContext | None:
    """The rollout being run in this context, or None outside one (tracing asks this)."""
    return _current.get()


def _resolve() -> RolloutContext | None:
    """This context's rollout; in a thread that did not inherit one, the only rollout running
    in this process. None when none runs; raises when several do (which one is meant is unknown)."""
    ctx = _current.get()
    if ctx is not None:
        return ctx
    with _running_lock:
        running = list(_running)
    if len(running) <= 1:
        return running[0] if running else None
    raise RuntimeError(
        f"called from a thread that does not carry its rollout's context, while {len(running)} "
        "rollouts run in this process: start the thread with "
        "agentbolt.runner.agent.rollout_thread(target, ...) or run its target inside "
        "contextvars.copy_context().run(target, ...)"
    )


def current_rollout() -> RolloutContext:
    """The rollout being run; raises outside a rollout."""
    ctx = _resolve()
    if ctx is None:
        raise RuntimeError(
            "not inside a rollout: emit_* and get_resource work only while a runner runs the agent"
        )
    return ctx


def rollout_thread(target: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """A ``threading.Thread`` (not started) running ``target(*args, **kwargs)`` in a copy of
    the caller's context: ``emit_*`` inside it reach the caller's rollout, however many run."""
    return threading.Thread(target=contextvars.copy_context().run, args=(target, *args), kwargs=kwargs)


def _emit(type: str, data: dict[str, Any]) -> EventCreate | None:
    ctx = _resolve()
    return ctx.emit(type, data) if ctx is not None else None


CALL_ID_HEADER = "x-agentbolt-call-id"
MAX_STATE_KEY = 512
_NOT_THROUGH_GATEWAY = (
    "carries no agentbolt call id: the response did not come through the agentbolt gateway "
    "(point the client at the rollout's LLM resource's base_url), or the gateway could not "
    "record the call"
)


def call_id_of(obj: Any) -> int | None:
    """The id of the model call ``obj`` names (the gateway's record of it, an ``llm_call``
    event): an int, a string of digits, or an answer from the gateway (an openai response
    object or chunk, a dict of its JSON, a raw response with the ``X-Agentbolt-Call-Id``
    header), whose ``agentbolt`` field carries it. ``None`` when there is none."""
    if obj is None or isinstance(obj, bool):
        return None
    if isinstance(obj, int):
        return _checked_id(obj)
    if isinstance(obj, str):
        text = obj.strip()
        return int(text) if text.isascii() and text.isdigit() else None
    found = _agentbolt_field(obj)
    if isinstance(found, Mapping):
        value = found.get("call_id")
        if isinstance(value, int) and not isinstance(value, bool):
            return _checked_id(value)
    headers = getattr(obj, "headers", None)
    if isinstance(headers, Mapping) or hasattr(headers, "get"):
        value = headers.get(CALL_ID_HEADER)  # type: ignore[union-attr]
        if isinstance(value, str) and value.isascii() and value.isdigit():
            return int(value)
    return None


def _checked_id(value: int) -> int:
    if value < 0:
        raise ValueError(f"a call id is a non-negative integer, not {value}")
    return value


def _agentbolt_field(obj: Any) -> Any:
    """The ``agentbolt`` field of a dict or response object (pydantic keeps unknown fields in
    ``model_extra``)."""
    if isinstance(obj, Mapping):
        return obj.get("agentbolt")
    extra = getattr(obj, "model_extra", None)
    if isinstance(extra, Mapping) and "agentbolt" in extra:
        return extra["agentbolt"]
    with contextlib.suppress(Exception):  # an object whose attributes raise is no answer
        return getattr(obj, "agentbolt", None)
    return None


def _required_id(obj: Any, what: str) -> int:
    found = call_id_of(obj)
    if found is not None:
        return found
    if isinstance(obj, (int, str)):
        raise ValueError(f"{what}={obj!r} is not a call id (a non-negative integer)")
    raise ValueError(f"{what}: this {type(obj).__name__} {_NOT_THROUGH_GATEWAY}")


def emit_reward(
    value: float, name: str | None = None, call: Any = None, llm_call_id: int | str | None = None
) -> None:
    """Record a reward. With ``call`` (what :func:`call_id_of` takes: usually the response the
    gateway answered, ``emit_reward(0.5, call=response)``) or its alias ``llm_call_id`` it
    belongs to that model call (a per-turn reward), else to the rollout (a rollout whose agent
    returns None gets the sum of its rollout-level rewards; per-call rewards never count there).
    ``ValueError`` when ``call`` names no call or the two name different calls."""
    value = float(value)
    data: dict[str, Any] = {"value": value}
    if name is not None:
        data["name"] = name
    call_id = _required_id(call, "call") if call is not None else None
    if llm_call_id is not None:
        alias = _required_id(llm_call_id, "llm_call_id")
        if call_id is not None and alias != call_id:
            raise ValueError(f"call names model call {call_id} and llm_call_id names {alias}: give one")
        call_id = alias
    if call_id is not None:
        data["llm_call_id"] = call_id
    ctx = _resolve()
    if ctx is None:
        return
    if call_id is None:
        ctx.rewards.append(value)
    ctx.emit(EventType.REWARD, data)


def emit_state(key: str, call: Any) -> None:
    """Declare the environment's state at a turn: ``key`` names what the model saw when it made
    ``call`` (what :func:`call_id_of` takes; usually the response). Turns of a group's
    trajectories with the same key are compared with each other (step-level grouping, GRPO's
    ``advantage="gigpo"``): give equal keys to equal states, e.g. ``f"room={room};keys={n}"``,
    never the rendered prompt. A non-empty string of at most 512 characters."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a state key is a non-empty string, not {key!r}")
    if len(key) > MAX_STATE_KEY:
        raise ValueError(f"a state key has at most {MAX_STATE_KEY} characters, not {len(key)}")
    if call is None:
        raise ValueError("emit_state needs the call the state belongs to: emit_state(key, call=response)")
    _emit(EventType.STATE, {"key": key, "llm_call_id": _required_id(call, "call")})


def emit_message(content: str, role: str = "log") -> None:
    _emit(EventType.MESSAGE, {"role": role, "content": content})


def emit_tool_call(
    name: str,
    arguments: Any = None,
    result: Any = None,
    error: str | None = None,
    duration_ms: float | None = None,
) -> None:
    _emit(
        EventType.TOOL_CALL,
        {"name": name, "arguments": arguments, "result": result, "error": error, "duration_ms": duration_ms},
    )


def emit_event(type: str, data: dict[str, Any] | None = None) -> None:
    """Record an event of a user-defined type (a ``state`` event is checked as
    :func:`emit_state` checks it)."""
    if type == EventType.STATE:
        data = data or {}
        emit_state(data.get("key", ""), data.get("llm_call_id"))
        return
    _emit(type, data or {})


def emit_exception(exc: BaseException) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    _emit(EventType.EXCEPTION, {"type": type(exc).__name__, "message": str(exc), "traceback": tb})


def resource_value(resource: Any) -> Any:
    """What ``get_resource`` hands out: a prompt's template text, other resources as they are."""
    return resource.template if isinstance(resource, PromptTemplate) else resource


class LitAgent:
    """Base class for agents. Implement :meth:`execute_rollout` (plain or ``async def``)."""

    def __init__(self) -> None:
        pass

    def execute_rollout(self, task: Task) -> Trajectory | float | None:
        raise NotImplementedError(f"{type(self).__name__} must implement execute_rollout(self, task)")

    def get_resource(self, name: str) -> Any:
        """The named resource of the current rollout: a prompt template's text (a ``str``),
        or the :class:`LLM` / :class:`ModelWeights` object."""
        return resource_value(current_rollout().resource(name))

    @property
    def rollout(self) -> RolloutContext:
        return current_rollout()

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.execute_rollout)


_BY_TYPE = (PromptTemplate, LLM, ModelWeights)


def _inject(fn: Callable[..., Any], task: Task, ctx: RolloutContext) -> dict[str, Any]:
    """Arguments for ``fn``: ``task`` (by name or ``Task`` type), then resources by parameter
    name, then by annotated type (the first resource of that type)."""
    hints = get_type_hints(fn)
    resources = ctx.resources.resources if ctx.resources else {}
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        hint = hints.get(name)
        if name == "task" or hint is Task:
            kwargs[name] = task
        elif name in resources:
            res = resources[name]
            kwargs[name] = res if isinstance(hint, type) and isinstance(res, hint) else resource_value(res)
        elif isinstance(hint, type) and issubclass(hint, _BY_TYPE):
            match = next((r for r in resources.values() if isinstance(r, hint)), None)
            if match is None:
                raise ConfigError(f"parameter {name!r} wants a {hint.__name__} resource and there is none")
            kwargs[name] = match
        elif param.default is inspect.Parameter.empty:
            raise ConfigError(
                f"cannot fill parameter {name!r} of {fn.__name__}: name it 'task', after a resource "
                f"({sorted(resources) or 'none published'}), or annotate it with a resource type"
            )
    return kwargs


class FunctionAgent(LitAgent):
    """A plain function as an agent (see :func:`rollout`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        functools.update_wrapper(self, fn)
        if inspect.iscoroutinefunction(fn):

            async def run_async(task: Task) -> Any:
                return await fn(**_inject(fn, task, current_rollout()))

            self.execute_rollout = run_async  # type: ignore[method-assign,assignment]

    def execute_rollout(self, task: Task) -> Trajectory | float | None:
        return self.fn(**_inject(self.fn, task, current_rollout()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def rollout(fn: Callable[..., Any]) -> FunctionAgent:
    """Make a plain (sync or async) function an agent; its parameters are injected."""
    return FunctionAgent(fn)


def _construct(cls: type[LitAgent]) -> LitAgent:
    """``cls()``, or a ConfigError naming the constructor arguments it needs (not a TypeError
    that reads as a bug in the runner)."""
    needed = [
        name
        for name, param in inspect.signature(cls).parameters.items()
        if param.default is inspect.Parameter.empty
        and param.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if needed:
        raise ConfigError(
            f"agent class {cls.__name__} needs constructor arguments ({', '.join(needed)}), so the "
            f"runner cannot build it: create an instance in your module, e.g. "
            f"'agent = {cls.__name__}(...)', and point the runner at that name instead"
        )
    return cls()


def as_agent(obj: Any) -> LitAgent:
    """Accept an agent instance, a LitAgent subclass (built without arguments) or a function."""
    if isinstance(obj, LitAgent):
        return obj
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        return _construct(obj)
    if callable(obj):
        return FunctionAgent(obj)
    raise ConfigError(f"{obj!r} is not an agent: expected a LitAgent, a LitAgent subclass or a function")
