"""Program agents (any executable as an agent) against a real server and a real Runner: what
the program is given, where its reward comes from, and each kind of bad input ending with a
clear error on its attempt while the runner goes on."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.runner.program import Program, ProgramRun
from agentbolt.runner.program_io import CappedOutput, ProgramFailed, render, secret_free_environ
from agentbolt.runner.worker import Runner
from agentbolt.schemas import LLM, AttemptStatus, RolloutCreate, RolloutStatus, Task
from agentbolt.server import Role, ServerConfig, ServerThread

PROGRAMS = Path(__file__).parent / "programs"
PY = sys.executable
GOOD = {"cmd": "sh", "script": 'echo 0.5 > "$AGENTBOLT_RESULT_FILE"'}


def _run(runner: Runner, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(runner.run(), timeout))


def _enqueue(client: Client, datas, **kw):
    return client.enqueue([RolloutCreate(task=Task(data=d), **kw) for d in datas])


def _runner(agent, url: str, n: int, **kw) -> Runner:
    """A runner that stops after ``n`` rollouts and does not long-poll once they are done."""
    return Runner(agent, url, max_rollouts=n, poll_wait=0.2, **kw)


def _events(client: Client, rollout_id: str, type: str):
    return [e.data for e in client.all_events(rollout_id) if e.type == type]


def _named_rewards(client: Client, rollout_id: str) -> dict[str, float]:
    return {d["name"]: d["value"] for d in _events(client, rollout_id, "reward") if "name" in d}


def _gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


# ---------------------------------------------------------------------- what a program is given


def test_program_is_given_the_task_the_gateway_and_its_ids(server, client, tmp_path):
    client.publish_resources({"llm": LLM(base_url="http://127.0.0.1:9/v1", model="tiny-model")})
    out = tmp_path / "given.json"
    data = {"question": "what is 2+2?", "meta": {"k": [1, 2]}, "n": 3}
    [ro] = _enqueue(client, [data])
    program = Program(
        [PY, str(PROGRAMS / "report_env.py"), str(out), "--q={question}", "{meta}", "{n}"],
        stdin=True,
        env={"QUESTION": "Q: {question}"},
    )
    _run(_runner(program, server.url, 1))
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward == 1.0
    given = json.loads(out.read_text())
    [attempt] = client.list_attempts(ro.id)
    assert given["argv"][1:] == ["--q=what is 2+2?", '{"k": [1, 2]}', "3"]
    env = given["env"]
    assert env["OPENAI_BASE_URL"] == f"{server.url}/gateway/{ro.id}/{attempt.id}/v1"
    assert env["OPENAI_MODEL"] == env["AGENTBOLT_MODEL"] == "tiny-model"
    assert env["AGENTBOLT_ROLLOUT_ID"] == ro.id and env["AGENTBOLT_ATTEMPT_ID"] == attempt.id
    assert env["AGENTBOLT_TASK_ID"] == rollout.task.id
    assert env["AGENTBOLT_EVENTS_URL"] == f"{server.url}/agent/{ro.id}/{attempt.id}/events"
    assert env["QUESTION"] == "Q: what is 2+2?"
    assert given["task"] == data and json.loads(given["stdin"]) == data
    assert given["cwd_files"] == [] and Path(given["cwd"]).name == "work"
    assert not Path(given["cwd"]).parent.exists()  # the scratch directory is removed afterwards
    assert _named_rewards(client, ro.id) == {"result_file": 1.0}
    assert _events(client, ro.id, "program_result") == [{"content": {"reward": 1.0, "note": "all given"}}]
    [stdout] = [d for d in _events(client, ro.id, "message") if d["role"] == "stdout"]
    assert stdout["content"] == "reported\n" and stdout["cut_bytes"] == 0
    [ended] = _events(client, ro.id, "program_exit")
    assert ended["exit_code"] == 0 and ended["timed_out"] is False


@pytest.fixture
def guarded(tmp_path):
    """A server with tokens: an admin's, and the runner token a runner is started with."""
    tokens = {"admin-token-0123456789": Role.ADMIN, "runner-token-0123456789": Role.RUNNER}
    config = ServerConfig(db=str(tmp_path / "s.db"), tokens=tokens, sweep_interval=0.1)
    with ServerThread(config) as srv, Client(srv.url, "admin-token-0123456789") as admin:
        yield srv, admin


def _report_env(url: str, out: Path, token: str) -> tuple[dict, Runner]:
    program = Program([PY, str(PROGRAMS / "report_env.py"), str(out)])
    runner = _runner(program, url, 1, token=token)
    _run(runner)
    return json.loads(out.read_text())["env"], runner


