"""Model judges: any OpenAI-compatible chat model scores rollouts against a rubric.

- :class:`PointwiseJudge` reads one rollout and answers exactly two lines::

      SCORE: <a number between 0 and 1>
      REASON: <one sentence>

- :class:`GroupJudge` reads the N rollouts of a group (e.g. a GRPO group), numbered, and scores
  each relative to the others, one line per rollout ``<i>: <score between 0 and 1>``, then
  optionally one ``REASON:`` line. Every run's number appears exactly once.

The formats are strict: any other answer is *malformed*. It is asked again ``retries`` times
with a reminder of the format (the bad answer stays in the conversation), then given up on: the
judgement is an error ``malformed judge answer: <its first 200 characters>``, written as a
reward in state error (never a zero). A timeout or an HTTP error gives an error naming it.

Every call is recorded in the judgement's ``data["calls"]`` (request messages, answer, usage,
latency, cost when a price is given, cached or not); ``data["judge"]`` names the model and URL
(never the key) and ``data["cut"]`` the transcript cut (see
:func:`agentbolt.evaluators.record.transcript`).

Identical requests (same model, URL, messages, max_tokens and temperature) are answered once per
process, and across processes from an optional JSON-lines ``cache_path``. A :class:`JudgeBudget`
shared by the judges of a run caps calls and tokens: a call that would exceed it is not made.

With ``JudgeModel(via_server=True)`` calls go through the agentbolt server's judge proxy
(``/judge/v1/chat/completions``): the hosted model's key stays with the server, like the
gateway's upstream keys, and the judge holds only an evaluator token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx

from agentbolt.errors import ConfigError
from agentbolt.evaluators.base import Evaluator, Judgement, checked_name
from agentbolt.evaluators.record import RolloutRecord, transcript, usage_tokens
from agentbolt.schemas import RewardScale

__all__ = [
    "GROUP_SYSTEM",
    "POINTWISE_SYSTEM",
    "BudgetExhausted",
    "GroupJudge",
    "JudgeBudget",
    "JudgeCall",
    "JudgeModel",
    "Malformed",
    "PointwiseJudge",
    "clear_cache",
    "parse_group",
    "parse_pointwise",
]

T = TypeVar("T")

UPSTREAM_HEADER = "X-Agentbolt-Upstream"
JUDGE_PROXY_PATH = "/judge/v1/chat/completions"

POINTWISE_SYSTEM = """You are a strict evaluator of an AI agent's run. Read the rubric and the run, then judge how well \
the run meets the rubric: 0 is the worst, 1 the best.
Answer with exactly two lines and nothing else:
SCORE: <a number between 0 and 1>
REASON: <one sentence>"""

GROUP_SYSTEM = """You are a strict evaluator of an AI agent's runs. You see {n} runs of the agent on the same task. \
Read the rubric and every run, then score each run relative to the others: the best run gets the highest score, \
worse runs lower scores, equal runs equal scores, from 0 (worst) to 1 (best).
Answer with exactly one line per run, in this form, and nothing else:
{example}
You may add one last line: REASON: <one sentence>"""

POINTWISE_REMINDER = (
    "Your answer did not follow the format ({why}). Answer again with exactly two lines and nothing else:\n"
    "SCORE: <a number between 0 and 1>\nREASON: <one sentence>"
)
GROUP_REMINDER = (
    "Your answer did not follow the format ({why}). Answer again with exactly one line per run "
    "(runs 1 to {n}), each '<run number>: <score between 0 and 1>', then optionally 'REASON: <one sentence>'."
)

_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_SCORE_LINE = re.compile(rf"SCORE:[ \t]*{_NUMBER}")
_REASON_LINE = re.compile(r"REASON:[ \t]*(\S.*)")
_GROUP_LINE = re.compile(rf"(\d+):[ \t]*{_NUMBER}")


# ---------------------------------------------------------------------------- strict parsing


class Malformed(ValueError):
    """A judge's answer is not in the format asked for; the message says how."""


def _unit_score(text: str) -> float:
    score = float(text)
    if not 0.0 <= score <= 1.0:
        raise Malformed(f"score {text} is not between 0 and 1")
    return score


