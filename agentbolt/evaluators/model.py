"""The judge's model: any OpenAI-compatible chat completions endpoint, called over httpx.

- :class:`JudgeModel` asks the model, directly (with its key) or through the agentbolt server's
  judge proxy (``via_server``: ``POST /judge/v1/chat/completions`` with the header
  ``X-Agentbolt-Upstream: <base_url>``; the server adds the key it holds, so the judge never
  holds it). Every call becomes a :class:`JudgeCall`, recorded with the judgement; a timeout,
  an HTTP error or an answer that is no chat completion is a JudgeCall with ``error`` set.
- Identical requests (the URL and the whole body: model, messages with the rubric, max_tokens,
  temperature) are answered once per process, including one asked while the same is in flight,
  and across processes from an optional JSON-lines ``cache_path``. A cached answer is recorded
  as cached. Only a greedy judge (temperature 0) is cached, and only a well-formed answer (the
  judge's format, :func:`JudgeModel.call`'s ``valid``): a sampled answer is a new draw each
  time, and a malformed one must be asked again, not repeated.
- :class:`JudgeBudget` caps the calls and tokens of the judges of a run: a call that would
  exceed it is not made (:class:`BudgetExhausted`).
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
from typing import Any

import httpx

from agentbolt.errors import ConfigError
from agentbolt.evaluators.record import usage_tokens

__all__ = [
    "JUDGE_PROXY_PATH",
    "UPSTREAM_HEADER",
    "BudgetExhausted",
    "JudgeBudget",
    "JudgeCall",
    "JudgeModel",
    "clear_cache",
]

UPSTREAM_HEADER = "X-Agentbolt-Upstream"
JUDGE_PROXY_PATH = "/judge/v1/chat/completions"


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
        """The cache's key for ``messages``: the judge's whole identity (where it is asked, and
        the request body it sends: model, messages with the rubric, every sampling parameter)."""
        text = json.dumps([self.base_url, self._body(list(messages))], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def caches(self) -> bool:
        """Whether answers are cached at all: only a greedy judge's (``temperature`` 0). A sampled
        judge is asked every time: each answer is a new draw, and a cached one would repeat it."""
        return self.temperature == 0

    def _body(self, request: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": request,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def _cost(self, usage: dict[str, Any], cached: bool) -> float | None:
        if self.price_per_1k_tokens is None:
            return None
        tokens = usage_tokens(usage)
        return 0.0 if cached else (tokens or 0) / 1000 * self.price_per_1k_tokens

    async def call(
        self,
        messages: Sequence[dict[str, Any]],
        budget: JudgeBudget | None = None,
        valid: Callable[[str], bool] | None = None,
    ) -> JudgeCall:
        """Ask the model (or take the cached answer); BudgetExhausted when the budget forbids
        the call. Failures come back as a JudgeCall with ``error`` set. ``valid``: whether an
        answer is well formed; only those are cached (and a cached one that is not, written by an
        older version, is asked again). A sampled judge (:attr:`caches`) is never cached."""
        request = [dict(m) for m in messages]
        key = self.cache_key(request)
        hit = await self._answered(key) if self.caches else None
        if hit is not None and valid is not None and not valid(hit["answer"]):
            hit = None
        if hit is not None:
            usage = dict(hit.get("usage") or {})
            return JudgeCall(request, hit["answer"], usage, 0.0, self._cost(usage, True), cached=True)
        estimate = sum(len(str(m.get("content") or "")) for m in request) // 4 + self.max_tokens
        if budget is None:
            return await self._post_shared(key, request, valid)
        budget.reserve(estimate)
        try:
            call = await self._post_shared(key, request, valid)
        except BaseException:  # cancelled: count the call as it might have been
            budget.settle(estimate, estimate)
            raise
        used = usage_tokens(call.usage)
        budget.settle(estimate, used if used is not None else (estimate if call.error is None else 0))
        return call

    async def _answered(self, key: str) -> dict[str, Any] | None:
        """The cached answer to ``key``, or that of the same request being asked right now."""
        hit = self._cached(key)
        asked = _INFLIGHT.get((id(asyncio.get_running_loop()), key))
        if hit is None and asked is not None:
            hit = await asyncio.shield(asked)  # None when it failed: then ask for ourselves
        return hit

    async def _post_shared(
        self, key: str, request: list[dict[str, Any]], valid: Callable[[str], bool] | None
    ) -> JudgeCall:
        """Post ``request``; identical requests made meanwhile wait for this answer (a greedy
        judge's; a sampled one's are asked apart). A malformed answer is neither shared nor kept."""
        if not self.caches:
            return await self._post(request)
        slot = (id(asyncio.get_running_loop()), key)
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        _INFLIGHT[slot] = future
        answer = None
        try:
            call = await self._post(request)
            if call.error is None and call.answer is not None and (valid is None or valid(call.answer)):
                answer = {"answer": call.answer, "usage": call.usage}
                self._store(key, answer)
            return call
        finally:
            _INFLIGHT.pop(slot, None)
            future.set_result(answer)

    def _cached(self, key: str) -> dict[str, Any] | None:
        with _CACHE_LOCK:
            path = self.cache_path
            if path is not None and str(path) not in _LOADED:
                _LOADED.add(str(path))
                _CACHE.update(_read_cache(path))
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
        body = self._body(request)
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