def test_the_runner_token_never_reaches_the_program(guarded, tmp_path, monkeypatch):
    srv, admin = guarded
    token = "runner-token-0123456789"
    for name, value in [
        ("AGENTBOLT_TOKEN", token),
        ("AGENTBOLT_RUNNER_TOKEN", token),
        ("SOME_COPY", token),
        ("AUTH_HEADER", f"Bearer {token}"),
        ("HARMLESS", "kept"),
    ]:
        monkeypatch.setenv(name, value)
    admin.publish_resources({"llm": LLM(base_url="http://127.0.0.1:9/v1", model="m")})
    [ro] = _enqueue(admin, [{}])
    env, runner = _report_env(srv.url, tmp_path / "given.json", token)
    assert admin.get_rollout(ro.id).status == RolloutStatus.SUCCEEDED
    assert not [k for k, v in env.items() if token in v]
    worker_token = runner.client.token or ""
    assert worker_token.startswith("wt_") and not [k for k, v in env.items() if worker_token in v]
    assert not {"AGENTBOLT_TOKEN", "AGENTBOLT_RUNNER_TOKEN", "SOME_COPY", "AUTH_HEADER"} & set(env)
    assert env["HARMLESS"] == "kept" and env["OPENAI_API_KEY"]


def test_the_program_holds_its_own_attempt_key(guarded, tmp_path):
    srv, admin = guarded
    admin.publish_resources({"llm": LLM(base_url="http://127.0.0.1:9/v1", model="m")})
    _enqueue(admin, [{}])
    env, _ = _report_env(srv.url, tmp_path / "given.json", "runner-token-0123456789")
    assert env["OPENAI_API_KEY"].startswith("ak_") and len(env["OPENAI_API_KEY"]) == 35


# ---------------------------------------------------------------------- where the reward comes from


def test_each_chosen_source_is_recorded_and_the_first_present_wins(server, client):
    seen: list[ProgramRun] = []

    def scorer(run: ProgramRun) -> float:
        seen.append(run)
        return 0.75 if (run.workdir / "made.txt").read_text() == "made\n" else 0.0

    script = 'echo 42; echo made > made.txt; echo \'{{"reward": 0.5}}\' > "$AGENTBOLT_RESULT_FILE"'
    [ro] = _enqueue(client, [{"x": 1}])
    program = Program(["sh", "-c", script], scorer=scorer, reward_from="result_file,scorer")
    _run(_runner(program, server.url, 1))
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward == 0.5
    assert _named_rewards(client, ro.id) == {"result_file": 0.5, "scorer": 0.75}
    assert _events(client, ro.id, "reward_claim") == []
    [run] = seen
    assert run.stdout == "42\n" and run.task.data == {"x": 1} and run.result == {"reward": 0.5}
    assert run.exit_code == 0 and run.llm_calls == []


def test_with_a_scorer_the_scorer_alone_gives_the_reward_and_the_rest_is_a_claim(server, client):
    script = 'echo \'{{"reward": 0.5}}\' > "$AGENTBOLT_RESULT_FILE"'
    [ro] = _enqueue(client, [{"x": 1}])
    _run(_runner(Program(["sh", "-c", script], scorer=lambda run: 0.75), server.url, 1))
    assert client.get_rollout(ro.id).reward == 0.75
    assert _named_rewards(client, ro.id) == {"scorer": 0.75}
    claim = {"name": "result_file", "value": 0.5, "reward": 0.75, "disputed": True}
    assert _events(client, ro.id, "reward_claim") == [claim]


def test_reward_from_is_checked_when_the_program_is_made():
    with pytest.raises(ConfigError, match="no scorer"):
        Program("true", reward_from="scorer")
    with pytest.raises(ConfigError, match="choose from program, result_file, scorer"):
        Program("true", reward_from="program,grade")
    with pytest.raises(ConfigError, match="named twice"):
        Program("true", reward_from=["program", "program"])
    assert Program("true", scorer=lambda run: 1).reward_from == ("scorer",)
    assert Program("true").reward_from == ("program", "result_file")
    assert Program("true", reward_from=" result_file , program").reward_from == ("result_file", "program")


