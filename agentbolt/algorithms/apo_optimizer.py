"""The optimizer-model side of APO: runs rendered as evidence, critique and rewrite requests,
and the checks every answer must pass.

Any OpenAI-compatible endpoint serves as the optimizer. Each call has a timeout and no hidden
retries (the ``openai`` client's own are off): a transient failure (a timeout, a lost connection,
HTTP 408, 409, 429 or 5xx), an empty answer, an answer without ``<prompt>...</prompt>``, one over
the length limit, or a prompt already tried is counted in :class:`APOStats` and asked again up to
``retries`` times with backoff, then given up on. Any other HTTP error (400 bad request, 401 bad
key, 403, 404 unknown model...) says the run is misconfigured and will not heal: it stops the run
at once with a :class:`~agentbolt.errors.ConfigError` naming the model and the status, instead
of quietly returning the seed prompt.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import openai

from agentbolt.adapters import latest_attempt, to_chat_rows
from agentbolt.algorithms.rewards import AGENT, RewardChoice, resolve
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.schemas import EventType, Rollout, RolloutStatus

__all__ = [
    "APOStats",
    "Optimizer",
    "RunRecord",
    "extract_prompt",
    "pick_examples",
    "render_runs",
    "run_record",
    "score_of",
]

_PROMPT_RE = re.compile(r"<prompt>(.*?)</prompt>", re.DOTALL | re.IGNORECASE)

SYSTEM = (
    "You are an expert prompt engineer. You improve the system prompt of an AI agent from evidence: "
    "runs of the agent on tasks, each with its reward (higher is better) and any error."
)
CRITIQUE = """The agent's current system prompt:
<current_prompt>
{prompt}
</current_prompt>

Runs of the agent with this prompt:

{runs}

In at most {sentences} sentences, explain what in the system prompt leads to the low-reward or failed runs
and what the prompt should say instead. Do not write the new prompt yet."""
REWRITE = """The agent's current system prompt:
<current_prompt>
{prompt}
</current_prompt>

A critique of it, drawn from runs of the agent:
<critique>
{critique}
</critique>

Write an improved system prompt that fixes what the critique names and keeps what already works.
Keep any placeholders in braces unchanged. Reply with the new prompt only, between <prompt> and
</prompt>, in at most {max_chars} characters."""


@dataclass
class APOStats:
    """What happened to the optimizer's answers and to the rollout budget."""

    optimizer_calls: int = 0
    optimizer_errors: int = 0
    """Calls that failed: HTTP errors, connection failures, timeouts."""
    timeouts: int = 0
    """Of ``optimizer_errors``: calls that ran past ``optimizer_timeout``."""
    empty_outputs: int = 0
    missing_prompt: int = 0
    """Rewrites with no ``<prompt>...</prompt>`` in them."""
    too_long: int = 0
    duplicates: int = 0
    """Rewrites identical to a prompt already tried."""
    retries: int = 0
    skipped_candidates: int = 0
    """Children given up on after every try failed."""
    rollouts: int = 0
    demos: int = 0
    """Demonstrations the ``bootstrap`` method found in successful training runs."""
    budget_exhausted: bool = False
    stragglers: int = 0
    """Rollouts cancelled at a batch's deadline: left out of the scores (not scored 0)."""
    reward_pending: int = 0
    """Succeeded rollouts whose chosen reward was still pending when scored: left out."""
    reward_errors: int = 0
    """Succeeded rollouts whose chosen reward could not be given: left out."""
    judge_calls: int = 0
    """Model calls the evaluators run here made (judges), and their tokens."""
    judge_tokens: int = 0

    def as_dict(self) -> dict[str, int | bool]:
        return asdict(self)


@dataclass(frozen=True)
class _Rejected:
    counter: str
    """The :class:`APOStats` field that counts this kind of bad answer."""


@dataclass(frozen=True)
class RunRecord:
    """One rollout, as evidence for the critique."""

    task_id: str
    task_input: dict[str, Any]
    reward: float
    failed: bool
    error: str | None
    messages: list[dict[str, Any]]
    final_response: Any = None


