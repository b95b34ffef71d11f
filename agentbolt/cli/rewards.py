"""The reward flags of ``agentbolt train ALGORITHM``: the evaluators a command line can give
(the algorithm's ``evaluators`` field is Python-only), a model judge with a rubric and a
person's review."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Any

from agentbolt.cli.common import keyword_option
from agentbolt.errors import ConfigError

__all__ = ["REWARD_PANEL", "evaluators", "reward_parameters"]

REWARD_PANEL = "Reward options"


def reward_parameters() -> list[inspect.Parameter]:
    """The flags of a model judge (the same as ``agentbolt judge`` gives it) and of reviews."""
    return [
        keyword_option(
            "judge_rubric",
            str | None,
            "--judge-rubric",
            help="A model judge scores each run by this rubric: reward 'judge' on 0-1"
            " ('group_judge' with --group-judge); train on it with --reward judge.",
            panel=REWARD_PANEL,
        ),
        keyword_option(
            "judge_rubric_file",
            Path | None,
            "--judge-rubric-file",
            help="The judge's rubric, from a file.",
            panel=REWARD_PANEL,
        ),
        keyword_option(
            "judge_url",
            str | None,
            "--judge-url",
            help="The judge's OpenAI-compatible endpoint (its key from $AGENTBOLT_JUDGE_API_KEY).",
            panel=REWARD_PANEL,
        ),
        keyword_option(
            "judge_model", str | None, "--judge-model", help="The judge's model name.", panel=REWARD_PANEL
        ),
        keyword_option(
            "judge_via_server",
            bool | None,
            "--judge-via-server",
            help="Call the judge through the agentbolt server's judge proxy: the key stays with the"
            " server (listed in its upstream keys for --judge-url).",
            panel=REWARD_PANEL,
        ),
        keyword_option(
            "group_judge",
            bool | None,
            "--group-judge",
            help="The judge sees each group's runs together and scores them against each other.",
            panel=REWARD_PANEL,
        ),
        keyword_option(
            "review",
            list[str] | None,
            "--review",
            help="NAME[:LOW-HIGH]: rollouts await a person's score (default 1-5, integer bounds:"
            " whole steps), given in the dashboard or with agentbolt review (repeatable).",
            panel=REWARD_PANEL,
        ),
    ]


def evaluators(params: dict[str, Any]) -> list[Any]:
    """The evaluators the reward flags ask for: a judge (with a rubric), reviews."""
    found: list[Any] = [_review(spec) for spec in params.get("review") or []]
    judge = _judge(params)
    return [judge, *found] if judge is not None else found


def _judge(params: dict[str, Any]) -> Any:
    rubric, path = params.get("judge_rubric"), params.get("judge_rubric_file")
    if rubric is not None and path is not None:
        raise ConfigError("give the judge's rubric once: --judge-rubric TEXT or --judge-rubric-file PATH")
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"--judge-rubric-file: {path} does not exist")
        rubric = Path(path).read_text()
    if rubric is None:
        if any(params.get(k) for k in ("judge_url", "judge_model", "group_judge", "judge_via_server")):
            raise ConfigError("--judge-url, --judge-model and --group-judge need a rubric (--judge-rubric)")
        return None
    if not rubric.strip():
        raise ConfigError("the judge's rubric is empty")
    if not params.get("judge_url") or not params.get("judge_model"):
        raise ConfigError("a judge needs --judge-url (OpenAI-compatible endpoint) and --judge-model")
    from agentbolt.evaluators.judge import GroupJudge, JudgeModel, PointwiseJudge

    via_server = bool(params.get("judge_via_server"))
    key = None if via_server else os.environ.get("AGENTBOLT_JUDGE_API_KEY")
    model = JudgeModel(params["judge_url"], params["judge_model"], api_key=key, via_server=via_server)
    return GroupJudge(rubric, model) if params.get("group_judge") else PointwiseJudge(rubric, model)


_REVIEW = re.compile(r"^([^:]+)(?::(-?\d+(?:\.\d+)?)-(-?\d+(?:\.\d+)?))?$")


def _review(spec: str) -> Any:
    """``--review human`` (1-5 stars) or ``--review NAME:LOW-HIGH`` (whole steps when both
    bounds are integers, any number between them otherwise)."""
    from pydantic import ValidationError

    from agentbolt.evaluators import HumanReview
    from agentbolt.schemas import RewardScale

    match = _REVIEW.match(spec.strip())
    if match is None:
        raise ConfigError(f"--review {spec!r}: expected NAME or NAME:LOW-HIGH, e.g. human:1-5")
    name, low, high = match.groups()
    if low is None:
        return HumanReview(name)
    whole = "." not in low + high
    try:
        scale = RewardScale(low=float(low), high=float(high), step=1.0 if whole else None)
    except ValidationError as exc:
        raise ConfigError(
            f"--review {spec!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}"
        ) from None
    return HumanReview(name, scale=scale)