def test_a_scorer_command_reads_the_run_on_stdin(server, client):
    score = (
        "import json, sys; run = json.load(sys.stdin); "
        "print('thinking'); "
        "print(1.0 if run['stdout'] == 'answer-' + str(run['task']['data']['n']) + '\\n' else 0.0)"
    )
    ros = _enqueue(client, [{"n": 1}, {"n": 2}])
    program = Program("sh -c 'echo answer-{n}'", scorer_command=[PY, "-c", score])
    _run(_runner(program, server.url, 2))
    for ro in ros:
        assert client.get_rollout(ro.id).reward == 1.0
        assert _named_rewards(client, ro.id) == {"scorer": 1.0}


def test_rewards_posted_to_the_events_url_come_first(server, client):
    body = json.dumps([{"reward": 0.25, "name": "mine"}, {"type": "reward", "data": {"value": 0.5}}])
    [ro] = _enqueue(client, [{"body": body}])
    chosen = "program,result_file,scorer"
    program = Program([PY, str(PROGRAMS / "post_events.py")], scorer=lambda run: 0.9, reward_from=chosen)
    _run(_runner(program, server.url, 1))
    rollout = client.get_rollout(ro.id)
    [stdout] = [d["content"] for d in _events(client, ro.id, "message") if d["role"] == "stdout"]
    assert stdout.startswith("200"), stdout
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward == 0.75
    assert _named_rewards(client, ro.id) == {"mine": 0.25, "program": 0.75, "scorer": 0.9}


def test_no_reward_fails_the_attempt_unless_it_comes_later(server, client):
    [failed] = _enqueue(client, [{}])
    runner = _runner(Program(["true"]), server.url, 1)
    _run(runner)
    rollout = client.get_rollout(failed.id)
    assert rollout.status == RolloutStatus.FAILED and "no reward" in (rollout.error or "")
    assert runner.failed == 1
    [later] = _enqueue(client, [{}])
    _run(_runner(Program(["true"], reward_later=True), server.url, 1))
    rollout = client.get_rollout(later.id)
    assert rollout.status == RolloutStatus.SUCCEEDED and rollout.reward is None


# ---------------------------------------------------------------------- bad input

