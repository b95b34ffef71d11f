"""``agentbolt train``: options generated from the algorithm dataclasses and Trainer's parameters,
config files (TOML, YAML) under flags, one clear message for each bad config, and real runs."""

from __future__ import annotations

import dataclasses
import http.server
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbolt.cli.main import app
from agentbolt.cli.options import Setting, dataclass_schema
from agentbolt.cli.train import (
    ALGORITHMS,
    _algorithm_command,
    _sections,
    _settings,
    algorithm_class,
    algorithm_schema,
    program_schema,
    trainer_schema,
)
from agentbolt.errors import ConfigError
from agentbolt.trainer import Trainer

AGENTS = str(Path(__file__).parents[1] / "sample_agents.py")
ROOT = Path(__file__).parents[2]


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "agentbolt", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _expected_keys(cls: type) -> set[str]:
    """Every init field of ``cls``; a dataclass-typed field as its own fields, dotted."""
    keys = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(default)}
        elif f.init:
            keys.add(f.name)
    return keys


def _python_name(setting: Setting) -> str:
    return setting.target or setting.key


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_generated_options_are_the_dataclass_fields(name: str) -> None:
    cls = algorithm_class(name)
    schema = algorithm_schema(cls)
    assert {_python_name(s) for s in schema.settings.values()} | set(schema.python_only) == _expected_keys(
        cls
    )
    # a setting is named as its field, but where the command line names it apart (Evaluate's batch
    # wait, as APO's) or spreads a dataclass field (SFT.train.lr is lr, as GRPO.lr)
    renamed = {s.target: s.key for s in schema.settings.values() if s.target}
    assert renamed == {
        "evaluate": {"timeout": "batch_timeout"},
        "sft": {
            f"train.{k}": k
            for k in (
                "lora",
                "lora_r",
                "lora_alpha",
                "lora_dropout",
                "target_modules",
                "lr",
                "weight_decay",
                "max_grad_norm",
            )
        },
    }.get(name, {})
    # the evaluators come from the reward flags (--judge-rubric, --review), not a generated one
    assert schema.python_only == (("evaluators", "policy") if name == "sft" else ("evaluators",))
    defaults = cls()
    for key, setting in schema.settings.items():
        parent, _, inner = _python_name(setting).rpartition(".")
        value = getattr(getattr(defaults, parent), inner) if parent else getattr(defaults, inner)
        assert setting.default == value, key
    params = _algorithm_command(name).params
    flags = {opt for p in params for opt in p.opts}
    assert {s.flag for s in schema.settings.values()} <= flags
    program_flags = {s.flag for s in program_schema().settings.values() if s.is_bool}
    negations = {opt for p in params for opt in p.secondary_opts if "--" + opt[5:] not in program_flags}
    assert negations == {"--no-" + s.flag[2:] for s in schema.settings.values() if s.is_bool}


def test_the_trainer_options_are_its_parameters() -> None:
    schema = trainer_schema()
    # the reward settings are given as the algorithm's flags, not twice
    rewards = {"reward", "evaluators", "reward_wait"}
    # runners on Ray: Trainer(ray=RayRunners(...)) in Python, `agentbolt runner --ray` beside a run
    params = set(inspect.signature(Trainer.__init__).parameters) - {"self", "algorithm", "ray", *rewards}
    assert {_python_name(s) for s in schema.settings.values()} | set(schema.python_only) == params
    assert schema.python_only == ("console",)
    for setting in schema.settings.values():
        assert (
            setting.default == inspect.signature(Trainer.__init__).parameters[_python_name(setting)].default
        )
    flags = {opt for p in _algorithm_command("evaluate").params for opt in p.opts}
    # named as every other command names them (`agentbolt eval --runners`, `runner --server`)
    assert {"--runners", "--server", "-s", "--concurrency", "-n", "--run-dir"} <= flags
    assert not {"--n-runners", "--server-url", "--runner-concurrency"} & flags


