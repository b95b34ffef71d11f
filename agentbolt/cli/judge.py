"""``agentbolt judge``: a model judge scoring rollouts as they finish, beside the runners.

It runs an :class:`~agentbolt.evaluators.worker.EvaluatorWorker` with one judge: a
:class:`~agentbolt.evaluators.judge.PointwiseJudge`, or with ``--group-judge`` a
:class:`~agentbolt.evaluators.judge.GroupJudge`, over any OpenAI-compatible model. With
``--judge-via-server`` the model is called through the server's judge proxy, which holds the key;
otherwise ``--judge-key`` (or ``AGENTBOLT_JUDGE_API_KEY``) is sent to the model directly.
The judge's options are spelt as ``agentbolt train``'s. Bad options are one line and exit code 2.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from agentbolt.cli.common import DEFAULT_SERVER, ServerOpt, console, fail
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator
from agentbolt.evaluators.judge import GroupJudge, JudgeBudget, JudgeModel, PointwiseJudge
from agentbolt.evaluators.worker import EvaluatorWorker

__all__ = ["judge_command"]


def _rubric(rubric: str | None, rubric_file: Path | None) -> str:
    if (rubric is None) == (rubric_file is None):
        raise fail("give the rubric as exactly one of --judge-rubric TEXT or --judge-rubric-file PATH")
    if rubric_file is None:
        return rubric or ""
    try:
        return rubric_file.read_text()
    except OSError as exc:
        raise fail(f"cannot read the rubric file {rubric_file}: {exc.strerror or exc}") from None


def _judge(
    rubric: str,
    model: JudgeModel,
    name: str | None,
    group: bool,
    budget: JudgeBudget,
    max_transcript_chars: int | None,
) -> Evaluator:
    if group:
        return GroupJudge(
            rubric,
            model,
            name=name or "group_judge",
            max_transcript_chars=max_transcript_chars or 12000,
            budget=budget,
        )
    return PointwiseJudge(
        rubric, model, name=name or "judge", max_transcript_chars=max_transcript_chars or 6000, budget=budget
    )


def _stop_on_signals(worker: EvaluatorWorker) -> None:
    """Ctrl-C or SIGTERM: finish the batch in hand, then stop; a second Ctrl-C stops at once."""
    stopping = False

    def handle(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stopping = True
        console.print("stopping after the batch in hand (Ctrl-C again to stop now)")
        worker.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def judge_command(
    judge_url: Annotated[
        str,
        typer.Option(
            "--judge-url", envvar="AGENTBOLT_JUDGE_URL", help="The judge model's OpenAI-compatible base URL."
        ),
    ],
    judge_model: Annotated[
        str, typer.Option("--judge-model", envvar="AGENTBOLT_JUDGE_MODEL", help="The judge model's name.")
    ],
    judge_rubric: Annotated[str | None, typer.Option("--judge-rubric", help="What a good run does.")] = None,
    judge_rubric_file: Annotated[
        Path | None, typer.Option("--judge-rubric-file", help="The rubric, from a file.")
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name", help="The reward to write (default: judge, or group_judge with --group-judge)."
        ),
    ] = None,
    group_judge: Annotated[
        bool,
        typer.Option("--group-judge", help="Judge each group's rollouts together, relative to each other."),
    ] = False,
    judge_via_server: Annotated[
        bool,
        typer.Option(
            "--judge-via-server", help="Call the model through the server's judge proxy (it holds the key)."
        ),
    ] = False,
    judge_key: Annotated[
        str | None,
        typer.Option("--judge-key", envvar="AGENTBOLT_JUDGE_API_KEY", help="The judge model's API key."),
    ] = None,
    max_calls: Annotated[
        int | None, typer.Option(min=0, help="Stop calling the judge after this many calls.")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(min=0, help="... or after this many tokens.")] = None,
    max_transcript_chars: Annotated[
        int | None, typer.Option(min=500, help="Longest transcript shown to the judge (cut as documented).")
    ] = None,
    cache: Annotated[
        Path | None, typer.Option("--cache", help="JSON-lines file of judge answers to reuse.")
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-n", min=1, help="Judgements at a time.")] = 4,
    poll: Annotated[float, typer.Option(min=0.1, help="Seconds between passes over an empty queue.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="One pass over the pending queue, then exit.")] = False,
    server: ServerOpt = DEFAULT_SERVER,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="AGENTBOLT_EVALUATOR_TOKEN", help="Evaluator (or admin) token."),
    ] = None,
) -> None:
    """Score finished rollouts with a model judge: their pending evaluator reward (--name), as
    they finish, until stopped (Ctrl-C) or, with --once, after one pass."""
    text = _rubric(judge_rubric, judge_rubric_file)
    if judge_via_server and judge_key:
        raise fail("with --judge-via-server the server holds the judge's key: drop --judge-key")
    try:
        model = JudgeModel(
            judge_url,
            judge_model,
            judge_key,
            via_server=judge_via_server,
            server_url=server if judge_via_server else None,
            server_token=token if judge_via_server else None,
            cache_path=cache,
        )
        budget = JudgeBudget(max_calls=max_calls, max_tokens=max_tokens)
        evaluator = _judge(text, model, name, group_judge, budget, max_transcript_chars)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with Client(server, token) as client:
        # the server and the token, checked before any work: a refusal is one line
        client.pending_rewards(name=evaluator.name, source="evaluator", limit=1)
        worker = EvaluatorWorker(client, [evaluator], console=console, concurrency=concurrency, budget=budget)
        if not once:
            _stop_on_signals(worker)
            console.print(f"judging pending {evaluator.name!r} rewards on {server} (Ctrl-C stops)")
        total = worker.run(poll=poll, once=once)
    console.print(
        f"{evaluator.name}: {total.scored} scored, {total.errors} errors, {total.conflicts} scored meanwhile, "
        f"{total.calls} judge calls ({total.cached} cached), {total.tokens} tokens"
    )
    if budget.refused:
        console.print(f"{budget.exhausted()}: {budget.refused} judgements not made (their reward says so)")