BAD_INPUT = {
    "command not found": (
        {"cmd": "agentbolt-no-such-command", "script": ""},
        "command not found: 'agentbolt-no-such-command'",
        "CommandNotFound",
    ),
    "exits non-zero": (
        {"cmd": "sh", "script": "echo 'it broke right here' >&2; exit 3"},
        "exited with code 3; stderr ends: it broke right here",
        "ProgramExit",
    ),
    "hangs past its timeout": ({"cmd": "sh", "script": "sleep 60"}, "ran past its timeout", "Timeout"),
    "writes a malformed result file": (
        {"cmd": "sh", "script": 'echo "{not json" > "$AGENTBOLT_RESULT_FILE"'},
        "the result file (AGENTBOLT_RESULT_FILE) is not JSON",
        "MalformedResult",
    ),
    "a NaN reward in the result file": (
        {"cmd": "sh", "script": 'echo \'{"reward": NaN}\' > "$AGENTBOLT_RESULT_FILE"'},
        "holds reward nan, not a finite number",
        "InvalidReward",
    ),
    "a field the task lacks": ({"cmd": "sh"}, "the task has no field 'script'", "TaskField"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_its_attempt_clearly_and_the_runner_goes_on(server, client, case):
    data, error, kind = BAD_INPUT[case]
    bad, good = _enqueue(client, [data, GOOD], max_attempts=2)
    runner = _runner(Program(["{cmd}", "-c", "{script}"], timeout=1.5), server.url, 2, concurrency=2)
    started = time.monotonic()
    _run(runner)
    assert time.monotonic() - started < 20
    rollout = client.get_rollout(bad.id)
    assert rollout.status == RolloutStatus.FAILED and error in (rollout.error or ""), rollout.error
    assert [a.status for a in client.list_attempts(bad.id)] == [AttemptStatus.FAILED]
    [exception] = _events(client, bad.id, "exception")
    assert exception["type"] == kind and error in exception["message"]
    assert client.get_rollout(good.id).reward == 0.5 and runner.completed == 1 and runner.failed == 1
    assert _named_rewards(client, good.id) == {"result_file": 0.5}


def test_megabytes_of_output_are_recorded_cut(server, client):
    script = (
        "head -c 5000000 /dev/zero | tr '\\0' o; head -c 3000000 /dev/zero | tr '\\0' e >&2; "
        'echo 1 > "$AGENTBOLT_RESULT_FILE"'
    )
    [ro] = _enqueue(client, [{}])
    _run(_runner(Program(["sh", "-c", script]), server.url, 1))
    assert client.get_rollout(ro.id).reward == 1.0
    outputs = {d["role"]: d for d in _events(client, ro.id, "message")}
    assert outputs["stdout"]["bytes"] == 5_000_000 and outputs["stderr"]["bytes"] == 3_000_000
    assert outputs["stdout"]["cut_bytes"] == 5_000_000 - 65536
    for output in outputs.values():
        text = output["content"]
        assert len(text) < 66_000 and f"[… {output['cut_bytes']} bytes cut …]" in text


def test_a_nan_reward_through_the_events_url_is_refused(server, client):
    [bad, good] = _enqueue(client, [{"body": '{"reward": NaN}'}, {"body": '{"reward": 0.5}'}])
    _run(_runner(Program([PY, str(PROGRAMS / "post_events.py")]), server.url, 2, concurrency=2))
    rollout = client.get_rollout(bad.id)
    [stdout] = [d["content"] for d in _events(client, bad.id, "message") if d["role"] == "stdout"]
    assert stdout.startswith("422"), stdout
    assert rollout.status == RolloutStatus.FAILED and "no reward" in (rollout.error or "")
    assert client.get_rollout(good.id).reward == 0.5


def test_events_posted_for_another_attempt_are_forbidden(server, client):
    other = _enqueue(client, [{}])[0]
    [bad] = _enqueue(client, [{"body": '{"reward": 1}', "url": f"{server.url}/agent/{other.id}/at-x/events"}])
    _run(_runner(Program([PY, str(PROGRAMS / "post_events.py")]), server.url, 2, concurrency=2))
    [stdout] = [d["content"] for d in _events(client, bad.id, "message") if d["role"] == "stdout"]
    assert stdout.startswith("403"), stdout
    rollout = client.get_rollout(bad.id)
    assert rollout.status == RolloutStatus.FAILED and "no reward" in (rollout.error or "")
    assert _events(client, other.id, "reward") == []  # nothing reached the other rollout


# ---------------------------------------------------------------------- processes


def test_a_timeout_kills_the_whole_process_group(server, client, tmp_path):
    pidfile = tmp_path / "grandchild"
    [ro] = _enqueue(client, [{}])
    program = Program([PY, str(PROGRAMS / "leaves_grandchild.py"), str(pidfile), "hang"], timeout=1.5)
    _run(_runner(program, server.url, 1))
    rollout = client.get_rollout(ro.id)
    assert rollout.status == RolloutStatus.FAILED and "ran past its timeout" in (rollout.error or "")
    _wait_until(lambda: _gone(int(pidfile.read_text())), 5)
    [ended] = _events(client, ro.id, "program_exit")
    assert ended["timed_out"] is True and ended["exit_code"] == -signal.SIGTERM


def test_a_finished_program_leaves_nothing_running(server, client, tmp_path):
    pidfile = tmp_path / "grandchild"
    [ro] = _enqueue(client, [{}])
    program = Program([PY, str(PROGRAMS / "leaves_grandchild.py"), str(pidfile), "exit"], timeout=30)
    _run(_runner(program, server.url, 1))
    assert client.get_rollout(ro.id).reward == 0.5
    _wait_until(lambda: _gone(int(pidfile.read_text())), 5)


def test_the_runner_runs_its_concurrency_of_programs_at_once(server, client, tmp_path):
    script = 'date +%s.%N > {dir}/{i}.start; sleep 1.5; date +%s.%N > {dir}/{i}.end; echo 1 > "$AGENTBOLT_RESULT_FILE"'
    _enqueue(client, [{"dir": str(tmp_path), "i": i} for i in range(4)])
    runner = _runner(Program(["sh", "-c", script]), server.url, 4, concurrency=4)
    _run(runner)
    assert runner.completed == 4
    starts = [float((tmp_path / f"{i}.start").read_text()) for i in range(4)]
    ends = [float((tmp_path / f"{i}.end").read_text()) for i in range(4)]
    assert max(starts) < min(ends)  # all four ran at the same time


def _cli_runner(url: str, *args: str) -> subprocess.Popen:
    cmd = [PY, "-m", "agentbolt", "runner", "--server", url, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_sigterm_stops_the_programs_and_releases_their_attempts(server, client, tmp_path):
    ros = _enqueue(client, [{"pidfile": str(tmp_path / f"p{i}")} for i in range(2)], max_attempts=1)
    command = f"{PY} {PROGRAMS / 'leaves_grandchild.py'} {{pidfile}} hang"
    proc = _cli_runner(server.url, "--command", command, "--concurrency", "2")
    try:
        _wait_until(lambda: all((tmp_path / f"p{i}").exists() for i in range(2)))
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # the second one releases at once
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    for i, ro in enumerate(ros):
        _wait_until(lambda i=i: _gone(int((tmp_path / f"p{i}").read_text())), 5)
        rollout = client.get_rollout(ro.id)
        assert rollout.status == RolloutStatus.QUEUED and rollout.attempts == 0
        assert client.list_attempts(ro.id)[0].status == AttemptStatus.RELEASED


def test_the_runner_command_takes_exactly_one_agent(server):
    for args, said in [
        (["--agent", "x:y", "--command", "true"], "exactly one of --agent"),
        ([], "exactly one of --agent"),
        (["--command", "true", "--env", "NOEQUALS"], "must look like NAME=TEMPLATE"),
        (["--command", "echo {"], "bad template"),
    ]:
        done = subprocess.run(
            [PY, "-m", "agentbolt", "runner", "--server", server.url, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and said in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_the_runner_command_runs_a_program(server, client):
    ros = _enqueue(client, [{"r": 0.25}, {"r": 0.5}])
    command = "sh -c 'echo $R > \"$AGENTBOLT_RESULT_FILE\"'"
    proc = _cli_runner(server.url, "--command", command, "--env", "R={r}", "--max-rollouts", "2")
    try:
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert sorted(client.get_rollout(r.id).reward for r in ros) == [0.25, 0.5]


def test_the_runner_command_takes_a_scorer_and_the_task_on_stdin(server, client):
    [ro] = _enqueue(client, [{"word": "abc"}])
    scorer = f"{PROGRAMS / 'scoring.py'}:first_line_length"
    args = ["--command", "cat", "--stdin", "--scorer", scorer, "--max-rollouts", "1"]
    proc = _cli_runner(server.url, *args)
    try:
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert client.get_rollout(ro.id).reward == len('{"word": "abc"}')
    assert _named_rewards(client, ro.id) == {"scorer": 15.0}


# ---------------------------------------------------------------------- worker identity


def test_the_runner_takes_the_identity_the_server_issues(server, client):
    """A server that issues worker identities gives one at start; an older one (404) leaves
    the runner with its own id and token, working as before."""
    issues = "/api/workers/register" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    [ro] = _enqueue(client, [GOOD])
    runner = _runner(Program(["{cmd}", "-c", "{script}"]), server.url, 1, worker_id="my-runner")
    _run(runner)
    assert client.get_rollout(ro.id).reward == 0.5
    assert client.list_attempts(ro.id)[0].worker_id == runner.worker_id
    if issues:
        assert runner.worker_id != "my-runner" and (runner.client.token or "").startswith("wt_")
    else:
        assert runner.worker_id == "my-runner" and runner.client.token is None


# ---------------------------------------------------------------------- the parts


def test_templates_fill_task_fields_and_refuse_what_no_task_could_fill():
    assert render("{a}-{b[c]}-{{x}}", {"a": 1, "b": {"c": "d"}}, "w") == "1-d-{x}"
    assert render("{flag}", {"flag": True}, "w") == "true"
    with pytest.raises(ProgramFailed, match="no field 'b'"):
        render("{b}", {"a": 1}, "w")
    for bad in ("{", "{}", "{0}"):
        with pytest.raises(ConfigError):
            Program(["echo", bad])
    with pytest.raises(ConfigError, match="cannot be split"):
        Program("echo 'unclosed")
    with pytest.raises(ConfigError, match="only one of scorer"):
        Program("true", scorer=lambda run: 1.0, scorer_command="echo 1")


def test_the_environment_loses_every_variable_holding_a_secret():
    environ = {
        "A": "x",
        "B": "pre-secret-value-post",
        "C": "secret-value",
        "AGENTBOLT_TOKEN": "other",
        "D": "t",
    }
    assert secret_free_environ(environ, ["secret-value", "t"]) == {"A": "x"}


def test_capped_output_keeps_the_start_and_the_end():
    out = CappedOutput(10)
    for chunk in (b"abc", b"defgh", b"ijklmnop", b"qrstuvwxyz"):
        out.add(chunk)
    assert out.total == 26 and out.cut == 16
    assert out.text() == "abcde\n[… 16 bytes cut …]\nvwxyz"
    small = CappedOutput(10)
    small.add(b"0123456789")
    assert small.text() == "0123456789" and small.cut == 0