def test_a_program_table_gives_env_and_a_scorer(tmp_path: Path) -> None:
    (tmp_path / "scoring.py").write_text("def score(run):\n    return 0.5\n")
    config = tmp_path / "c.toml"
    config.write_text(f'[program]\nenv = {{Q = "{{q}}"}}\nscorer = "{tmp_path / "scoring.py"}:score"\n')
    program = _resolved("evaluate", "--config", str(config))["program"]
    assert program["env"] == {"Q": "{q}"} and program["scorer"](None) == 0.5
    # the flag replaces the file's variables
    assert _resolved("evaluate", "--config", str(config), "--env", "R=1")["program"]["env"] == {"R": "1"}
    config.write_text("[program]\nscorer = 3\n")
    with pytest.raises(ConfigError, match=r"\[program\] scorer: expected 'module:fn', got 3"):
        _resolved("evaluate", "--config", str(config))


def test_grpo_help_lists_every_field_with_its_default_and_docstring() -> None:
    done = cli("train", "grpo", "--help")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for setting in dataclass_schema(algorithm_class("grpo")).settings.values():
        assert setting.flag in out, setting.key
    assert (
        "Weight of the k3 KL penalty to the initial policy (0: off, no reference pass). [default: 0.0]" in out
    )
    assert "--lora" in out and "--no-lora" in out and "[default: true]" in out
    assert '[default: {"temperature": 1.0}]' in out
    assert "--runners" in out and "Trainer options" in out


def _resolved(name: str, *args: str) -> dict[str | None, dict[str, object]]:
    """The settings ``agentbolt train NAME ARGS`` would run with, by config table."""
    ctx = _algorithm_command(name).make_context(name, list(args))
    return _settings(_sections(algorithm_class(name)), ctx.params)


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        "max_len = 64\nrounds = 5\nlr = 0.5\nlora = false\n"
        "[trainer]\nrunners = 3\nrun_dir = 'a'\n[program]\ntimeout = 9\nstdin = true\n"
    )
    values = _resolved("sft", "--config", str(config), "--rounds", "2", "--runners", "4", "--timeout", "1.5")
    assert values[None] == {"max_len": 64, "rounds": 2, "lr": 0.5, "lora": False}
    assert values["trainer"] == {"runners": 4, "run_dir": "a"}
    assert trainer_schema().kwargs(values["trainer"]) == {"n_runners": 4, "run_dir": "a"}
    assert values["program"] == {"timeout": 1.5, "stdin": True}
    sft = algorithm_class("sft")(**dataclass_schema(algorithm_class("sft")).kwargs(values[None]))
    # SFT.train's fields start from SFT's own default TrainConfig, not TrainConfig()
    assert (sft.train.lr, sft.train.lora, sft.train.lora_r, sft.rounds) == (0.5, False, 16, 2)


def test_the_program_options_are_its_parameters() -> None:
    from agentbolt.runner.program import Program

    schema = program_schema()
    params = set(inspect.signature(Program.__init__).parameters) - {"self", "command", "scorer"}
    assert set(schema.settings) == params and schema.python_only == ()
    assert "seconds before its process group is killed" in schema.settings["timeout"].help
    values = _resolved("evaluate", "--env", "Q={q}", "--env", "N=1", "--no-stdin")
    assert values["program"] == {"env": {"Q": "{q}", "N": "1"}, "stdin": False}
    # --timeout is the program's, as in `agentbolt runner`; Evaluate's batch wait is --batch-timeout
    assert _resolved("evaluate", "--timeout", "5") == {None: {}, "trainer": {}, "program": {"timeout": 5.0}}
    values = _resolved("evaluate", "--batch-timeout", "5")[None]
    assert values == {"batch_timeout": 5.0}
    assert algorithm_schema(algorithm_class("evaluate")).kwargs(values) == {"timeout": 5.0}


def _bad(tmp_path: Path, *args: str, config: str | None = None, suffix: str = ".toml") -> str:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"q": "x"}\n')
    extra = ["--val", str(tasks), "--agent", f"{AGENTS}:echo"]
    if config is not None:
        path = tmp_path / f"config{suffix}"
        path.write_text(config)
        extra += ["--config", str(path)]
    result = CliRunner().invoke(app, ["train", *args, *extra])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    # one message (rich may wrap it over lines at the test terminal's 80 columns)
    message = " ".join(x.strip() for x in result.output.splitlines() if x.strip())
    assert message.startswith("error: ") and message.count("error:") == 1, result.output
    return message