def parse_pointwise(answer: str) -> tuple[float, str]:
    """``(score, reason)`` from exactly ``SCORE: <0-1>`` and ``REASON: <text>`` on two lines
    (whitespace around the answer and each line is allowed); Malformed otherwise."""
    lines = [line.strip() for line in answer.strip().splitlines()]
    if len(lines) != 2:
        raise Malformed(f"{len(lines)} lines instead of 2")
    score = _SCORE_LINE.fullmatch(lines[0])
    if score is None:
        raise Malformed(f"the first line is not 'SCORE: <number>': {lines[0][:80]!r}")
    reason = _REASON_LINE.fullmatch(lines[1])
    if reason is None:
        raise Malformed(f"the second line is not 'REASON: <sentence>': {lines[1][:80]!r}")
    return _unit_score(score.group(1)), reason.group(1).strip()


def parse_group(answer: str, n: int) -> tuple[list[float], str]:
    """``(scores of runs 1..n, reason)`` from one ``<i>: <score>`` line per run, every run
    exactly once, and an optional last ``REASON:`` line; Malformed otherwise."""
    lines = [line.strip() for line in answer.strip().splitlines()]
    reason = ""
    if lines and (found := _REASON_LINE.fullmatch(lines[-1])):
        reason = found.group(1).strip()
        lines.pop()
    scores: dict[int, float] = {}
    for line in lines:
        match = _GROUP_LINE.fullmatch(line)
        if match is None:
            raise Malformed(f"the line {line[:80]!r} is not '<run number>: <score>'")
        index = int(match.group(1))
        if not 1 <= index <= n:
            raise Malformed(f"run {index} does not exist (runs are 1 to {n})")
        if index in scores:
            raise Malformed(f"run {index} is scored twice")
        scores[index] = _unit_score(match.group(2))
    missing = [i for i in range(1, n + 1) if i not in scores]
    if missing:
        raise Malformed(f"no score for run{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    return [scores[i] for i in range(1, n + 1)], reason


# ---------------------------------------------------------------------------- budget


class BudgetExhausted(Exception):
    """The run's judge budget would be exceeded: the call is not made."""


class JudgeBudget:
    """Calls and tokens the judges of one run may spend (None: no limit).

    A call is made only if it keeps within both limits: calls made so far + 1 <= ``max_calls``,
    and tokens used so far + the call's largest possible use <= ``max_tokens``, where the
    largest possible use is the prompt's characters / 4 plus the judge's ``max_tokens`` (a
    stated estimate: the model's own count is what is recorded once it answered). Cached answers
    cost nothing."""

    def __init__(self, max_calls: int | None = None, max_tokens: int | None = None) -> None:
        if (max_calls is not None and max_calls < 0) or (max_tokens is not None and max_tokens < 0):
            raise ConfigError(
                f"a judge budget is not negative: max_calls={max_calls}, max_tokens={max_tokens}"
            )
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.calls = 0
        self.tokens = 0
        self.refused = 0
        """Calls not made because they would have exceeded the budget."""
        self._reserved = 0
        self._lock = threading.Lock()

    def exhausted(self) -> str:
        return f"judge budget exhausted ({self.calls} calls, {self.tokens} tokens)"

    def reserve(self, estimate: int) -> None:
        """Count a call about to be made; BudgetExhausted instead when it would not fit."""
        with self._lock:
            over_calls = self.max_calls is not None and self.calls + 1 > self.max_calls
            planned = self.tokens + self._reserved + estimate
            if over_calls or (self.max_tokens is not None and planned > self.max_tokens):
                self.refused += 1
                raise BudgetExhausted(self.exhausted())
            self.calls += 1
            self._reserved += estimate

    def settle(self, estimate: int, used: int) -> None:
        """The call answered (or failed) having used ``used`` tokens."""
        with self._lock:
            self._reserved -= estimate
            self.tokens += used


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class JudgeCall:
    """One request to the judge model, as recorded with the judgement."""

    request: list[dict[str, Any]]
    answer: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0
    cost_usd: float | None = None
    cached: bool = False
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# identical requests answered once per process: sha256 key -> {"answer", "usage"}
_CACHE: dict[str, dict[str, Any]] = {}
_LOADED: set[str] = set()
_INFLIGHT: dict[tuple[int, str], asyncio.Future[dict[str, Any] | None]] = {}
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every cached answer of this process (files are not touched)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _LOADED.clear()


class JudgeModel:
    """An OpenAI-compatible chat model used as a judge (``POST <base_url>/chat/completions``).

    - ``api_key``: sent as a bearer token to the model (never recorded);
    - ``via_server``: call through the agentbolt server's judge proxy instead, with the
      evaluator token ``server_token``; the server adds the key it holds for ``base_url``.
      ``server_url`` / ``server_token`` default to the server the evaluation run writes to;
    - ``timeout``: seconds per call; ``max_tokens`` and ``temperature``: sampling (greedy by
      default, so a repeated question gets the same answer);
    - ``price_per_1k_tokens``: USD per 1,000 tokens, to record each call's cost;
    - ``cache_path``: a JSON-lines file of answers, read once and appended to;
    - ``transport``: an httpx transport (tests replay recorded answers with one).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        via_server: bool = False,
        server_url: str | None = None,
        server_token: str | None = None,
        timeout: float = 60.0,
        max_tokens: int = 200,
        temperature: float = 0.0,
        price_per_1k_tokens: float | None = None,
        cache_path: str | Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not re.fullmatch(r"https?://[\x21-\x7e]+", base_url or ""):
            raise ConfigError(f"the judge's base_url must be an http(s) URL, got {base_url!r}")
        if not model:
            raise ConfigError("the judge needs a model name")
        if timeout <= 0 or max_tokens < 1:
            raise ConfigError(
                f"the judge needs timeout > 0 and max_tokens >= 1, got {timeout} and {max_tokens}"
            )
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.via_server, self.server_url, self.server_token = via_server, server_url, server_token
        self.timeout, self.max_tokens, self.temperature = timeout, max_tokens, temperature
        self.price_per_1k_tokens = price_per_1k_tokens
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.transport = transport

    def describe(self) -> dict[str, Any]:
        """Who judged, as recorded with each judgement (never the key)."""
        return {"model": self.model, "base_url": self.base_url, "via_server": self.via_server}

    def config(self) -> dict[str, Any]:
        return {**self.describe(), "max_tokens": self.max_tokens, "temperature": self.temperature}

    def use_server(self, url: str | None, token: str | None) -> None:
        if self.via_server and self.server_url is None:
            self.server_url, self.server_token = url, token

    def cache_key(self, messages: Sequence[dict[str, Any]]) -> str:
        text = json.dumps(
            [self.model, self.base_url, list(messages), self.max_tokens, self.temperature], sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def _cost(self, usage: dict[str, Any], cached: bool) -> float | None:
        if self.price_per_1k_tokens is None:
            return None
        tokens = usage_tokens(usage)
        return 0.0 if cached else (tokens or 0) / 1000 * self.price_per_1k_tokens

    async def call(self, messages: Sequence[dict[str, Any]], budget: JudgeBudget | None = None) -> JudgeCall:
        """Ask the model (or take the cached answer); BudgetExhausted when the budget forbids
        the call. Failures come back as a JudgeCall with ``error`` set."""
        request = [dict(m) for m in messages]
        key = self.cache_key(request)
        loop = asyncio.get_running_loop()
        hit = self._cached(key)
        if hit is None and (asked := _INFLIGHT.get((id(loop), key))) is not None:
            hit = await asyncio.shield(asked)  # the same question is being asked right now
        if hit is not None:
            usage = dict(hit.get("usage") or {})
            return JudgeCall(request, hit["answer"], usage, 0.0, self._cost(usage, True), cached=True)
        estimate = sum(len(str(m.get("content") or "")) for m in request) // 4 + self.max_tokens
        if budget is not None:
            budget.reserve(estimate)
        future: asyncio.Future[dict[str, Any] | None] = loop.create_future()
        _INFLIGHT[(id(loop), key)] = future
        call: JudgeCall | None = None
        try:
            call = await self._post(request)
        finally:
            _INFLIGHT.pop((id(loop), key), None)
            answered = call is not None and call.error is None
            if budget is not None:
                used = usage_tokens(call.usage) if call is not None else None
                budget.settle(estimate, used if used is not None else (estimate if answered else 0))
            result = {"answer": call.answer, "usage": call.usage} if call is not None and answered else None
            future.set_result(result)  # waiters on a failed call ask for themselves
            if result is not None:
                self._store(key, result)
        return call

    def _cached(self, key: str) -> dict[str, Any] | None:
        with _CACHE_LOCK:
            path = str(self.cache_path) if self.cache_path is not None else None
            if path is not None and path not in _LOADED:
                _LOADED.add(path)
                _CACHE.update(_read_cache(self.cache_path))  # type: ignore[arg-type]
            return _CACHE.get(key)

    def _store(self, key: str, answer: dict[str, Any]) -> None:
        with _CACHE_LOCK:
            _CACHE[key] = answer
            if self.cache_path is not None:
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                with self.cache_path.open("a") as out:
                    out.write(json.dumps({"key": key, **answer}) + "\n")

    def _endpoint(self) -> tuple[str, dict[str, str]]:
        if not self.via_server:
            return f"{self.base_url}/chat/completions", (
                {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            )
        if not self.server_url:
            raise ConfigError("JudgeModel(via_server=True) needs the agentbolt server's URL (server_url)")
        headers = {UPSTREAM_HEADER: self.base_url}
        if self.server_token:
            headers["authorization"] = f"Bearer {self.server_token}"
        return f"{self.server_url.rstrip('/')}{JUDGE_PROXY_PATH}", headers

    def _where(self) -> str:
        via = " via the agentbolt server" if self.via_server else ""
        return f"judge model {self.model!r} at {self.base_url}{via}"

    async def _post(self, request: list[dict[str, Any]]) -> JudgeCall:
        url, headers = self._endpoint()
        body = {
            "model": self.model,
            "messages": request,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        started = time.monotonic()

        def failed(error: str) -> JudgeCall:
            return JudgeCall(
                request, None, {}, time.monotonic() - started, self._cost({}, False), error=error
            )

        try:
            async with httpx.AsyncClient(timeout=self.timeout, transport=self.transport) as http:
                response = await http.post(url, json=body, headers=headers)
        except httpx.TimeoutException:
            return failed(f"{self._where()} timed out after {self.timeout:g} s")
        except httpx.HTTPError as exc:
            return failed(f"{self._where()} could not be reached: {type(exc).__name__}: {exc}")
        latency = time.monotonic() - started
        if response.status_code == 504 and self.via_server:
            return failed(f"{self._where()} timed out (HTTP 504): {_error_message(response)}")
        if response.status_code >= 400:
            return failed(f"{self._where()} answered HTTP {response.status_code}: {_error_message(response)}")
        answer, usage = _completion(response)
        if answer is None:
            return failed(f"{self._where()} answered no chat completion: {response.text[:200]!r}")
        return JudgeCall(request, answer, usage, latency, self._cost(usage, False))


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            out[row["key"]] = {"answer": str(row["answer"]), "usage": dict(row.get("usage") or {})}
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed run: that answer is asked again
    return out


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
        return str(message or body)[:300]
    except Exception:
        return response.text[:300] or "(empty body)"


def _completion(response: httpx.Response) -> tuple[str | None, dict[str, Any]]:
    try:
        body = response.json()
        content = body["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, {}
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return (content if isinstance(content, str) else None), usage


# ---------------------------------------------------------------------------- the judges


@dataclass
class _Asked(Generic[T]):
    """What asking a judge gave: the parsed answer, or an error; every call made."""

    parsed: T | None
    calls: list[dict[str, Any]]
    error: str | None


async def _ask(
    model: JudgeModel,
    budget: JudgeBudget | None,
    messages: list[dict[str, Any]],
    parse: Callable[[str], T],
    retries: int,
    reminder: Callable[[str], str],
) -> _Asked[T]:
    """Ask, and ask again ``retries`` times while the answer is malformed."""
    calls: list[dict[str, Any]] = []
    answer = ""
    for _ in range(retries + 1):
        try:
            call = await model.call(messages, budget)
        except BudgetExhausted as exc:
            return _Asked(None, calls, str(exc))
        calls.append(call.as_dict())
        if call.error is not None or call.answer is None:
            return _Asked(None, calls, call.error or "the judge gave no answer")
        answer = call.answer
        try:
            return _Asked(parse(answer), calls, None)
        except Malformed as exc:
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": reminder(str(exc))},
            ]
    return _Asked(None, calls, f"malformed judge answer: {answer[:200]}")


class _ModelJudge(Evaluator):
    """What both judges share: a rubric, a model, a budget, a transcript limit."""

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str,
        max_transcript_chars: int,
        retries: int,
        budget: JudgeBudget | None,
    ) -> None:
        if not rubric or not rubric.strip():
            raise ConfigError("a judge needs a rubric: what a good run does")
        if max_transcript_chars < 500:
            raise ConfigError(f"max_transcript_chars must be at least 500, got {max_transcript_chars}")
        if retries < 0:
            raise ConfigError(f"retries cannot be negative, got {retries}")
        self.rubric, self.model, self.name = rubric.strip(), model, checked_name(name)
        self.scale = RewardScale()
        self.max_transcript_chars, self.retries, self.budget = max_transcript_chars, retries, budget

    def config(self) -> dict[str, Any]:
        system = GROUP_SYSTEM if self.group else POINTWISE_SYSTEM
        return {
            **super().config(),
            "rubric": self.rubric,
            "model": self.model.config(),
            "max_transcript_chars": self.max_transcript_chars,
            "retries": self.retries,
            "prompt": hashlib.sha256(system.encode()).hexdigest()[:12],
        }

    def use_server(self, url: str | None, token: str | None) -> None:
        self.model.use_server(url, token)

    def _data(self, asked: _Asked[Any], cut: dict[str, int] | None, reason: str) -> dict[str, Any]:
        return {"reason": reason, "calls": asked.calls, "judge": self.model.describe(), "cut": cut}


class PointwiseJudge(_ModelJudge):
    """A model scores each rollout alone against ``rubric``, from 0 to 1, with a reason.

    ``max_transcript_chars``: the longest transcript shown (longer ones are cut, see
    :func:`~agentbolt.evaluators.record.transcript`); ``retries``: how many times a malformed
    answer is asked again; ``budget``: shared by the judges of a run."""

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str = "judge",
        max_transcript_chars: int = 6000,
        retries: int = 1,
        budget: JudgeBudget | None = None,
    ) -> None:
        super().__init__(rubric, model, name, max_transcript_chars, retries, budget)

    def messages(self, record: RolloutRecord) -> tuple[list[dict[str, Any]], dict[str, int] | None]:
        """The request for ``record``, and the transcript cut made."""
        text, cut = transcript(record, self.max_transcript_chars)
        user = f"RUBRIC:\n{self.rubric}\n\nTHE RUN:\n{text}"
        return [{"role": "system", "content": POINTWISE_SYSTEM}, {"role": "user", "content": user}], cut

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        return list(await asyncio.gather(*(self._one(r) for r in records)))

    async def _one(self, record: RolloutRecord) -> Judgement:
        messages, cut = self.messages(record)
        asked = await _ask(
            self.model,
            self.budget,
            messages,
            parse_pointwise,
            self.retries,
            lambda why: POINTWISE_REMINDER.format(why=why),
        )
        if asked.parsed is None:
            return Judgement(score=None, error=asked.error, data=self._data(asked, cut, ""))
        score, reason = asked.parsed
        return Judgement(score=score, reason=reason, data=self._data(asked, cut, reason))


class GroupJudge(_ModelJudge):
    """A model sees the N rollouts of a group together, numbered, and scores each relative to
    the others (0-1): a reward for GRPO on an agent that has none. The task is shown once when
    the runs share it; each transcript gets ``max_transcript_chars / N`` characters."""

    group = True

    def __init__(
        self,
        rubric: str,
        model: JudgeModel,
        name: str = "group_judge",
        max_transcript_chars: int = 12000,
        retries: int = 1,
        budget: JudgeBudget | None = None,
    ) -> None:
        super().__init__(rubric, model, name, max_transcript_chars, retries, budget)

    def messages(
        self, records: Sequence[RolloutRecord]
    ) -> tuple[list[dict[str, Any]], list[dict[str, int] | None]]:
        """The request for a group, and each run's transcript cut."""
        n = len(records)
        shared = all(r.task == records[0].task for r in records)
        per_run = max(300, self.max_transcript_chars // n)
        shown = [transcript(r, per_run, task=not shared) for r in records]
        task = (
            f"THE TASK (the same for every run):\n{json.dumps(records[0].task, ensure_ascii=False, indent=1)}\n\n"
            if shared
            else ""
        )
        runs = "\n\n".join(f"=== RUN {i} ===\n{text}" for i, (text, _) in enumerate(shown, 1))
        example = "\n".join(f"{i}: <score>" for i in range(1, n + 1))
        system = GROUP_SYSTEM.format(n=n, example=example)
        user = f"RUBRIC:\n{self.rubric}\n\n{task}{runs}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], [
            cut for _, cut in shown
        ]

    async def judge(self, records: Sequence[RolloutRecord]) -> list[Judgement]:
        if not records:
            return []
        n = len(records)
        messages, cuts = self.messages(records)
        asked = await _ask(
            self.model,
            self.budget,
            messages,
            lambda answer: parse_group(answer, n),
            self.retries,
            lambda why: GROUP_REMINDER.format(why=why, n=n),
        )
        first = records[0].rollout
        group_id = first.group_id or first.id
        judgements = []
        for position, cut in enumerate(cuts, 1):
            reason = asked.parsed[1] if asked.parsed is not None else ""
            data = {
                **self._data(asked, cut, reason),
                "group": {"id": group_id, "size": n, "position": position},
            }
            data["group"]["rollouts"] = [r.rollout.id for r in records]
            if asked.parsed is None:
                judgements.append(Judgement(score=None, error=asked.error, data=data))
            else:
                judgements.append(Judgement(score=asked.parsed[0][position - 1], reason=reason, data=data))
        return judgements
