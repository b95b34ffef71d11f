"""The light install (``pip install agentbolt``, no extras) is the client, the runner and the
agent API: importing them, or starting a runner, loads no server or training code, and what
needs an extra says which one to install instead of failing with an ImportError traceback.

Each check runs in a fresh interpreter (``sys.modules`` of this one holds everything). The light
install is simulated by an import hook that refuses the extras' modules, as if they were absent;
scripts/light_install_check.sh checks a real one in CI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentbolt.client import Client
from agentbolt.schemas import RolloutCreate, Task
from agentbolt.server.run import free_port, wait_healthy

ROOT = Path(__file__).parents[1]
# What must never load without need: the server's and the trainer's dependencies.
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "psycopg")
TRAIN_MODULES = ("torch", "transformers", "peft", "safetensors", "gguf", "numpy", "matplotlib")
# Everything the server, postgres, train and export extras bring.
EXTRA_MODULES = ("fastapi", "starlette", "uvicorn", "psycopg", "psycopg_pool", *TRAIN_MODULES, "datasets")
ABSENT = """
import sys

class _Absent:
    \"\"\"Refuses some installed modules as if they were not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {refused!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


def environment(absent_dir: Path | None = None, absent: tuple[str, ...] = EXTRA_MODULES) -> dict[str, str]:
    """Variables for a subprocess that runs this checkout; with ``absent_dir`` (where a
    sitecustomize.py goes), as if the ``absent`` modules (by default the extras') were missing."""
    paths = [str(ROOT)]
    if absent_dir:
        (absent_dir / "sitecustomize.py").write_text(ABSENT.format(refused=absent))
        paths.insert(0, str(absent_dir))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "COLUMNS": "200"}


def python(*args: str, **absent: Any) -> subprocess.CompletedProcess:
    env = environment(**absent)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def loaded(importtime: str) -> set[str]:
    """Top-level modules named by ``python -X importtime`` output."""
    return {
        m.group(1).partition(".")[0] for m in re.finditer(r"^import time:.*\|\s+(\S+)$", importtime, re.M)
    }


def test_import_agentbolt_loads_no_server_or_training_code():
    done = python("-c", "import sys, agentbolt; print(' '.join(sorted(sys.modules)))")
    assert done.returncode == 0, done.stderr
    modules = {m.partition(".")[0] for m in done.stdout.split()}
    assert "agentbolt" in modules
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_runner_help_loads_no_server_or_training_code():
    done = python("-X", "importtime", "-m", "agentbolt", "runner", "--help")
    assert done.returncode == 0, done.stderr
    assert "--max-rollouts" in done.stdout
    modules = loaded(done.stderr)
    assert "agentbolt" in modules and "typer" in modules  # the output was parsed
    assert not modules & set(HEAVY), modules & set(HEAVY)