def run_record(client: Client, rollout: Rollout, reward: RewardChoice = AGENT) -> RunRecord:
    """The rollout's conversation (from ``llm_call`` events), final response, error and the
    chosen ``reward``."""
    events = latest_attempt(client.all_events(rollout.id, type=["llm_call", "exception", "trajectory"]))
    rows = to_chat_rows(events)
    finals = [e.data.get("final_response") for e in events if e.type == "trajectory"]
    errors = [
        f"{e.data.get('type')}: {e.data.get('message')}" for e in events if e.type == EventType.EXCEPTION
    ]
    failed = rollout.status != RolloutStatus.SUCCEEDED
    return RunRecord(
        task_id=rollout.task.id,
        task_input=rollout.task.data,
        reward=score_of(rollout, reward) or 0.0,
        failed=failed,
        error=(errors[-1] if errors else rollout.error) if failed else None,
        messages=rows[-1]["messages"] if rows else [],
        final_response=finals[-1] if finals else None,
    )


def score_of(rollout: Rollout, reward: RewardChoice = AGENT) -> float | None:
    """A rollout's score: its chosen ``reward``, 0 when it failed or the run reported none; None
    (left out) when it was cancelled (a straggler) or its reward is pending or in error."""
    if rollout.status == RolloutStatus.CANCELLED:
        return None
    if rollout.status != RolloutStatus.SUCCEEDED:
        return 0.0
    resolved = resolve(rollout, reward)
    if resolved.state in ("pending", "error"):
        return None
    return resolved.value if resolved.value is not None else 0.0


