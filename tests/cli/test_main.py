"""The agentbolt command line: real server, clear messages on bad input, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentbolt.schemas import AttemptStatus, EventCreate, RolloutCreate, Task

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "agentbolt", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_lists_every_command():
    out = cli("--help").stdout
    for command in (
        "server",
        "runner",
        "eval",
        "rollouts",
        "workers",
        "demo",
        "model",
        "export",
        "judge",
        "review",
    ):
        assert command in out, command


def test_rollouts_list_and_show(server, client):
    [ro] = client.enqueue([RolloutCreate(task=Task(id="t-show", data={"q": "hi"}))])
    claim = client.dequeue("w")
    llm = {
        "endpoint": "chat.completions",
        "request": {"messages": [{"role": "user", "content": "2+2?"}]},
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "four"},
                "token_ids": [1, 2],
                "logprobs": [-0.1, -0.2],
            }
        ],
        "prompt_token_ids": [5, 6, 7],
        "latency_ms": 12.5,
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    client.add_events(
        claim.attempt.id,
        [
            EventCreate(sequence=0, type="llm_call", data=llm),
            EventCreate(sequence=1, type="reward", data={"value": 0.5}),
        ],
    )
    client.finish(claim.attempt.id, AttemptStatus.SUCCEEDED, 0.5)
    listed = cli("rollouts", "list", "--server", server.url)
    assert listed.returncode == 0 and ro.id in listed.stdout and "succeeded" in listed.stdout
    shown = cli("rollouts", "show", ro.id, "--server", server.url)
    assert shown.returncode == 0, shown.stderr
    assert "four" in shown.stdout and "12" in shown.stdout and "0.5" in shown.stdout


def test_workers_list_and_revoke(server, client):
    from agentbolt.client import Client

    with Client(server.url) as runner:
        registration = runner.register_worker("cli-host")
    assert registration is not None
    worker_id = registration.worker_id
    listed = cli("workers", "list", "--server", server.url)
    assert listed.returncode == 0 and worker_id in listed.stdout
    revoked = cli("workers", "revoke", worker_id, "--server", server.url)
    assert revoked.returncode == 0 and f"worker {worker_id} revoked at" in revoked.stdout
    assert client.list_workers()[0].revoked_at is not None
    missing = cli("workers", "revoke", "nobody-0", "--server", server.url)
    assert missing.returncode == 1 and "'nobody-0' not found" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_eval_runs_an_agent_file_on_a_task_file(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "q": str(i), "reward": 0.5}) for i in range(4)))
    done = cli("eval", "--agent", f"{AGENTS}:echo", "--val", str(tasks), "--runners", "1", "--prompt", "P:")
    assert done.returncode == 0, done.stderr
    assert "0.500" in done.stdout and "4" in done.stdout


def test_bad_input_gives_one_clear_message(tmp_path):
    missing = cli("eval", "--agent", f"{AGENTS}:echo", "--val", str(tmp_path / "nope.jsonl"))
    assert (
        missing.returncode != 0 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json")
    broken = cli("eval", "--agent", f"{AGENTS}:echo", "--val", str(bad))
    assert broken.returncode != 0 and "not JSON" in broken.stderr and "Traceback" not in broken.stderr
    spec = cli("runner", "--agent", "no_colon_here", "--server", "http://127.0.0.1:9")
    assert spec.returncode != 0 and "module:object" in spec.stderr and "Traceback" not in spec.stderr
    both = cli(
        "runner",
        "--command",
        "true",
        "--kubernetes",
        "job.yaml",
        "--ray",
        "local",
        "--server",
        "http://127.0.0.1:9",
    )
    assert (
        both.returncode != 0
        and "cannot be combined with --ray" in both.stderr
        and "Traceback" not in both.stderr
    )
    down = cli("rollouts", "list", "--server", "http://127.0.0.1:9")
    assert down.returncode != 0 and "failed after" in down.stderr and "Traceback" not in down.stderr


def test_a_store_that_cannot_be_opened_is_one_clear_message(tmp_path):
    (tmp_path / "notdb.db").write_text("this is not a database")
    for db, words in [
        (
            str(tmp_path / "no" / "such" / "folder" / "x.db").replace(str(tmp_path), "/proc/none"),
            "cannot open",
        ),
        (str(tmp_path / "notdb.db"), "not a database"),
        ("postgresql://postgres@127.0.0.1:9/test", "cannot connect to PostgreSQL"),
    ]:
        run = cli("server", "--db", db, "--port", "0", timeout=60)
        assert run.returncode == 1 and words in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert "agentbolt server on" not in run.stdout  # no banner for a server that never started
    assert (tmp_path / "notdb.db").read_text() == "this is not a database"  # left as it was


def test_consoles_writing_to_a_log_are_wide_enough_for_the_training_tables(monkeypatch):
    from agentbolt.console import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console().width == LOG_WIDTH  # pytest captures output: not a terminal
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100
