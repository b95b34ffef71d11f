#!/usr/bin/env bash
# CI: the light install works. `pip install agentbolt` (no extras, built from this checkout, not
# editable) goes into a fresh virtualenv, which must hold neither torch nor FastAPI; its runner
# then runs N rollouts, with tracing on, against a server started from the full .venv, and every
# rollout must succeed with its reward, its events and its spans; then Trainer(server_url=...)
# and `agentbolt eval --server` run against that server. Needs .venv (scripts/install.sh).
#   bash scripts/light_install_check.sh        # N=8 rollouts (LIGHT_CHECK_ROLLOUTS=N to change)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
FULL="$ROOT/.venv/bin"
N="${LIGHT_CHECK_ROLLOUTS:-8}"
WORK="$(mktemp -d)"
SERVER_PID=""
START=$SECONDS

cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
  echo "light install check FAILED: $*" >&2
  if [ -f "$WORK/server.log" ]; then echo "--- server log (last 30 lines)" >&2; tail -30 "$WORK/server.log" >&2; fi
  exit 1
}
step() { echo "light install check [$((SECONDS - START)) s]: $*"; }

[ -x "$FULL/python" ] || fail "no .venv: run scripts/install.sh first"

step "building a virtualenv with agentbolt and no extras"
# Build from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
mkdir "$WORK/src"
tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md agentbolt | tar -xf - -C "$WORK/src"
"${PYTHON:-python3}" -m venv "$WORK/venv" || fail "cannot create a virtualenv"
LIGHT="$WORK/venv/bin"
# The light install runs on its own: nothing from this environment's PYTHONPATH.
light() { env -u PYTHONPATH "$@"; }
light "$LIGHT/python" -m pip install -q "$WORK/src" || fail "pip install agentbolt (no extras) failed"
light "$LIGHT/python" -m pip check || fail "pip check: the light install's dependencies are inconsistent"

# From here on the light venv runs in $WORK, so this checkout's agentbolt/ cannot shadow the
# installed package.
cd "$WORK"
light "$LIGHT/python" - <<'EOF' || fail "the light install holds an extra's package, or agentbolt is not the installed one"
import importlib.util
import agentbolt

assert "site-packages" in agentbolt.__file__, agentbolt.__file__
extras = ["torch", "transformers", "fastapi", "uvicorn", "starlette", "psycopg", "numpy", "matplotlib"]
installed = [m for m in extras if importlib.util.find_spec(m) is not None]
assert not installed, f"installed without extras: {installed}"
EOF
# Every name agentbolt.algorithms exports imports, but GRPO and SFT, which name the train extra.
light "$LIGHT/python" - <<'EOF' || fail "agentbolt.algorithms does not import on the light install as documented"
import agentbolt.algorithms as algorithms
from agentbolt.errors import MissingExtra

train = {"GRPO", "SFT"}
for name in algorithms.__all__:
    try:
        getattr(algorithms, name)
    except MissingExtra as exc:
        assert name in train, f"{name} needs no extra, yet: {exc}"
        said = str(exc)
        assert said.startswith(f"{name} needs the 'train' extra"), said
        assert said.endswith("pip install 'agentbolt[train]'"), said
    else:
        assert name not in train, f"{name} imported without the train extra"
EOF
# Every import line of README.md and docs/ imports, or raises MissingExtra naming its extra.
light "$LIGHT/python" - "$ROOT" <<'EOF' || fail "a documented import fails on the light install"
import pathlib, re, sys
from agentbolt.errors import MissingExtra

root = pathlib.Path(sys.argv[1])
pattern = re.compile(r"^\s*(from agentbolt[\w.]* import [\w, ]+|import agentbolt[\w.]*)\s*$", re.M)
docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
lines = sorted({m.group(1).strip() for doc in docs for m in pattern.finditer(doc.read_text())})
assert len(lines) >= 10, lines
for line in lines:
    try:
        exec(line, {})
    except MissingExtra as exc:
        assert "pip install 'agentbolt[" in str(exc), (line, str(exc))
print(f"{len(lines)} documented imports: each imports or names its extra")
EOF
step "site-packages of the light install: $(du -sh "$WORK/venv/lib/"python3*/site-packages | cut -f1)"

step "starting the server from the full .venv"
PORT="$("$FULL/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
"$FULL/agentbolt" server --db "$WORK/store.db" --port "$PORT" --log-level warning >"$WORK/server.log" 2>&1 &
SERVER_PID=$!

step "enqueueing $N rollouts"
"$FULL/python" - "$URL" "$N" >"$WORK/ids" <<'EOF' || fail "could not reach the server or enqueue"
import sys
import time