def test_the_light_install_imports_the_runner_api(tmp_path):
    code = (
        "from agentbolt import Client, LitAgent, Runner, emit_reward, rollout\n"
        "from agentbolt.runner.worker import load_agent\n"
        "print('runner API imported')\n"
        "try:\n"
        "    import torch\n"
        "except ModuleNotFoundError:\n"
        "    print('torch refused')\n"
    )
    done = python("-c", code, absent_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    # ... and the simulation is real: torch, installed here, is refused.
    assert done.stdout.split("\n")[:2] == ["runner API imported", "torch refused"]


@pytest.mark.parametrize(
    ("name", "extra"),
    [("create_app", "server"), ("ServerConfig", "server")],
)
def test_a_name_that_needs_an_extra_raises_one_clear_error(tmp_path, name, extra):
    code = (
        "from agentbolt.errors import AgentboltError, MissingExtra\n"
        "try:\n"
        f"    from agentbolt import {name}\n"
        "except MissingExtra as exc:\n"
        "    assert isinstance(exc, ImportError) and isinstance(exc, AgentboltError)\n"
        "    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)\n"
        "    print(exc)\n"
    )
    done = python("-c", code, absent_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"{name} needs the '{extra}' extra" in done.stdout
    assert f"pip install 'agentbolt[{extra}]'" in done.stdout


# What ``agentbolt.algorithms`` exports, by whether it needs the train extra.
LIGHT_ALGORITHMS = (
    "APO",
    "Algorithm",
    "BatchResult",
    "EvalSummary",
    "Evaluate",
    "TrainContext",
    "run_rollouts",
)
TRAIN_ALGORITHMS = ("GRPO", "SFT")


def test_every_name_of_agentbolt_algorithms_is_sorted_into_light_or_train():
    import agentbolt.algorithms

    assert sorted(agentbolt.algorithms.__all__) == sorted(LIGHT_ALGORITHMS + TRAIN_ALGORITHMS)


def test_the_light_install_imports_the_algorithms_that_need_no_extra(tmp_path):
    code = (
        "import sys\n"
        f"from agentbolt.algorithms import {', '.join(LIGHT_ALGORITHMS)}\n"
        f"loaded = sorted({{m.partition('.')[0] for m in sys.modules}} & {set(EXTRA_MODULES)!r})\n"
        "print('imported', loaded)\n"
    )
    done = python("-c", code, absent_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported []"


@pytest.mark.parametrize("name", TRAIN_ALGORITHMS)
@pytest.mark.parametrize("blocked", ["torch", "transformers", "peft"])
def test_a_training_algorithm_without_the_train_extra_raises_one_clear_error(tmp_path, name, blocked):
    code = (
        "import agentbolt.algorithms\n"  # the package itself imports without the extra
        "from agentbolt.errors import AgentboltError, MissingExtra\n"
        "try:\n"
        f"    from agentbolt.algorithms import {name}\n"
        "except MissingExtra as exc:\n"
        "    assert isinstance(exc, ImportError) and isinstance(exc, AgentboltError)\n"
        "    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)\n"
        "    print(exc)\n"
    )
    done = python("-c", code, absent_dir=tmp_path, absent=(blocked,))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"{name} needs the 'train' extra ({blocked} is not installed): pip install 'agentbolt[train]'"
    )
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr


def test_a_training_algorithm_with_the_train_extra_imports(tmp_path):
    done = python("-c", f"from agentbolt.algorithms import {', '.join(TRAIN_ALGORITHMS)}; print('ok')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


LIGHT_TRAINER = """
import sys

from agentbolt import Evaluate, Trainer, rollout


@rollout
def doubler(task):
    return 1.0 if task.data["x"] * 2 == task.data["y"] else 0.0


tasks = [{"id": f"t{i}", "x": i, "y": 2 * i if i % 2 else 0} for i in range(4)]
trainer = Trainer(Evaluate(timeout=60), server_url=sys.argv[1], n_runners=2, run_dir="run")
summary = trainer.fit(doubler, tasks)
print("result", summary.count, summary.succeeded, summary.mean_reward)
print("loaded", sorted({name.partition(".")[0] for name in sys.modules} & set(sys.argv[2:])))
"""


def test_the_light_install_trains_against_a_server_of_its_own(tmp_path, server):
    """``Trainer(server_url=...)`` only talks to that server: its runner processes (which get
    the same refusing import hook) run every rollout, and no server code is loaded."""
    (tmp_path / "train.py").write_text(LIGHT_TRAINER)
    env = environment(tmp_path)
    done = subprocess.run(
        [sys.executable, "train.py", server.url, *EXTRA_MODULES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "result 4 4 0.75" in done.stdout.splitlines(), done.stdout
    assert "loaded []" in done.stdout.splitlines(), done.stdout


def test_the_light_install_says_the_embedded_server_needs_the_server_extra(tmp_path):
    code = (
        "from agentbolt import Evaluate, Trainer\n"
        "from agentbolt.errors import MissingExtra\n"
        "try:\n"
        "    Trainer(Evaluate(), n_runners=0, run_dir='run').fit(lambda task: 1.0, [{'id': 't'}])\n"
        "except MissingExtra as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "the Trainer's embedded server (no server_url given) needs the 'server' extra" in done.stdout
    assert "pip install 'agentbolt[server]'" in done.stdout


def test_agentbolt_eval_with_a_server_runs_on_the_light_install(tmp_path, server):
    (tmp_path / "agent.py").write_text(
        "from agentbolt import rollout\n\n\n@rollout\ndef agent(task):\n    return task.data['i'] / 10\n"
    )
    (tmp_path / "tasks.json").write_text('[{"id": "a", "i": 1}, {"id": "b", "i": 3}]')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentbolt",
            "eval",
            "--agent",
            "agent.py:agent",
            "--val",
            "tasks.json",
            "--server",
            server.url,
            "--runners",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=environment(tmp_path),
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    with Client(server.url) as client:
        rollouts = client.list_rollouts().items
    assert sorted((r.task.id, r.status.value, r.reward) for r in rollouts) == [
        ("a", "succeeded", 0.1),
        ("b", "succeeded", 0.3),
    ]


@pytest.mark.parametrize(
    ("command", "what", "extras"),
    [
        (["server", "--port", "1"], "agentbolt server", "server"),
        (["eval", "--agent", "a.py:x", "--val", "t.json"], "agentbolt eval", "server"),
        (["demo", "--steps", "1"], "agentbolt demo", "server,train"),
        (["model", "serve"], "agentbolt model serve", "server,train"),
        (["model", "pull", "--offline"], "agentbolt model pull", "train"),
        (["export", "model", "--weights", ".", "--out", "out"], "agentbolt export model", "train"),
    ],
)
def test_a_command_that_needs_an_extra_says_which_and_exits_2(tmp_path, command, what, extras):
    done = python("-m", "agentbolt", *command, absent_dir=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    [line] = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"error: {what} needs the ")
    assert line.endswith(f"pip install 'agentbolt[{extras}]'")


def test_commands_of_the_light_install_still_run(tmp_path):
    done = python(
        "-m", "agentbolt", "rollouts", "list", "--server", "http://127.0.0.1:1", absent_dir=tmp_path
    )
    # No server there: the client's own error, not a missing extra.
    assert "needs the" not in done.stderr and "Traceback" not in done.stderr


def test_a_postgres_store_without_the_postgres_extra_says_so(tmp_path):
    url = "postgresql://127.0.0.1:1/none"
    done = python(
        "-m", "agentbolt", "server", "--db", url, absent_dir=tmp_path, absent=("psycopg", "psycopg_pool")
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        "error: agentbolt server needs the 'postgres' extra (psycopg is not installed): "
        "pip install 'agentbolt[postgres]'"
    ]


def test_the_server_extra_runs_a_server_without_the_training_libraries(tmp_path):
    env = environment(tmp_path, absent=(*TRAIN_MODULES, "psycopg", "psycopg_pool", "datasets"))
    port = free_port()
    command = [sys.executable, "-m", "agentbolt", "server", "--db", ":memory:", "--port", str(port)]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
            with Client(f"http://127.0.0.1:{port}") as client:
                [ro] = client.enqueue([RolloutCreate(task=Task(id="t", data={}))])
                assert client.get_rollout(ro.id).status.value == "queued"
        finally:
            proc.terminate()
            _out, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


def _documented_imports() -> list[str]:
    """Every ``from agentbolt... import ...`` line in README.md and docs/*.md."""
    pattern = re.compile(r"^\s*(from agentbolt[\w.]* import [\w, ]+|import agentbolt[\w.]*)\s*$", re.M)
    found = {
        m.group(1).strip()
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in pattern.finditer(doc.read_text(encoding="utf-8"))
    }
    return sorted(found)


def test_every_documented_import_works_or_names_its_extra_on_the_light_install(tmp_path):
    """One interpreter tries each import line the docs show, as the light install would: it
    imports, or raises MissingExtra naming the extra, never a dependency's ImportError."""
    lines = _documented_imports()
    assert len(lines) >= 10 and "from agentbolt.algorithms import GRPO" in lines  # the docs were read
    code = (
        "import sys, traceback\n"
        "from agentbolt.errors import MissingExtra\n"
        f"for line in {lines!r}:\n"
        "    try:\n"
        "        exec(line, {})\n"
        "        print('ok', line)\n"
        "    except MissingExtra as exc:\n"
        "        print('extra', line, '|', exc)\n"
        "    except BaseException:\n"
        "        print('FAILED', line, '|', traceback.format_exc().replace(chr(10), ' / '))\n"
    )
    done = python("-c", code, absent_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    results = done.stdout.splitlines()
    assert len(results) == len(lines), done.stdout
    failed = [r for r in results if r.startswith("FAILED")]
    assert not failed, failed
    for result in results:
        if result.startswith("extra"):
            assert "pip install 'agentbolt[" in result, result
    # the runner's side of the docs imports as it is; training names its extra
    assert "ok from agentbolt import Program" in results
    assert any(r.startswith("extra from agentbolt.algorithms import GRPO |") for r in results), results
