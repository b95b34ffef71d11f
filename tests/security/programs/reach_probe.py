"""A hostile program agent: it tries to read the runner's token by one path (argv[1]) and
prints what it found as one JSON line. It does not know the token: like an attacker, it picks
out what looks like one (a token variable's value, the argument after a token flag, the text
after "Bearer " in memory). Its reward file says it ran; the test judges what it printed.

Paths: environ (its own), ppid_environ, ppid_cmdline, ppid_mem, scan_proc (every other
process in /proc: environ, cmdline, memory), token_file (argv[2]), caps (who it runs as),
noop. ``PROBE_TARGET`` names the process to read instead of the parent (the probe's own test).
"""

import json
import os
import re
import sys

FLAGS = {"--token", "--runner-token", "--reader-token", "--evaluator-token"}
MEMORY_LIMIT = 256 << 20  # bytes read from one process's memory at most
MARKERS = re.compile(rb"(?:Bearer |AGENTBOLT_(?:RUNNER_)?TOKEN=)([!-~]{1,80})")


def attempt(report, what, read):
    try:
        return read()
    except OSError as exc:
        report["denied"].append(f"{what}: {type(exc).__name__}: {exc.strerror}")
        return None


def from_environ(raw):
    entries = [e.decode(errors="replace") for e in raw.split(b"\0") if e]
    return [
        e.partition("=")[2] for e in entries if "TOKEN" in e.partition("=")[0] or "KEY" in e.partition("=")[0]
    ]


def from_cmdline(raw):
    args = [a.decode(errors="replace") for a in raw.split(b"\0")]
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a in FLAGS]
    return found + [a.partition("=")[2] for a in args if a.partition("=")[0] in FLAGS and "=" in a]


def from_memory(pid):
    found = set()
    total = 0
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if total + end - start > MEMORY_LIMIT:
                break
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except OSError:
                continue
            total += len(chunk)
            found.update(m.group(1).decode(errors="replace") for m in MARKERS.finditer(chunk))
    return sorted(found)[:40], total


def read(path):
    with open(path, "rb") as f:
        return f.read()


def probe(kind, report):
    target = int(os.environ.get("PROBE_TARGET") or os.getppid())
    report["target"] = target
    if kind == "environ":
        report["environ"] = dict(os.environ)
        report["found"] = from_environ(read("/proc/self/environ"))
        report["found"] += [v for k, v in os.environ.items() if "TOKEN" in k]
    elif kind == "ppid_environ":
        raw = attempt(report, "environ", lambda: read(f"/proc/{target}/environ"))
        if raw is not None:
            report["read"].append("environ")
            report["found"] = from_environ(raw)
    elif kind == "ppid_cmdline":
        raw = attempt(report, "cmdline", lambda: read(f"/proc/{target}/cmdline"))
        if raw is not None:
            report["read"].append("cmdline")
            report["cmdline"] = raw.decode(errors="replace").split("\0")
            report["found"] = from_cmdline(raw)
    elif kind == "ppid_mem":
        got = attempt(report, "mem", lambda: from_memory(target))
        if got is not None:
            report["read"].append(f"mem ({got[1]} bytes)")
            report["found"] = got[0]
    elif kind == "scan_proc":
        me = os.getpid()
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid == me:
                continue
            for name, how in (
                ("environ", lambda p=pid: from_environ(read(f"/proc/{p}/environ"))),
                ("cmdline", lambda p=pid: from_cmdline(read(f"/proc/{p}/cmdline"))),
                ("mem", lambda p=pid: from_memory(p)[0]),
            ):
                try:
                    found = how()
                except OSError:
                    continue
                report["read"].append(f"{pid}/{name}")
                report["found"] += found
        report["read"] = report["read"][:10] + [f"... {len(report['read'])} in all"]
    elif kind == "token_file":
        raw = attempt(report, "token file", lambda: read(sys.argv[2]))
        if raw is not None:
            report["read"].append("token file")
            report["found"] = [raw.decode(errors="replace").strip()]
    elif kind == "caps":
        status = read("/proc/self/status").decode()
        report["status"] = {
            k: v.strip()
            for k, _, v in (line.partition(":") for line in status.splitlines())
            if k in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapAmb")
        }


def main():
    kind = sys.argv[1]
    report = {"probe": kind, "read": [], "denied": [], "found": []}
    probe(kind, report)
    print(json.dumps(report))
    with open(os.environ["AGENTBOLT_RESULT_FILE"], "w") as f:
        json.dump({"reward": 1}, f)


main()