def test_an_unknown_key_is_named_with_the_close_ones(tmp_path: Path) -> None:
    line = _bad(tmp_path, "grpo", config="stepz = 3\n")
    assert "unknown key 'stepz'" in line and "did you mean steps" in line


def test_an_unknown_trainer_key_is_named(tmp_path: Path) -> None:
    line = _bad(tmp_path, "evaluate", config="[trainer]\nrunnerz = 2\n")
    assert "unknown key 'runnerz'" in line and "did you mean runners" in line


def test_a_wrong_type_names_the_key(tmp_path: Path) -> None:
    line = _bad(tmp_path, "grpo", config='steps = "many"\n')
    assert line.startswith("error: steps:") and "integer" in line


def test_a_file_is_not_read_loosely(tmp_path: Path) -> None:
    assert "steps: expected int, got True" in _bad(tmp_path, "grpo", config="steps = true\n")
    assert "lora: expected true or false, got 1" in _bad(tmp_path, "grpo", config="lora = 1\n")


def test_a_spread_field_is_set_at_the_top_level(tmp_path: Path) -> None:
    assert _bad(tmp_path, "sft", config='lr = "fast"\n').startswith("error: lr:")
    # SFT.train's fields are top-level settings, as GRPO's lr: a [train] table names the key
    assert "'train.lr' is named 'lr'" in _bad(tmp_path, "sft", config="[train]\nlr = 0.1\n")


def test_a_wrong_flag_value_names_the_key(tmp_path: Path) -> None:
    assert "steps:" in _bad(tmp_path, "grpo", "--steps", "ten")
    assert "sampling: expected JSON" in _bad(tmp_path, "grpo", "--sampling", "{temperature")


