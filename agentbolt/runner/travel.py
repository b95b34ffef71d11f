"""How an agent crosses to another interpreter (a Trainer's runner process, a Ray actor)
without that interpreter importing the user's main script: pickled with cloudpickle, by name
when it is a global of a module the other side can import (this process's ``sys.path`` goes
along), by value otherwise (classes and functions of ``__main__``, closures, a module loaded from
a file path outside ``sys.path``). :func:`unpickled` is the other side."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import pickle
import pickletools
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from agentbolt.errors import ConfigError
from agentbolt.runner.agent import FunctionAgent, LitAgent, as_agent

__all__ = ["AgentByName", "how_to_start", "pickled", "unpickled"]

log = logging.getLogger("agentbolt.runner")


@dataclass(frozen=True)
class AgentByName:
    """An agent that is a global of an importable module (a ``@rollout`` function, which does
    not pickle itself), sent by name and imported in the runner process."""

    module: str
    qualname: str

    def load(self) -> LitAgent:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return as_agent(obj)


def how_to_start(agent: LitAgent) -> tuple[str, Any]:
    """``("subprocess", the pickled agent)`` when it pickles, else ``("fork", agent)`` where the
    platform has ``fork`` (a ConfigError where it has none)."""
    if sys.executable:
        payload = pickled(agent)
        if payload is not None:
            return "subprocess", payload
    if "fork" in multiprocessing.get_all_start_methods():
        return "fork", agent
    raise ConfigError(
        f"the agent {agent!r} does not pickle (with cloudpickle), so no runner process can be sent "
        "it: build what it holds (a client, a lock) inside execute_rollout, or run the runners "
        "yourself (agentbolt runner --agent module:object)"
    )


def pickled(agent: LitAgent) -> bytes | None:
    """The agent, pickled so that a fresh interpreter with this process's ``sys.path`` rebuilds
    it; None when it does not pickle."""
    import cloudpickle

    by_value: list[Any] = []
    try:
        obj: Any = by_name(agent) or hints_resolved(agent)
        data: bytes = cloudpickle.dumps(obj)
        missing = [name for name in modules_of(data) if not importable(name)]
        if not missing:
            return data
        # modules the child cannot import (loaded from a file path): their code goes by value
        for name in missing:
            module = sys.modules.get(name)
            if module is None or name == "__main__":
                return None
            if name not in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.register_pickle_by_value(module)
                by_value.append(module)
        data = cloudpickle.dumps(obj)
        return None if any(not importable(name) for name in modules_of(data)) else data
    except Exception:  # noqa: BLE001 - whatever stops pickling means: fork
        log.debug("the agent does not pickle", exc_info=True)
        return None
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def hints_resolved(agent: LitAgent) -> LitAgent:
    """A function agent whose annotations are strings (``from __future__ import annotations``)
    rebuilt on a copy of the function with them resolved here: sent by value, a function keeps
    only the globals its code names, and the runner could no longer tell a parameter's type
    (``llm: LLM``) to fill it."""
    fn = getattr(agent, "fn", None)
    if type(agent) is not FunctionAgent or not isinstance(fn, types.FunctionType):
        return agent
    if not any(isinstance(a, str) for a in fn.__annotations__.values()) or global_of(fn):
        return agent  # nothing to resolve, or sent by reference (its module imported there)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 - a name the parent cannot resolve either: sent as it is
        return agent
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__annotations__ = {**fn.__annotations__, **hints}
    return FunctionAgent(copy)


def by_name(agent: LitAgent) -> AgentByName | None:
    """``agent`` as a global's name, when it is one of a module other than ``__main__``."""
    module = getattr(agent, "__module__", None)
    qualname = (vars(agent) if hasattr(agent, "__dict__") else {}).get("__qualname__")
    qualname = qualname or getattr(agent, "__qualname__", None)
    if not global_of(agent) or not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return AgentByName(module, qualname)


def global_of(obj: Any) -> bool:
    """Whether ``obj`` is what its ``__module__`` and ``__qualname__`` name, in a module other
    than ``__main__`` that a fresh interpreter can import."""
    module = getattr(obj, "__module__", None)
    qualname = vars(obj).get("__qualname__") if hasattr(obj, "__dict__") else None
    qualname = qualname or getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        return False
    if module == "__main__" or not importable(module):
        return False
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


def modules_of(data: bytes) -> set[str]:
    """The modules a pickle refers to (its GLOBAL and STACK_GLOBAL opcodes). STACK_GLOBAL takes
    the module's name from the stack, pushed as a string or fetched from the memo."""
    modules: set[str] = set()
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = []  # the strings (None: anything else) pushed, latest last
    top: str | None = None  # what the last opcode pushed, when a string
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            modules.add(str(arg).split(" ", 1)[0])
        elif op.name == "STACK_GLOBAL" and len(pushed) >= 2 and pushed[-2] is not None:
            modules.add(str(pushed[-2]))
        if op.name == "MEMOIZE":
            memo[len(memo)] = top
            continue
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[_index(arg)] = top
            continue
        if op.name in ("GET", "BINGET", "LONG_BINGET"):
            top = memo.get(_index(arg))
        elif op.stack_after:  # FRAME, PROTO, STOP push nothing
            top = arg if isinstance(arg, str) and ("UNICODE" in op.name or "STRING" in op.name) else None
        else:
            continue
        pushed.append(top)
    return modules


def _index(arg: object) -> int:
    """A memo opcode's argument: its index."""
    if not isinstance(arg, int):
        raise TypeError(f"a memo index, not {arg!r}")
    return arg


def importable(module: str) -> bool:
    """Whether a fresh interpreter with this process's sys.path finds ``module``'s top package
    (the finders are asked directly: ``importlib.util.find_spec`` would answer from sys.modules).
    ``__main__`` is never: the child's is agentbolt's, not the user's script."""
    top = module.split(".", 1)[0]
    if top == "__main__":
        return False
    if top in sys.builtin_module_names:
        return True
    return any(
        getattr(finder, "find_spec", None) and finder.find_spec(top, None) is not None
        for finder in sys.meta_path
    )


def unpickled(data: bytes) -> LitAgent:
    """The agent :func:`pickled` sent: imported by name, or rebuilt from its value."""
    obj = pickle.loads(data)
    return obj.load() if isinstance(obj, AgentByName) else as_agent(obj)
