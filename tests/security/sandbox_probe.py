"""A hostile program agent, run sandboxed by tests/security/test_sandbox.py: the task's ``probe``
names what it tries. It prints what it found as one JSON line and, when it ends by itself,
reports reward 1 in its result file. Standard library only: the sandbox runs it with the
system's Python."""

import json
import os
import sys
import time


def attempt(action, *args):
    """What ``action`` gave, or the name of the error that refused it."""
    try:
        value = action(*args)
    except OSError as exc:
        return {"refused": type(exc).__name__, "errno": exc.errno}
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return {"got": value}


def read(path):
    with open(path, "rb") as f:
        return f.read(1 << 16)


def write(path):
    with open(path, "w") as f:
        f.write("probe was here")
    return "written"


def credentials(task):
    pids = {"parent": os.getppid(), "runner": task["runner_pid"]}
    found = {"environ": dict(os.environ), "pid": os.getpid(), "pids": pids, "proc": os.listdir("/proc")}
    for who, pid in pids.items():
        for name in ("environ", "cmdline", "mem"):
            found[f"{who}/{name}"] = attempt(read, f"/proc/{pid}/{name}")
    found["token_file"] = attempt(read, task["token_file"])
    found["home"] = {p: attempt(os.listdir, p) for p in ("/root", "/home", task["runner_home"])}
    return found


def fork_bomb(task):
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.001)


def memory_hog(task):
    hold = []
    for _ in range(20 * 1024 // 16):  # 20 GB, 16 MB at a time, every page touched
        hold.append(b"\1" * (16 << 20))


def giant_file(task):
    chunk = b"\0" * (1 << 20)
    with open("giant", "wb") as f:
        for _ in range(10 * 1024):  # 10 GB
            f.write(chunk)


def cpu_spin(task):
    while True:
        pass


def write_outside(task):
    targets = [__file__, "/usr/agentbolt-probe", "/agentbolt-probe", "/etc/agentbolt-probe", task["outside"]]
    return {path: attempt(write, path) for path in targets}


def limits(task):
    with open("/proc/self/limits") as f:
        return {"limits": f.read(), "uid": [*os.getresuid(), os.getgid()]}


def hold(task):
    """Keep a secret in this scratch directory while another rollout looks for it."""
    with open("secret.txt", "w") as f:
        f.write(task["secret"])
    deadline = time.time() + 20
    while not os.path.exists("release") and time.time() < deadline:  # the test writes it
        time.sleep(0.05)
    return {"scratch": os.environ["HOME"]}


def snoop(task):
    """Look for the other rollout's scratch directory beside this one's."""
    parent = os.path.dirname(os.environ["HOME"])
    found = {"parent": parent, "listed": attempt(os.listdir, parent)}
    found["other"] = attempt(read, os.path.join(task["other_scratch"], "work", "secret.txt"))
    return found


PROBES = {
    f.__name__: f
    for f in (credentials, fork_bomb, memory_hog, giant_file, cpu_spin, write_outside, limits, hold, snoop)
}


def main():
    with open(os.environ["AGENTBOLT_TASK_FILE"]) as f:
        task = json.load(f)
    name = task["probe"]
    found = PROBES[name](task) if name in PROBES else {"ok": True}
    print(json.dumps({"probe": name, "found": found}))
    sys.stdout.flush()
    with open(os.environ["AGENTBOLT_RESULT_FILE"], "w") as f:
        json.dump({"reward": 1}, f)


main()
