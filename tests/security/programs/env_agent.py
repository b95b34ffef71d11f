"""An in-process agent that reports where it could find the runner's token: its environment
(``os.environ``) and the environment block the process started with (``/proc/self/environ``)."""

import json
import os

from agentbolt import Task, emit_message, rollout


@rollout
def env_probe(task: Task) -> float:
    with open("/proc/self/environ", "rb") as f:
        block = f.read().decode(errors="replace").split("\0")
    emit_message(json.dumps({"environ": dict(os.environ), "block": block}))
    return 1.0
