"""APO through the real server, gateway and runner, with a scripted optimizer endpoint."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import io
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from rich.console import Console
from typer.testing import CliRunner

from agentbolt import LLM, LitAgent, PromptTemplate, Task, Trainer
from agentbolt.algorithms.apo import APO, APOResult, Candidate, pareto_front, select_beam
from agentbolt.algorithms.apo_optimizer import extract_prompt
from agentbolt.cli.export import export_app
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.runner.worker import Runner
from agentbolt.schemas import Mode, Rollout, RolloutCreate
from agentbolt.server import ServerConfig, ServerThread
from agentbolt.server.run import free_port

Fault = tuple[str, Any]  # ("text" | "raw", str) | ("status", int) | ("sleep", seconds) | ("pass", "")


class ChatDouble:
    """A test double's OpenAI-compatible ``/v1/chat/completions`` (its ``_chat``), served by
    uvicorn on 127.0.0.1 in a thread while the ``with`` block runs."""

    def _serve_chat(self) -> None:
        self.port = free_port()
        app = FastAPI()
        app.post("/v1/chat/completions")(self._chat)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )

    async def _chat(self, request: Request) -> Response:
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True


@dataclass
class ScriptedOptimizer(ChatDouble):
    """TEST DOUBLE: a deterministic OpenAI-compatible chat endpoint on 127.0.0.1 - not a model.

    APO's critique requests get ``critique``; its rewrite requests get ``rewrite(current_prompt,
    n)`` for the n-th rewrite; ``faults`` (taken first, one per optimizer call) replace an answer
    with given text, a raw 200 body, an HTTP status or a delay, or let it through (``pass``). Any other request - the agent's own calls through
    the gateway - gets a short fixed answer. ``seen`` holds (kind, user message) per request.
    """

    rewrite: Callable[[str, int], str]
    critique: str = "The prompt never names the keyword the tasks need."
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rewrites = 0
        self._serve_chat()

    def kinds(self, kind: str) -> list[str]:
        return [text for k, text in self.seen if k == kind]

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        user = body["messages"][-1]["content"]
        kind = "rewrite" if "<critique>" in user else "critique" if "Runs of the agent" in user else "agent"
        self.seen.append((kind, user))
        if kind == "agent":
            return _answer(body, "I would rather not say.")
        fault: Fault = self.faults.pop(0) if self.faults else ("pass", "")
        what, value = fault
        if what != "pass":
            if what == "status":
                return JSONResponse(
                    {"error": {"message": "scripted", "type": "server_error"}}, status_code=value
                )
            if what == "raw":  # a 200 whose body is not a chat completion
                return Response(
                    value, media_type="application/json" if value.startswith("{") else "text/plain"
                )
            await asyncio.sleep(value if what == "sleep" else 0)
            return _answer(body, value if what == "text" else "late")
        if kind == "critique":
            return _answer(body, self.critique)
        current = re.search(r"<current_prompt>\n(.*?)\n</current_prompt>", user, re.DOTALL)
        self.rewrites += 1
        return _answer(body, self.rewrite(current.group(1) if current else "", self.rewrites - 1))


def _answer(body: dict[str, Any], text: str) -> JSONResponse:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    return JSONResponse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


class KeywordAgent(LitAgent):
    """Asks its LLM (through the gateway), then scores 1.0 when the system prompt holds the task's
    keyword and not the word BAD; a task with ``fail`` raises instead of scoring 0."""

    def execute_rollout(self, task: Task) -> float:
        prompt, llm = self.get_resource("system_prompt"), self.get_resource("llm")
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x", max_retries=0, timeout=30)
        messages: Any = [{"role": "system", "content": prompt}, {"role": "user", "content": task.data["q"]}]
        client.chat.completions.create(model=llm.model, messages=messages, temperature=0.0)
        hit = task.data["kw"] in prompt and "BAD" not in prompt
        if task.data.get("fail") and not hit:
            raise ValueError(f"the prompt does not mention {task.data['kw']}")
        return float(hit)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ServerThread]:
    """A real server plus a real runner (4 slots) in a thread."""
    config = ServerConfig(db=str(tmp_path / "store.db"), lease_seconds=30.0, sweep_interval=0.1)
    with ServerThread(config) as server:
        runner = Runner(KeywordAgent(), server.url, concurrency=4, grace=1.0, poll_wait=0.5)
        thread = threading.Thread(target=runner.run_sync, kwargs={"install_signals": False}, daemon=True)
        thread.start()
        yield server
        runner.stop()
        thread.join(10)


def _fit(
    apo: APO,
    server_url: str | None,
    double: ScriptedOptimizer,
    seed: str,
    train: list[dict[str, Any]],
    val: list[dict[str, Any]] | None = None,
    **kw: Any,
) -> tuple[APOResult, str]:
    out = io.StringIO()
    resources: dict[str, Any] = {
        "system_prompt": PromptTemplate(template=seed),
        "llm": LLM(base_url=double.base_url, model="scripted"),
    }
    trainer = Trainer(
        apo, server_url=server_url, resources=resources, console=Console(file=out, width=140), **kw
    )
    return trainer.fit(KeywordAgent(), train, val), out.getvalue()


def _fast(**kw: Any) -> APO:
    return APO(
        **{
            "method": "rewrite",
            "optimizer_backoff": 0.0,
            "optimizer_timeout": 10.0,
            "batch_timeout": 60.0,
            **kw,
        }
    )


def _tasks(*kws: str, start: int = 0, **extra: Any) -> list[dict[str, Any]]:
    return [
        {"id": f"{kw}-{i}", "q": f"Question {i} about {kw}?", "kw": kw, **extra}
        for i, kw in enumerate(kws, start)
    ]


def test_apo_finds_the_keyword_through_trainer_runners_and_gateway(tmp_path: Path) -> None:
    with ScriptedOptimizer(
        rewrite=lambda p, n: f"<prompt>{p} Always mention KEYWORD ({n}).</prompt>"
    ) as double:
        train = _tasks("KEYWORD", "KEYWORD") + _tasks("KEYWORD", start=2, fail=True)
        apo = _fast(rounds=2, beam_width=2, branch_factor=1, train_batch_size=2)
        result, shown = _fit(
            apo,
            None,
            double,
            "You are helpful.",
            train,
            _tasks("KEYWORD", "KEYWORD"),
            n_runners=1,
            runner_concurrency=4,
            run_dir=tmp_path / "run",
        )
    assert (result.seed_val, result.best_val) == (0.0, 1.0)
    assert result.best_prompt == "You are helpful. Always mention KEYWORD (0)."
    assert [c.round for c in result.history] == [0, 1, 2, 2] and result.stats.skipped_candidates == 0
    critiques = "".join(double.kinds("critique"))
    assert (
        "[user] Question 1 about KEYWORD?" in critiques and "[assistant] I would rather not say." in critiques
    )
    assert "ValueError: the prompt does not mention KEYWORD" in critiques
    assert "APO (beam)" in shown and "+You are helpful. Always mention KEYWORD (0)." in shown


def test_records_versions_and_export(rig: ServerThread, tmp_path: Path) -> None:
    with ScriptedOptimizer(rewrite=lambda p, n: f"<prompt>{p} KEYWORD {n}</prompt>") as double:
        apo = _fast(rounds=1, beam_width=1, branch_factor=2, train_batch_size=2)
        result, _ = _fit(apo, rig.url, double, "Seed.", _tasks("KEYWORD", "x"), n_runners=0, run_dir=tmp_path)
    from agentbolt.client import Client

    with Client(rig.url) as client:
        latest = client.latest_resources()
        assert latest is not None and latest.version == result.published_version
        assert latest.resources["system_prompt"].template == result.best_prompt  # type: ignore[union-attr]
        assert isinstance(latest.resources["llm"], LLM)  # the other resources are kept
        for cand in result.history:
            record = client.get_resources(cand.record_version or 0).metadata
            assert record["algorithm"] == "apo" and record["round"] == cand.round
            assert record["parent"] == cand.parent and record["scores"] == {
                "train": cand.train,
                "val": cand.val,
            }
            val = client.list_rollouts(resources_version=cand.version, mode=Mode.VAL).items
            assert len(val) == 2 and {r.resources_version for r in val} == {cand.version}
            # a trial never became the latest: only the seed (published by the Trainer) and the
            # final best are normal versions
            assert client.get_resources(cand.version).trial is (cand.parent is not None)
            assert client.get_resources(cand.record_version or 0).trial
        normal = {v.version for v in client.list_resources().items if not v.trial}
        assert normal == {result.seed_version, result.published_version}
    out = tmp_path / "best.txt"
    cli = CliRunner().invoke(
        export_app, ["prompt", "--server", rig.url, "--version", "best", "--out", str(out)]
    )
    assert cli.exit_code == 0, cli.output
    assert out.read_text() == result.best_prompt == "Seed. KEYWORD 0"
    args = ["prompt", "--server", rig.url, "--version", str(result.seed_version), "--out", str(out)]
    assert CliRunner().invoke(export_app, args).exit_code == 0 and out.read_text() == "Seed."


def test_a_crash_after_a_trial_leaves_the_seed_latest(rig: ServerThread, tmp_path: Path) -> None:
    """The optimizer answers the first critique and rewrite, then fails with a 401: the run
    stops with the first child already published as a trial, and the seed is still the latest."""
    faults: list[Fault] = [("pass", ""), ("pass", ""), ("status", 401)]
    with ScriptedOptimizer(rewrite=lambda p, n: f"<prompt>{p} KEYWORD</prompt>", faults=faults) as double:
        apo = _fast(rounds=1, beam_width=1, branch_factor=2, optimizer_retries=3)
        with pytest.raises(ConfigError, match="HTTP 401"):
            _fit(apo, rig.url, double, "Seed.", _tasks("KEYWORD"), n_runners=0, run_dir=tmp_path)
        assert len(double.kinds("critique")) == 2  # the 401 was not retried
        with Client(rig.url) as client:
            versions = sorted(client.list_resources().items, key=lambda v: v.version)
            latest = client.latest_resources()
            unpinned = _run_unpinned(client)
    seed = versions[0].version
    assert latest is not None and latest.version == seed and not latest.trial
    assert latest.resources["system_prompt"].template == "Seed."  # type: ignore[union-attr]
    trials = [v for v in versions if v.trial]
    assert [v.metadata["stage"] for v in trials] == ["scored", "trial", "scored"]
    assert trials[1].resources["system_prompt"].template == "Seed. KEYWORD"  # type: ignore[union-attr]
    # a rollout that is not pinned runs with the latest, never with a trial
    assert unpinned.resources_version == seed and unpinned.reward == 0.0


def _run_unpinned(client: Client) -> Rollout:
    """Run one rollout that names no resources version, to its end."""
    [rollout] = client.enqueue([RolloutCreate(task=Task(id="unpinned", data={"q": "?", "kw": "KEYWORD"}))])
    deadline = time.monotonic() + 30
    while not rollout.status.is_final and time.monotonic() < deadline:
        rollout = client.wait([rollout.id], timeout=2).rollouts[0]
    return rollout


class DenyingAPI:
    """TEST DOUBLE for a hosted OpenAI-compatible API on 127.0.0.1 - not a real service: every
    request gets ``status`` with an OpenAI-style error body, and is counted."""

    def __init__(self, status: int) -> None:
        self.status, self.requests = status, 0
        double = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                double.requests += 1
                error = {"message": f"scripted {double.status}", "type": "invalid_request_error"}
                body = json.dumps({"error": error}).encode()
                self.send_response(double.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> DenyingAPI:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_optimizer_config_errors_stop_the_run_at_once(rig: ServerThread, tmp_path: Path, status: int) -> None:
    with ScriptedOptimizer(rewrite=lambda p, n: "unused") as agent_llm, DenyingAPI(status) as hosted:
        apo = _fast(
            rounds=2, optimizer_retries=4, optimizer_base_url=hosted.base_url, optimizer_model="gpt-test"
        )
        with pytest.raises(ConfigError) as caught:
            _fit(apo, rig.url, agent_llm, "Seed.", _tasks("KEYWORD"), n_runners=0, run_dir=tmp_path)
    message = str(caught.value)
    assert "'gpt-test'" in message and f"HTTP {status}" in message and f"scripted {status}" in message
    assert hosted.base_url in message and hosted.requests == 1


@pytest.mark.parametrize("status", [429, 503])
def test_transient_optimizer_errors_are_retried(rig: ServerThread, tmp_path: Path, status: int) -> None:
    with ScriptedOptimizer(rewrite=lambda p, n: "unused") as agent_llm, DenyingAPI(status) as hosted:
        apo = _fast(
            rounds=1,
            beam_width=1,
            branch_factor=1,
            optimizer_retries=2,
            optimizer_base_url=hosted.base_url,
            optimizer_model="gpt-test",
        )
        result, _ = _fit(apo, rig.url, agent_llm, "Seed.", _tasks("KEYWORD"), n_runners=0, run_dir=tmp_path)
    assert hosted.requests == 3 and result.stats.optimizer_errors == 3 and result.stats.retries == 2
    assert result.stats.skipped_candidates == 1 and result.best_prompt == "Seed."


def test_never_worse_than_the_seed_and_budget_stops(rig: ServerThread, tmp_path: Path) -> None:
    proposals = ["<prompt>Be good. BAD</prompt>", "<prompt>Be good, really.</prompt>"]
    with ScriptedOptimizer(
        rewrite=lambda p, n: proposals[n % 2] if n < 2 else f"<prompt>{n}</prompt>"
    ) as double:
        apo = _fast(rounds=10, beam_width=1, branch_factor=1, train_batch_size=2, rollout_budget=12)
        result, _ = _fit(
            apo, rig.url, double, "Be good.", _tasks("good", "good"), n_runners=0, run_dir=tmp_path
        )
    assert [c.val for c in result.history] == [1.0, 0.0, 1.0]  # worse, then a tie
    assert result.best_prompt == "Be good." and result.best_version == result.seed_version
    assert result.stats.budget_exhausted and result.stats.rollouts == 12


def test_malformed_optimizer_output_is_counted_and_skipped(rig: ServerThread, tmp_path: Path) -> None:
    critique_faults = [
        ("status", 500),
        ("sleep", 2.0),
        ("raw", "garbage"),
        ("raw", "{not json"),
        ("pass", ""),
    ]
    rewrite_faults: list[Fault] = [
        ("text", ""),
        ("text", "no tags"),
        ("text", f"<prompt>{'x' * 200}</prompt>"),
        ("text", "<prompt>Seed.</prompt>"),
        ("text", "<prompt> </prompt>"),
    ]
    rewrite = "<prompt>Answer with KEYWORD.</prompt>"
    with ScriptedOptimizer(rewrite=lambda p, n: rewrite, faults=critique_faults + rewrite_faults) as double:
        apo = _fast(
            rounds=1,
            beam_width=1,
            branch_factor=2,
            optimizer_retries=4,
            optimizer_timeout=0.5,
            max_prompt_chars=100,
        )
        result, _ = _fit(apo, rig.url, double, "Seed.", _tasks("KEYWORD"), n_runners=0, run_dir=tmp_path)
    stats = result.stats
    assert (stats.optimizer_calls, stats.optimizer_errors, stats.timeouts, stats.retries) == (12, 4, 1, 8)
    assert (stats.empty_outputs, stats.missing_prompt, stats.too_long, stats.duplicates) == (2, 1, 1, 1)
    assert stats.skipped_candidates == 1 and [c.prompt for c in result.history] == ["Seed.", rewrite[8:-9]]
    assert result.best_prompt == "Answer with KEYWORD." and result.best_val == 1.0


def test_pareto_keeps_per_task_winners(rig: ServerThread, tmp_path: Path) -> None:
    words = ["alpha", "beta", "noise"]
    with ScriptedOptimizer(rewrite=lambda p, n: f"<prompt>{p} {words[n % 3]}</prompt>") as double:
        apo = _fast(strategy="pareto", rounds=1, beam_width=1, branch_factor=3, train_batch_size=2)
        result, shown = _fit(
            apo, rig.url, double, "Seed.", _tasks("alpha", "beta"), n_runners=0, run_dir=tmp_path
        )
    seed, a, b, noise = result.history
    assert (a.val_by_task, b.val_by_task) == (
        {"alpha-0": 1.0, "beta-1": 0.0},
        {"alpha-0": 0.0, "beta-1": 1.0},
    )
    assert result.front == [a.version, b.version]  # a beam of one would keep only a
    assert select_beam(result.history, 1) == [a] and result.best_prompt == "Seed. alpha"
    assert noise.val is None and noise.note.startswith("gated") and "APO (pareto)" in shown


def _cand(order: int, scores: dict[str, float]) -> Candidate:
    mean = sum(scores.values()) / len(scores)
    return Candidate(
        f"p{order}", order + 1, 1, None if order == 0 else 1, order, val=mean, val_by_task=scores
    )


def test_pareto_front_and_beam_selection() -> None:
    scores: list[dict[str, float]] = [
        {"x": 0, "y": 0},
        {"x": 1, "y": 0},
        {"x": 0, "y": 1},
        {"x": 1, "y": 0},
        {"x": 0.5, "y": 0.5},
    ]
    seed, a, b, ab, c = (_cand(i, s) for i, s in enumerate(scores))
    assert pareto_front([seed, a, b, c]) == [a, b]
    assert pareto_front([seed, a, ab]) == [a, ab]  # equal on every task: both kept
    tie = _cand(1, {"x": 0, "y": 0})
    assert select_beam([tie, seed], 1) == [seed]  # the seed wins ties


def test_extract_prompt() -> None:
    assert extract_prompt("x <prompt> a </prompt> y <PROMPT>b</PROMPT>") == "b"
    assert extract_prompt("Be brief.\n</prompt> and more") == "Be brief."  # a closing tag only
    assert extract_prompt("no tags") is None and extract_prompt("<prompt>unclosed") is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama whose context fits a critique request."""
    pytest.importorskip("torch")
    from agentbolt.engine import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def test_one_round_with_the_embedded_engine(rig: ServerThread, tmp_path: Path, tiny_model: Path) -> None:
    from agentbolt.client import Client
    from agentbolt.engine import EngineServer, ModelEngine

    engine = ModelEngine.from_pretrained(tiny_model, default_max_tokens=8)
    with EngineServer(engine) as llm_server:
        resources: dict[str, Any] = {
            "system_prompt": PromptTemplate(template="Be brief."),
            "llm": LLM(base_url=llm_server.base_url, model=engine.name),
        }
        apo = _fast(
            rounds=1,
            beam_width=1,
            branch_factor=1,
            train_batch_size=2,
            optimizer_retries=0,
            optimizer_max_tokens=16,
            optimizer_temperature=0.0,
            max_example_chars=400,
        )
        trainer = Trainer(
            apo,
            server_url=rig.url,
            resources=resources,
            run_dir=tmp_path,
            console=Console(file=io.StringIO()),
        )
        result = trainer.fit(KeywordAgent(), _tasks("Be", "nope"))
    assert result.best_val >= result.seed_val == 0.5 and result.stats.optimizer_calls >= 1
    with Client(rig.url) as client:
        rollout = client.list_rollouts(resources_version=result.seed_version).items[0]
        calls = client.all_events(rollout.id, type=["llm_call"])
    assert calls and calls[0].data["prompt_token_ids"] and calls[0].data["choices"][0]["token_ids"]


def test_the_example_runs_offline_on_a_tiny_model(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "apo_qa", Path(__file__).parents[2] / "examples" / "apo_qa.py"
    )
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(
        model=str(tiny_model),
        rounds=1,
        branch_factor=1,
        optimizer_max_tokens=16,
        optimizer_retries=0,
        max_example_chars=300,
    )
    assert result.best_val >= result.seed_val and result.stats.optimizer_calls >= 1
