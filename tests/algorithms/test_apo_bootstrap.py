"""APO's bootstrap method through the real server, gateway and runner.

The agent's model is a TEST DOUBLE (:class:`ExampleModel`, a deterministic OpenAI-compatible
endpoint on 127.0.0.1): it answers a task right when the task is easy, or when it is shown a worked
example (as chat turns, or in its system prompt), so what the search finds is known. The bundled model's run is in
``tests/cli/test_train_apo.py``."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import Request
from rich.console import Console

from agentbolt import LLM, LitAgent, PromptTemplate, Task, Trainer
from agentbolt.algorithms.apo import APO, APOResult
from agentbolt.algorithms.apo_bootstrap import HEADER, compose
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.evaluators import FunctionEvaluator
from agentbolt.evaluators.record import RolloutRecord
from agentbolt.runner.agent import emit_reward
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.turns import render_conversation
from tests.algorithms.test_apo import ChatDouble, _answer

SEED = "Answer with one line 'ANSWER: <word>'."


@dataclass
class ExampleModel(ChatDouble):
    """TEST DOUBLE of the agent's model: ``ANSWER: <the word asked for>`` when the question says
    ``(easy)``, or it is shown a worked example: an earlier assistant turn ``ANSWER: ...``, or an
    ``Assistant: ANSWER:`` line in the system prompt; otherwise ``no idea``. ``systems`` keeps
    every system prompt it was sent, ``turns`` how many messages came before the question."""

    systems: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._serve_chat()

    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        system = next((m["content"] for m in body["messages"] if m["role"] == "system"), "")
        self.systems.append(system)
        self.turns.append(len(body["messages"]) - 1)
        question = body["messages"][-1]["content"]
        word = re.search(r"the word (\w+)", question)
        earlier = body["messages"][:-1]
        turn = any(m["role"] == "assistant" and str(m["content"]).startswith("ANSWER:") for m in earlier)
        shown = "Assistant: ANSWER:" in system or turn
        return _answer(
            body, f"ANSWER: {word.group(1)}" if word and ("(easy)" in question or shown) else "no idea"
        )


class WordAgent(LitAgent):
    """Asks for a word through the gateway; reward 1.0 when the reply is ``ANSWER: <word>``. With
    ``lie``, it also reports a reward of 1.0 of its own for every run (a named one it may not give)."""

    def __init__(self, lie: bool = False) -> None:
        super().__init__()
        self.lie = lie

    def execute_rollout(self, task: Task) -> float:
        prompt, llm = self.get_resource("system_prompt"), self.get_resource("llm")
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0, timeout=30)
        messages: Any = [{"role": "system", "content": prompt}, {"role": "user", "content": task.data["q"]}]
        reply = client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content
        if self.lie:
            return 1.0
        return float((reply or "").strip() == f"ANSWER: {task.data['word']}")


def _tasks(prefix: str, words: list[str], easy: int) -> list[dict[str, Any]]:
    return [
        {"id": f"{prefix}-{i}", "q": f"Say the word {w}{' (easy)' if i < easy else ''}.", "word": w}
        for i, w in enumerate(words)
    ]


TRAIN = _tasks("train", ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "yuzu"], easy=2)
VAL = _tasks("val", ["red", "blue", "green", "black"], easy=1)


def _right(record: RolloutRecord) -> float:
    """The scorer outside the agent: the recorded answer is the task's word."""
    return float(record.output == f"ANSWER: {record.task['word']}")


@pytest.fixture
def model() -> Iterator[ExampleModel]:
    with ExampleModel() as m:
        yield m


def _shown(result: APOResult) -> str:
    """What the best candidate shows the model: its prompt, then its example turns as text."""
    return "\n".join([result.best_prompt, *(render_conversation(t) for t in result.best_turns.values())])