def test_a_bad_file_is_one_message(tmp_path: Path) -> None:
    assert "not valid TOML" in _bad(tmp_path, "evaluate", config="timeout = = 3\n")
    assert "not valid YAML" in _bad(tmp_path, "evaluate", config="timeout: [3\n", suffix=".yaml")
    assert "unknown config format '.ini'" in _bad(tmp_path, "evaluate", config="", suffix=".ini")
    assert "must be a table" in _bad(tmp_path, "evaluate", config="- 1\n", suffix=".yml")
    missing = CliRunner().invoke(app, ["train", "evaluate", "--config", str(tmp_path / "none.toml")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_an_unknown_algorithm_is_one_message(tmp_path: Path) -> None:
    assert _bad(tmp_path, "ppo") == "error: unknown algorithm 'ppo': choose one of evaluate, apo, sft, grpo"


def test_the_agent_is_given_once(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "evaluate", "--val", str(tmp_path)])
    assert result.exit_code == 2 and "exactly one of --agent" in result.output


def test_a_yaml_config_runs_an_evaluation_end_to_end(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "q": "x", "reward": 0.5}\n{"id": "b", "q": "y", "reward": 1.0}\n')
    (tmp_path / "c.yaml").write_text("batch_timeout: 120\ntrainer:\n  runners: 1\n")
    run_dir = tmp_path / "run"
    args = ["--agent", f"{AGENTS}:echo", "--val", str(tasks), "--config", "c.yaml", "--run-dir", str(run_dir)]
    done = cli("train", "evaluate", *args, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    # what Evaluate prints: its summary table (2 rollouts, both succeeded, mean 0.750)
    [row] = [line for line in done.stdout.splitlines() if "│ val" in line]
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[1:6] == ["val", "2", "2", "0", "0.750"], done.stdout
    assert (run_dir / "agentbolt.db").exists()


GRPO_AGENT = """
import openai
from agentbolt import LitAgent


class Vowels(LitAgent):
    async def execute_rollout(self, task):
        llm = self.get_resource("llm")
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0) as c:
            r = await c.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task.data["q"]}], max_tokens=8
            )
        letters = [ch for ch in (r.choices[0].message.content or "").lower() if ch.isalpha()]
        return letters.count("a") / len(letters) if letters else 0.0


agent = Vowels()
"""


def test_grpo_runs_one_step_on_the_tiny_model_from_a_config_file(tmp_path: Path) -> None:
    from agentbolt.engine import tiny_model_dir

    tiny = tiny_model_dir(tmp_path / "tiny")
    (tmp_path / "vowels.py").write_text(textwrap.dedent(GRPO_AGENT))
    tasks = tmp_path / "train.json"
    tasks.write_text(json.dumps([{"id": f"t{i}", "q": f"say {i}"} for i in range(2)]))
    config = f"""
        model = "{tiny}"
        steps = 1
        tasks_per_step = 2
        group_size = 2
        engine_dtype = "float32"
        bf16 = false
        plot = false
        step_timeout = 120
        [trainer]
        concurrency = 4
    """
    (tmp_path / "grpo.toml").write_text(textwrap.dedent(config))
    run_dir = tmp_path / "run"
    args = ["--agent", "vowels.py:agent", "--train", str(tasks), "--config", "grpo.toml"]
    done = cli("train", "grpo", *args, "--run-dir", str(run_dir), "--lr", "0.001", cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GRPO step 1" in done.stdout, done.stdout
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]


PROGRAM = """
import json, os

with open(os.environ["AGENTBOLT_TASK_FILE"]) as f:
    task = json.load(f)
with open(os.environ["AGENTBOLT_RESULT_FILE"], "w") as f:
    json.dump({"reward": float(os.environ["REWARD"]) * task["scale"]}, f)
"""


def test_a_program_agent_is_evaluated_from_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(PROGRAM)
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([{"id": "a", "scale": 1, "r": 0.25}, {"id": "b", "scale": 2, "r": 0.25}]))
    # each rollout runs in its own scratch directory: the script is named by its full path
    args = [
        "--command",
        f"{sys.executable} {tmp_path / 'prog.py'}",
        "--env",
        "REWARD={r}",
        "--val",
        str(tasks),
    ]
    done = cli("train", "evaluate", *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = [line for line in done.stdout.splitlines() if "│ val" in line]
    # rewards 0.25 and 0.5, rendered from each task's fields into the program's variable
    assert [cell.strip() for cell in row.split("│")][1:6] == ["val", "2", "2", "0", "0.375"], done.stdout


def test_train_against_a_running_server_stores_the_rollouts_there(server, client, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "s1", "q": "x", "reward": 0.5}\n')
    args = ["--agent", f"{AGENTS}:echo", "--val", str(tasks), "--server", server.url, "--runners", "1"]
    done = cli("train", "evaluate", *args, "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    [rollout] = client.list_rollouts().items
    assert (rollout.task.id, rollout.status.value, rollout.reward) == ("s1", "succeeded", 0.5)
    # no embedded server was started: its store would be in the run directory
    assert not (tmp_path / "run" / "agentbolt.db").exists()


def test_without_the_train_extra_grpo_says_which_to_install(tmp_path: Path) -> None:
    from tests.test_install import TRAIN_MODULES, python

    done = python("-m", "agentbolt", "train", "grpo", "--help", absent_dir=tmp_path, absent=TRAIN_MODULES)
    assert done.returncode == 2, (done.stdout, done.stderr)
    [line] = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith("error: agentbolt train grpo needs the ") and "(torch is not installed)" in line
    assert line.endswith("pip install 'agentbolt[server,train]'")
    # the algorithms that need no training library still build their options
    apo = python("-m", "agentbolt", "train", "apo", "--help", absent_dir=tmp_path, absent=TRAIN_MODULES)
    assert apo.returncode == 0 and "--beam-width" in apo.stdout, apo.stderr


def test_train_help_lists_the_algorithms_without_loading_torch() -> None:
    from tests.test_install import HEAVY, loaded, python

    done = python("-X", "importtime", "-m", "agentbolt", "train", "--help")
    assert done.returncode == 0, done.stderr
    for name in ALGORITHMS:
        assert name in done.stdout
    modules = loaded(done.stderr)
    assert "typer" in modules  # the import log was parsed
    assert not modules & set(HEAVY), modules & set(HEAVY)


# ---------------------------------------------------------------------------- reward flags


def test_reward_flags_give_the_choice_the_wait_and_reviews(tmp_path: Path) -> None:
    from agentbolt.cli.rewards import evaluators as _evaluators

    values = _resolved("grpo", "--reward", "agent=0.5,judge=0.5", "--reward-wait", "30")
    grpo = algorithm_class("grpo")(**dataclass_schema(algorithm_class("grpo")).kwargs(values[None]))
    assert grpo.reward == {"agent": 0.5, "judge": 0.5} and grpo.reward_wait == 30.0
    config = tmp_path / "c.toml"
    config.write_text('reward = "human"\n')
    assert _resolved("sft", "--config", str(config))[None] == {"reward": "human"}
    args = ["--review", "human", "--review", "thumbs:0-1", "--review", "quality:0.0-10"]
    params = _algorithm_command("sft").make_context("sft", args).params
    scales = [(e.name, e.automatic, e.scale.low, e.scale.high, e.scale.step) for e in _evaluators(params)]
    assert scales == [
        ("human", False, 1.0, 5.0, 1.0),
        ("thumbs", False, 0.0, 1.0, 1.0),
        ("quality", False, 0.0, 10.0, None),
    ]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--reward", "agent=half"], "--reward: 'agent=half' must look like NAME=WEIGHT"),
        (["--reward", "my reward"], "reward: 'my reward' is not a reward name"),
        (["--reward-wait", "-1"], "reward_wait must be >= 0 seconds"),
        (["--review", "human:5-1"], "--review 'human:5-1': a scale needs high > low"),
        (["--review", "human:1-"], "expected NAME or NAME:LOW-HIGH"),
        (["--review", "agent"], "'agent' names the rollout's own reward"),
        (["--review", "h", "--review", "h"], "two evaluators give the same reward name"),
        (["--judge-url", "http://127.0.0.1:9/v1"], "need a rubric (--judge-rubric)"),
        (["--judge-rubric", "Is it right?"], "a judge needs --judge-url"),
        (["--judge-rubric-file", "/nonexistent/rubric.txt"], "does not exist"),
        (
            [
                "--judge-rubric",
                "x",
                "--judge-url",
                "http://127.0.0.1:9/v1",
                "--judge-model",
                "m",
                "--judge-via-server",
            ],
            "give that server with --server (the embedded one holds no upstream keys)",
        ),
    ],
)
def test_bad_reward_flags_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    assert words in _bad(tmp_path, "sft", *args)


def test_an_evaluation_awaiting_a_review_shows_it_pending_not_zero(tmp_path: Path) -> None:
    """Rollouts await a person's score that nobody gives: the mean is '-' and both are counted
    pending (the agent's own rewards, 0.5 and 1.0, are not what is read)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "q": "x", "reward": 0.5}\n{"id": "b", "q": "y", "reward": 1.0}\n')
    run_dir = tmp_path / "run"
    args = ["--agent", f"{AGENTS}:echo", "--val", str(tasks), "--run-dir", str(run_dir), "--runners", "1"]
    done = cli("train", "evaluate", *args, "--review", "human", "--reward", "human", timeout=180)
    assert done.returncode == 0, done.stderr
    [row] = [line for line in done.stdout.splitlines() if "│ val" in line]
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[1:8] == ["val", "2", "2", "0", "-", "2", "0"], done.stdout


def test_judge_flags_make_a_pointwise_or_group_judge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbolt.cli.rewards import evaluators as _evaluators
    from agentbolt.evaluators.judge import GroupJudge, PointwiseJudge

    monkeypatch.setenv("AGENTBOLT_JUDGE_API_KEY", "sk-judge")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("A good answer is short.")
    base = ["--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]
    params = (
        _algorithm_command("grpo").make_context("grpo", [*base, "--judge-rubric-file", str(rubric)]).params
    )
    [judge] = _evaluators(params)
    assert (
        isinstance(judge, PointwiseJudge)
        and judge.name == "judge"
        and judge.rubric == "A good answer is short."
    )
    assert (judge.model.base_url, judge.model.model, judge.model.api_key) == (
        "http://127.0.0.1:9/v1",
        "m",
        "sk-judge",
    )
    args = [*base, "--judge-rubric", "Rank them.", "--group-judge", "--review", "human"]
    group, human = _evaluators(_algorithm_command("grpo").make_context("grpo", args).params)
    assert isinstance(group, GroupJudge) and group.name == "group_judge" and human.name == "human"
    # through the server's judge proxy: the key stays with the server, none is sent from here
    proxied_args = [*base, "--judge-rubric", "Rank them.", "--judge-via-server"]
    [proxied] = _evaluators(_algorithm_command("sft").make_context("sft", proxied_args).params)
    assert proxied.model.via_server and proxied.model.api_key is None


def _share_of_a(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return letters.count("a") / len(letters) if letters else 0.0


class _GroupJudgeDouble(http.server.BaseHTTPRequestHandler):
    """TEST DOUBLE for a hosted group judge (not a model): answers each chat request with one
    line per numbered run, from the share of 'a' among that run's transcript letters."""

    requests: list[int] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # the last message showing runs: the request's own (examples of the format come first)
        shown = [m["content"] for m in body["messages"] if m["role"] == "user" and "=== RUN" in m["content"]]
        runs = re.split(r"=== RUN \d+ ===\n", shown[-1])[1:]
        type(self).requests.append(len(runs))
        # 0.9 of the share, plus 0.01 per position: never two runs alike (a group of the tiny
        # random model's runs may read alike, and a flat group trains nothing)
        shares = [0.9 * _share_of_a(run) + 0.01 * i for i, run in enumerate(runs)]
        text = "\n".join(f"{i}: {s:.3f}" for i, s in enumerate(shares, 1)) + "\nREASON: more a's is better"
        answer = {
            "id": "j",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


SILENT_AGENT = """
import openai
from agentbolt import LitAgent


class Silent(LitAgent):
    async def execute_rollout(self, task):
        llm = self.get_resource("llm")
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0) as c:
            await c.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task.data["q"]}], max_tokens=8
            )


agent = Silent()
"""


def test_grpo_trains_on_a_group_judge_from_the_command_line(tmp_path: Path) -> None:
    """An agent with no reward, a group judge (a recorded-style double on 127.0.0.1) ranking each
    group's runs, GRPO trained on its reward: every sample is used, none pending."""
    from agentbolt.engine import tiny_model_dir
    from agentbolt.server.run import free_port

    tiny = str(tiny_model_dir(tmp_path / "tiny"))
    (tmp_path / "silent.py").write_text(SILENT_AGENT)
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([{"id": f"t{i}", "q": f"say {i}"} for i in range(2)]))
    _GroupJudgeDouble.requests = []
    port = free_port()
    judge = http.server.ThreadingHTTPServer(("127.0.0.1", port), _GroupJudgeDouble)
    threading.Thread(target=judge.serve_forever, daemon=True).start()
    run_dir = tmp_path / "run"
    args = ["--agent", "silent.py:agent", "--train", str(tasks), "--model", tiny, "--steps", "1"]
    args += ["--tasks-per-step", "2", "--group-size", "3", "--engine-dtype", "float32", "--no-bf16"]
    args += ["--no-plot", "--no-validate-before", "--concurrency", "4", "--run-dir", str(run_dir)]
    args += ["--judge-rubric", "More a's is better.", "--group-judge", "--judge-model", "double"]
    args += ["--judge-url", f"http://127.0.0.1:{port}/v1", "--reward", "group_judge"]
    try:
        done = cli("train", "grpo", *args, cwd=tmp_path, timeout=400)
    finally:
        judge.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    [step] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (step["samples"], step["reward_pending"], step["reward_errors"]) == (6, 0, 0)
    assert step["train_tokens"] > 0
    assert _GroupJudgeDouble.requests == [3, 3]  # one call per group, its 3 runs together
    assert (step["judge_calls"], step["judge_tokens"], step["judge_cached"]) == (2, 30, 0)


def test_train_bounds_the_kernel_cache_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``agentbolt train`` keeps oneDNN's compiled primitives bounded (memory.bound_kernel_cache),
    set first, before any product; a user's own setting is kept."""
    from agentbolt.memory import KERNEL_CACHE_CAPACITY

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("DNNL_PRIMITIVE_CACHE_CAPACITY", raising=False)
    _bad(tmp_path, "grpo", config="stepz = 3\n")  # refused after the setting, before any work
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
    _bad(tmp_path, "grpo", config="stepz = 3\n")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