def pick_examples(
    rollouts: Sequence[Rollout], k: int, rng: random.Random, reward: RewardChoice = AGENT
) -> list[Rollout]:
    """Up to ``k`` scored runs, mostly the worst: a critique learns from failures, with a success
    or two to show what works. Below the batch's best reward counts as a failure."""
    scored = [(r, s) for r in rollouts if (s := score_of(r, reward)) is not None]
    top = max((s for _, s in scored), default=0.0)
    rollouts = [r for r, _ in scored]
    failures = [r for r, s in scored if r.status != RolloutStatus.SUCCEEDED or s < top]
    successes = [r for r in rollouts if r not in failures]
    n_ok = min(len(successes), max(1, k // 3), k) if failures else min(len(successes), k)
    n_bad = min(len(failures), k - n_ok)
    return rng.sample(failures, n_bad) + rng.sample(successes, n_ok)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " […] " + text[-limit // 2 :]


def _render_message(message: dict[str, Any], prompt: str) -> str:
    content = message.get("content")
    if message.get("role") == "system" and content == prompt:
        content = "(the current system prompt)"
    calls = message.get("tool_calls")
    text = content if isinstance(content, str) else json.dumps(content)
    return f"[{message.get('role')}] {text}" + (f" tool_calls={json.dumps(calls)}" if calls else "")


def render_runs(records: Sequence[RunRecord], prompt: str, max_chars: int) -> str:
    """Runs as plain text, each clipped to ``max_chars``."""
    parts = []
    for i, run in enumerate(records, 1):
        status = f"FAILED ({run.error})" if run.failed else "succeeded"
        lines = [
            f"### Run {i}: task {run.task_id}, reward {run.reward:.3f}, {status}",
            f"Task input: {json.dumps(run.task_input, ensure_ascii=False)}",
        ]
        lines += [_render_message(m, prompt) for m in run.messages]
        if run.final_response is not None:
            lines.append(f"Final response: {run.final_response}")
        parts.append(_clip("\n".join(lines), max_chars))
    return "\n\n".join(parts) or "(no runs)"


def extract_prompt(text: str) -> str | None:
    """The last ``<prompt>...</prompt>`` in ``text``, stripped; None when there is none.

    An answer with a closing tag only counts too (what precedes it): small models asked to
    answer "between <prompt> and </prompt>" often start the prompt right away (SmolLM2 does)."""
    found = _PROMPT_RE.findall(text)
    if found:
        return str(found[-1]).strip()
    head, closed, _ = text.partition("</prompt>")
    return head.strip() if closed and "<prompt>" not in head.lower() else None


class Optimizer:
    """Critique and rewrite calls to an OpenAI-compatible model, with checks and counted retries."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        *,
        timeout: float,
        retries: int,
        backoff: float,
        max_prompt_chars: int,
        temperature: float,
        max_tokens: int,
        stats: APOStats,
    ) -> None:
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
        self.base_url, self.model, self.retries, self.backoff = base_url, model, retries, backoff
        self.max_prompt_chars, self.temperature, self.max_tokens = max_prompt_chars, temperature, max_tokens
        self.stats = stats

    def close(self) -> None:
        self.client.close()

    def propose(
        self, prompt: str, runs: Sequence[RunRecord], seen: set[str], max_chars: int = 2000
    ) -> str | None:
        """Critique ``prompt`` from ``runs``, then rewrite it; None when either step gave nothing usable."""
        critique = self.critique(prompt, render_runs(runs, prompt, max_chars))
        return self.rewrite(prompt, critique, seen) if critique is not None else None

    def critique(self, prompt: str, runs: str, sentences: int = 6) -> str | None:
        content = CRITIQUE.format(prompt=prompt, runs=runs, sentences=sentences)
        return self._ask(content, lambda text: _clip(text.strip(), 4000) or _Rejected("empty_outputs"))

    def rewrite(self, prompt: str, critique: str, seen: set[str]) -> str | None:
        content = REWRITE.format(prompt=prompt, critique=critique, max_chars=self.max_prompt_chars)
        return self._ask(content, lambda text: self._check(text, seen))

    def _check(self, text: str, seen: set[str]) -> str | _Rejected:
        new = extract_prompt(text)
        if not text.strip() or new == "":
            return _Rejected("empty_outputs")
        if new is None:
            return _Rejected("missing_prompt")
        if len(new) > self.max_prompt_chars:
            return _Rejected("too_long")
        return _Rejected("duplicates") if new in seen else new

    def _ask(self, content: str, check: Callable[[str], str | _Rejected]) -> str | None:
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.retries += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
            text = self._call(content)
            verdict = check(text) if text is not None else None
            if isinstance(verdict, str):
                return verdict
            if verdict is not None:
                setattr(self.stats, verdict.counter, getattr(self.stats, verdict.counter) + 1)
        return None

    def _call(self, content: str) -> str | None:
        self.stats.optimizer_calls += 1
        messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens
            )
        except (openai.APIError, ValueError) as exc:  # ValueError: a body that is not JSON
            self.stats.optimizer_errors += 1
            if isinstance(exc, openai.APIStatusError) and not _transient(exc.status_code):
                raise self._config_error(exc) from None
            self.stats.timeouts += isinstance(exc, openai.APITimeoutError)
            return None
        text = _content(response)
        self.stats.optimizer_errors += text is None
        return text

    def _config_error(self, exc: openai.APIStatusError) -> ConfigError:
        body = exc.body
        detail = body.get("message") if isinstance(body, dict) else None
        return ConfigError(
            f"APO's optimizer model {self.model!r} at {self.base_url} answered HTTP {exc.status_code}"
            f" ({detail or exc.message}): check optimizer_base_url, optimizer_model and the API key"
            " (optimizer_api_key or $OPENAI_API_KEY)"
        )


def _transient(status: int) -> bool:
    """What the openai client itself would retry: time-outs, conflicts, rate limits, 5xx."""
    return status in (408, 409, 429) or status >= 500


def _content(response: Any) -> str | None:
    """The first choice's text; None when the body is not a chat completion at all."""
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list):
        return None
    message = getattr(choices[0], "message", None) if choices else None
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else ""