def _fit(
    apo: APO,
    model: ExampleModel,
    tmp_path: Path,
    agent: LitAgent | None = None,
    engine: str = "f-string",
    train: list[dict[str, Any]] | None = None,
) -> tuple[APOResult, str, ServerThread]:
    out = io.StringIO()
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=30.0, sweep_interval=0.1)
    server = ServerThread(config).__enter__()
    resources: dict[str, Any] = {
        "system_prompt": PromptTemplate(template=SEED, engine=engine),  # type: ignore[arg-type]
        "llm": LLM(base_url=model.base_url, model="double"),
    }
    trainer = Trainer(
        apo, server_url=server.url, resources=resources, n_runners=1, console=Console(file=out, width=160)
    )
    result = trainer.fit(agent or WordAgent(), TRAIN if train is None else train, VAL)
    return result, out.getvalue(), server


@pytest.fixture
def stopper() -> Iterator[list[ServerThread]]:
    servers: list[ServerThread] = []
    yield servers
    for s in servers:
        s.__exit__(None, None, None)


@pytest.mark.parametrize("demos_as", ["turns", "text"])
def test_worked_examples_from_successful_training_runs_win(
    demos_as: str, model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    apo = APO(
        bootstrap_tasks=4, bootstrap_rounds=2, trials=3, max_demos=2, batch_timeout=60.0, demos_as=demos_as
    )
    result, out, server = _fit(apo, model, tmp_path)
    stopper.append(server)
    # the seed solves the one easy validation task; any prompt with an example solves them all
    assert result.seed_val == pytest.approx(0.25) and result.best_val == 1.0
    if demos_as == "text":
        assert result.best_prompt.startswith(SEED + "\n\n" + HEADER) and not result.best_turns
    else:  # the prompt is the seed's; the examples are turns of the LLM resource
        assert result.best_prompt == SEED and list(result.best_turns) == ["llm"]
        assert max(model.turns) >= 3 and set(model.systems) == {SEED}
    # round 1: the seed solves the easy ones of its 4 training tasks (1 or 2: the order is
    # shuffled); round 2, shown one, solves all 4 of its own (the seed alone would give <= 2)
    assert result.stats.demos in (5, 6) and result.stats.rollouts == 4 + 4 + 4 + 3 * 4
    examples = re.findall(r"User: (.*)\nAssistant: (.*)", _shown(result))
    assert examples and all(answer == f"ANSWER: {q.split()[3].rstrip('.')}" for q, answer in examples), (
        _shown(result)
    )
    train_questions = {t["q"] for t in TRAIN}
    assert {q for q, _ in examples} <= train_questions  # never a validation task
    with Client(server.url) as client:
        latest = client.latest_resources()
        assert latest is not None and latest.version == result.published_version
        assert latest.resources["system_prompt"].template == result.best_prompt  # type: ignore[union-attr]
        published = [t.model_dump(exclude_none=True) for t in latest.resources["llm"].examples]  # type: ignore[union-attr]
        assert published == result.best_turns.get("llm", [])
        versions = client.list_resources(limit=100).items
        scored = [v for v in versions if v.metadata.get("stage") == "scored"]
        assert all(
            v.trial for v in versions if v.version not in (result.seed_version, result.published_version)
        )
        trials = [v for v in scored if v.metadata.get("method") == "bootstrap"]
        assert len(trials) == 3 and all(v.metadata["scores"]["val"] is not None for v in trials)
        assert all(
            len(v.metadata["demos"]) >= 1 and set(v.metadata["demos"]) <= {t["id"] for t in TRAIN}
            for v in trials
        )
    assert "APO" in out and "demos" in out


def test_examples_come_only_from_runs_the_chosen_reward_scored(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    """The agent says 1.0 for every run; the scorer (outside the agent) says which succeeded."""

    apo = APO(
        bootstrap_tasks=8,
        bootstrap_rounds=1,
        trials=2,
        max_demos=3,
        batch_timeout=60.0,
        reward="score",
        evaluators=[FunctionEvaluator(_right, "score")],
    )
    result, _, server = _fit(apo, model, tmp_path, agent=WordAgent(lie=True))
    stopper.append(server)
    # of the 8 bootstrap runs only the 2 easy ones scored 1 by the scorer: 2 examples, not 8
    assert result.stats.demos == 2
    assert "the word apple (easy)" in _shown(result) and "pear" in _shown(result)
    assert "plum" not in _shown(result)


def test_without_a_successful_run_the_seed_is_kept(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    hard = [{**t, "q": t["q"].replace(" (easy)", "")} for t in TRAIN]
    result, out, server = _fit(
        APO(bootstrap_tasks=4, trials=2, batch_timeout=60.0), model, tmp_path, train=hard
    )
    stopper.append(server)
    assert result.best_prompt == SEED and not result.best_turns and result.stats.demos == 0
    assert "no successful training run" in out


def test_the_budget_counts_bootstrap_runs(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    """Budget 15, 4 validation tasks: bootstrap round 1 (4) leaves room for the seed's
    validation and one trial; round 2 would not (4 + 4 + 2 x 4 > 15) and is not run; the seed's
    validation (4) and one trial (4) make 12, and a second trial would pass 15."""
    easy = [{**t, "q": t["q"].rstrip(".") + " (easy)."} if "(easy)" not in t["q"] else t for t in TRAIN]
    apo = APO(bootstrap_tasks=4, bootstrap_rounds=2, trials=5, rollout_budget=15, batch_timeout=60.0)
    result, _, server = _fit(apo, model, tmp_path, train=easy)
    stopper.append(server)
    assert result.stats.demos == 4  # round 1's four runs, all successful; no round 2
    assert result.stats.rollouts == 12 and result.stats.budget_exhausted


def test_braces_in_examples_are_text_in_an_f_string_prompt() -> None:
    from agentbolt.algorithms.apo_bootstrap import Demo

    demo = Demo(
        "t1",
        render_conversation(
            [{"role": "user", "content": "Echo {x}"}, {"role": "assistant", "content": "{x}"}]
        ),
    )
    prompt = compose("Answer {name}.", [demo], f_string=True)
    assert (
        PromptTemplate(template=prompt).format(name="Bo")
        == f"Answer Bo.\n\n{HEADER}\n\nExample 1:\nUser: Echo {{x}}\nAssistant: {{x}}"
    )
    assert compose("Plain {x}", [demo], f_string=False).endswith("Assistant: {x}")
    calls = [{"function": {"name": "calc", "arguments": '{"e": "1+1"}'}}]
    assert render_conversation([{"role": "assistant", "content": None, "tool_calls": calls}]) == (
        'Assistant: [calls calc({"e": "1+1"})]'
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "evolve"}, "unknown method 'evolve'"),
        ({"max_demos": 0}, "demos >= 1"),
        ({"trials": -1}, "trials"),
    ],
)
def test_bad_settings_are_named(
    settings: dict[str, Any], message: str, model: ExampleModel, tmp_path: Path
) -> None:
    config = ServerConfig(db=str(tmp_path / "store.db"))
    with ServerThread(config) as server:
        resources: dict[str, Any] = {"system_prompt": PromptTemplate(template=SEED)}
        trainer = Trainer(APO(**settings), server_url=server.url, resources=resources, n_runners=0)
        with pytest.raises(ConfigError, match=message):
            trainer.fit(WordAgent(), TRAIN, VAL)


def test_an_agents_own_reward_post_does_not_make_an_example(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    """A named reward the agent posts about itself is refused by the server: it never picks examples."""

    class Boaster(WordAgent):
        def execute_rollout(self, task: Task) -> float:
            value = super().execute_rollout(task)
            try:
                emit_reward(1.0, name="score")
            except Exception:  # noqa: BLE001 - refused or dropped: either way not a reward
                pass
            return value

    apo = APO(
        bootstrap_tasks=8,
        bootstrap_rounds=1,
        trials=1,
        reward="score",
        batch_timeout=60.0,
        evaluators=[FunctionEvaluator(_right, "score")],
    )
    result, _, server = _fit(apo, model, tmp_path, agent=Boaster())
    stopper.append(server)
    assert result.stats.demos == 2


PROGRAM = """
import json, os, openai
task = json.load(open(os.environ["AGENTBOLT_TASK_FILE"]))
prompt = open(os.environ["AGENTBOLT_PROMPT_SYSTEM_PROMPT_FILE"]).read()
assert prompt == os.environ["AGENTBOLT_PROMPT_SYSTEM_PROMPT"]
client = openai.OpenAI(max_retries=0, timeout=30)
messages = [{"role": "system", "content": prompt}, {"role": "user", "content": task["q"]}]
reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
print(reply.choices[0].message.content)
"""


def _said_the_word(run: Any) -> float:
    return float(run.stdout.strip() == f"ANSWER: {run.task.data['word']}")


@pytest.mark.parametrize("demos_as", ["turns", "text"])
def test_a_program_reading_its_prompt_from_a_file_is_optimized(
    demos_as: str, model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    import sys

    from agentbolt.runner.program import Program

    script = tmp_path / "agent.py"
    script.write_text(PROGRAM)
    agent = Program([sys.executable, str(script)], scorer=_said_the_word, timeout=60)
    apo = APO(bootstrap_tasks=8, bootstrap_rounds=1, trials=2, batch_timeout=120.0, demos_as=demos_as)
    result, _, server = _fit(apo, model, tmp_path, agent=agent, engine="plain")
    stopper.append(server)
    assert result.seed_val == pytest.approx(0.25) and result.best_val == 1.0 and result.stats.demos == 2
    if demos_as == "turns":
        assert result.best_prompt == SEED and result.best_turns["llm"]
        # the program sent the prompt it read from the file (the seed's) and its question
        # alone; the gateway put the examples in between
        assert set(model.systems) == {SEED} and max(model.turns) >= 3
    else:
        assert HEADER in result.best_prompt and not result.best_turns
        # the program sent the prompts it read from the file: the seed's, then candidates'
        assert SEED in model.systems and any(HEADER in s for s in model.systems)
        assert max(model.turns) == 1


def test_instructions_given_and_rewritten_are_searched_with_the_examples(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    """The user's instruction and the optimizer's rewrite of the seed join the seed's as
    candidates' instructions; the rewrite is asked from the seed's bootstrap runs."""
    from tests.algorithms.test_apo import ScriptedOptimizer

    mine = "Reply with ANSWER: and the word."
    with ScriptedOptimizer(rewrite=lambda current, n: "<prompt>Rewritten: say ANSWER: word.</prompt>") as opt:
        apo = APO(
            bootstrap_tasks=8,
            bootstrap_rounds=1,
            trials=8,
            instructions=[mine],
            optimizer_base_url=opt.base_url,
            optimizer_model="scripted",
            branch_factor=1,
            optimizer_backoff=0.0,
            batch_timeout=60.0,
        )
        result, _, server = _fit(apo, model, tmp_path)
        stopper.append(server)
        assert len(opt.kinds("critique")) == 1 and len(opt.kinds("rewrite")) == 1
        assert SEED in opt.kinds("critique")[0]  # the seed's own runs are the evidence
    tried = [c for c in result.history if c.extra.get("method") == "bootstrap" and c.val is not None]
    used = {c.extra.get("instruction") for c in tried}
    starts = {c.prompt.split("\n\n")[0] for c in tried}
    assert used == {0, 1, 2} and starts == {SEED, mine, "Rewritten: say ANSWER: word."}
    assert result.best_val == 1.0


class ShowingAgent(WordAgent):
    """Opens every conversation with the same worked exchange of its own, before the task."""

    def execute_rollout(self, task: Task) -> float:
        prompt, llm = self.get_resource("system_prompt"), self.get_resource("llm")
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0, timeout=30)
        messages: Any = [
            {"role": "system", "content": prompt},
            {"role": "user", "content": "Say the word cat."},
            {"role": "assistant", "content": "cat"},
            {"role": "user", "content": task.data["q"]},
        ]
        reply = client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content
        return float((reply or "").strip() == f"ANSWER: {task.data['word']}")


def test_the_agents_own_fixed_turns_are_not_an_example(
    model: ExampleModel, tmp_path: Path, stopper: list[ServerThread]
) -> None:
    """One run succeeds; the turns all eight runs open with are left out of its example."""
    one_easy = [{**t, "q": t["q"].replace(" (easy)", "")} if t["id"] != "train-0" else t for t in TRAIN]
    apo = APO(bootstrap_tasks=8, bootstrap_rounds=1, trials=1, batch_timeout=60.0)
    result, _, server = _fit(apo, model, tmp_path, agent=ShowingAgent(), train=one_easy)
    stopper.append(server)
    assert result.stats.demos == 1
    example = _shown(result)
    assert "Say the word apple (easy)." in example and "cat" not in example