from agentbolt.client import Client
from agentbolt.schemas import RolloutCreate, Task

url, n = sys.argv[1], int(sys.argv[2])
with Client(url) as client:
    for _ in range(300):
        try:
            client.health()
            break
        except Exception:
            time.sleep(0.1)
    tasks = [RolloutCreate(task=Task(id=f"light-{i}", data={"i": i})) for i in range(n)]
    for rollout in client.enqueue(tasks):
        print(rollout.id)
EOF

cat >"$WORK/agent.py" <<'EOF'
from agentbolt import Task, emit_message, rollout, span


@rollout
def agent(task: Task) -> float:
    with span("think", i=task.data["i"]):
        emit_message(f"task {task.id}")
    return task.data["i"] / 10
EOF

step "running the light install's runner on them"
light timeout 120 "$LIGHT/agentbolt" runner --agent agent.py:agent --server "$URL" --max-rollouts "$N" \
  --concurrency 4 --tracing >"$WORK/runner.log" 2>&1 || { cat "$WORK/runner.log" >&2; fail "the runner failed"; }

step "checking the rollouts"
"$FULL/python" - "$URL" "$WORK/ids" <<'EOF' || fail "not every rollout succeeded as the agent said"
import sys

from agentbolt.client import Client

url, ids = sys.argv[1], open(sys.argv[2]).read().split()
with Client(url) as client:
    for rollout_id in ids:
        rollout = client.get_rollout(rollout_id)
        i = rollout.task.data["i"]
        assert rollout.status.value == "succeeded", (rollout_id, rollout.status)
        assert rollout.reward == i / 10, (rollout_id, rollout.reward)
        events = client.all_events(rollout_id)
        assert [e.data["content"] for e in events if e.type == "message"] == [f"task light-{i}"], events
        spans = {e.data["name"] for e in events if e.type == "span"}
        assert {"agentbolt.rollout", "think"} <= spans, (rollout_id, spans)
print(f"{len(ids)} rollouts succeeded")
EOF
# ---- Trainer(server_url=...) and `agentbolt eval --server` (no server extra needed) ----
# The Trainer given a server_url only talks to that server: it and its runner processes run on
# the light install; without one, its embedded server says which extra it needs.
step "Trainer(server_url=...).fit on the light install"
light "$LIGHT/python" - "$URL" >"$WORK/trainer.log" 2>&1 <<'EOF' || { cat "$WORK/trainer.log" >&2; fail "Trainer(server_url=...) failed on the light install"; }
import sys

from agentbolt import Evaluate, Trainer, rollout
from agentbolt.errors import MissingExtra


@rollout
def doubler(task):
    return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0


tasks = [{"id": f"trainer-{i}", "x": i, "y": 2 * i if i % 2 else 0} for i in range(4)]
trainer = Trainer(Evaluate(timeout=60), server_url=sys.argv[1], n_runners=2, run_dir="trainer-run")
summary = trainer.fit(doubler, tasks)
assert (summary.count, summary.succeeded, summary.mean_reward) == (4, 4, 0.75), summary
loaded = {name.partition(".")[0] for name in sys.modules} & {"fastapi", "starlette", "uvicorn", "torch"}
assert not loaded, f"the Trainer loaded {loaded}"
try:
    Trainer(Evaluate(), n_runners=0, run_dir="trainer-run").fit(doubler, tasks)
    raise AssertionError("an embedded server started without the server extra")
except MissingExtra as exc:
    assert "needs the 'server' extra" in str(exc), exc
EOF
step "agentbolt eval --server on the light install"
printf '[{"id": "eval-a", "i": 1}, {"id": "eval-b", "i": 3}]' >"$WORK/eval_tasks.json"
light timeout 120 "$LIGHT/agentbolt" eval --agent agent.py:agent --val eval_tasks.json --server "$URL" \
  --runners 1 >"$WORK/eval.log" 2>&1 || { cat "$WORK/eval.log" >&2; fail "agentbolt eval --server failed"; }
"$FULL/python" - "$URL" <<'EOF' || { cat "$WORK/eval.log" >&2; fail "agentbolt eval --server did not run its rollouts"; }
import sys

from agentbolt.client import Client

with Client(sys.argv[1]) as client:
    ended = {r.task.id: (r.status.value, r.reward) for r in client.list_rollouts(limit=1000).items}
assert ended["eval-a"] == ("succeeded", 0.1) and ended["eval-b"] == ("succeeded", 0.3), ended
EOF
# ---- end of the Trainer block ----

step "passed: $N rollouts, Trainer(server_url=...) and agentbolt eval --server run by the light install"
