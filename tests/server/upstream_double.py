"""TEST DOUBLE: a small, deterministic OpenAI-compatible model server on 127.0.0.1.

Not a model. It answers chat and legacy completions (streamed or not, ``n`` choices, tool
calls) with text picked by a hash of the request, and speaks vLLM's extensions the way vLLM
does: ``return_token_ids`` adds top-level ``prompt_token_ids`` (chat) or per-choice ones
(completions) and per-choice ``token_ids``; ``logprobs`` adds OpenAI logprobs. Extras appear
only when asked for, so tests can see that the gateway asks and strips. The same request gives
the same answer streamed or not.

Knobs for tests: ``fail_next`` (statuses to answer the next calls with), ``delay`` (seconds
every call waits), ``delay_next`` (seconds the next calls wait, one each), ``strict`` (reject
``return_token_ids`` as OpenAI does; or a set of the parameters to reject, each with a 400 naming
it), ``model_version`` (sent as ``x-model-version``), models
named ``error-500`` (a 500 that echoes the caller's Authorization header, to test scrubbing)
and ``broken-stream`` (a stream cut off mid-way). ``serves_responses``: answer ``/v1/responses`` as
vLLM 0.34.0 does (a fixed answer, with token ids and logprobs when asked for them:
``upstream_double_responses.py``); off, that path is a 404. ``calls`` holds what each request
carried.

LoRA as vLLM 0.34.0 does it (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): ``/v1/load_lora_adapter``
answers 200 with a text body, refuses (400) a missing name or path, the base model's name, and a
name already loaded unless ``load_inplace``, and 404s a path with no adapter;
``/v1/unload_lora_adapter`` 404s an unknown name. Loaded adapters (``adapters``: name -> path)
are listed by ``/v1/models``. As in vLLM, unknown request fields are ignored, never an error
(unless ``strict`` names them). The shapes come from vLLM's source:
``tests/contracts/vllm_0_34_0.json``, checked by ``tests/contracts/test_vllm_contract.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import upstream_double_responses
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentbolt.server.run import free_port

WORDS = [" The", " answer", " is", " 42", ".", " Sure", ",", " here", " it", " comes", " ok", " done"]
CREATED = 1_700_000_000
BASE_MODEL = "double"


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def _ids(text: str) -> list[int]:
    """A byte 'tokenizer': one id per UTF-8 byte (+3 for special ids)."""
    return [b + 3 for b in text.encode()]


def _seed(body: dict[str, Any]) -> int:
    key = json.dumps({k: body.get(k) for k in ("messages", "prompt", "tools")}, sort_keys=True)
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in body["messages"]) + "<assistant>"
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else "".join(map(str, prompt or []))


def _arguments(tool: dict[str, Any], question: str) -> dict[str, Any]:
    props = tool.get("function", {}).get("parameters", {}).get("properties", {})
    fill = {"string": question[-40:] or "x", "integer": 7, "number": 1.5, "boolean": True}
    return {name: fill.get(schema.get("type"), "x") for name, schema in props.items()}


def _error(message: str, status: int, type: str = "InvalidUserInput") -> JSONResponse:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": status}}, status)


@dataclass
class _Piece:
    """One generated token: its text and id (text) or a slice of tool-call arguments."""

    text: str
    token_id: int
    logprob: float


@dataclass
class _Choice:
    index: int
    pieces: list[_Piece]
    finish_reason: str
    tool_call: dict[str, Any] | None = None  # {"id", "name", "arguments"}

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


def _generate(body: dict[str, Any], index: int) -> _Choice:
    seed = _seed(body) + 7919 * index
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    if tools and (not messages or messages[-1].get("role") != "tool"):
        question = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
        question = question if isinstance(question, str) else json.dumps(question)
        args = json.dumps(_arguments(tools[0], question))
        half = len(args) // 2
        pieces = [_Piece(args[:half], 1000 + seed % 97, -0.25), _Piece(args[half:], 1001 + seed % 89, -0.5)]
        call = {"id": f"call_{seed % 10**8}_{index}", "name": tools[0]["function"]["name"]}
        return _Choice(index, pieces, "tool_calls", call)
    if messages and messages[-1].get("role") == "tool":
        words = [" Result", ":", " " + str(messages[-1].get("content"))[:20], "."]
    else:
        words = [WORDS[(seed + i) % len(WORDS)] for i in range(3 + seed % 4)]
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10_000
    pieces = [
        _Piece(
            w, 100 + WORDS.index(w) if w in WORDS else 90 + i, -round(0.05 * (i + 1) + (seed % 13) / 100, 4)
        )
        for i, w in enumerate(words)
    ]
    finish = "stop" if len(pieces) <= limit else "length"
    return _Choice(index, pieces[:limit], finish)


def _chat_logprobs(pieces: list[_Piece]) -> dict[str, Any]:
    return {
        "content": [
            {"token": p.text, "logprob": p.logprob, "bytes": list(p.text.encode()), "top_logprobs": []}
            for p in pieces
        ]
    }


def _completion_logprobs(pieces: list[_Piece], offset: int = 0) -> dict[str, Any]:
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p.text)
    return {
        "tokens": [p.text for p in pieces],
        "token_logprobs": [p.logprob for p in pieces],
        "top_logprobs": [{p.text: p.logprob} for p in pieces],
        "text_offset": offsets,
    }


class UpstreamDouble:
    """The double on a free port, in a daemon thread. ``base_url`` ends in ``/v1``."""

    def __init__(self) -> None:
        self.calls: list[Seen] = []
        self.fail_next: list[int] = []
        self.strict: bool | set[str] = False
        self.serves_responses = False
        self.adapters: dict[str, str] = {}  # LoRA name -> path, loaded through /v1/load_lora_adapter
        self.model_version: str | None = "7"
        self.delay = 0.0
        self.delay_next: list[float] = []
        self.port = free_port()
        self.app = self._build()
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.run, name="upstream-double", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> UpstreamDouble:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("upstream double did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> UpstreamDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the app

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            base = {"id": BASE_MODEL, "object": "model", "created": CREATED, "owned_by": "tests"}
            loras = [  # vLLM's card for an adapter: root is its path, parent the base model
                {
                    "id": n,
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "vllm",
                    "root": p,
                    "parent": BASE_MODEL,
                }
                for n, p in self.adapters.items()
            ]
            return {"object": "list", "data": [base, *loras]}

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Any:
            return await self._lora(request, load=True)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Any:
            return await self._lora(request, load=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._answer(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self._answer(request, chat=False)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            return await self._responses(request)

        return app

    async def _answer(self, request: Request, chat: bool) -> Any:
        body = await request.json()
        self.calls.append(Seen(request.url.path, dict(request.headers), body))
        wait = self.delay + (self.delay_next.pop(0) if self.delay_next else 0.0)
        if wait:
            await asyncio.sleep(wait)
        if self.fail_next:
            status = self.fail_next.pop(0)
            error = {"message": f"injected {status}", "type": "server_error", "param": None, "code": status}
            return JSONResponse({"error": error}, status)
        rejected = self._rejected(body)
        if rejected is not None:
            message = f"Unrecognized request argument supplied: {rejected}"
            error = {"message": message, "type": "invalid_request_error", "param": rejected, "code": 400}
            return JSONResponse({"error": error}, 400)
        if body.get("model") == "error-500":
            auth = request.headers.get("authorization", "")
            return _error(f"backend failed for {auth}", 500, "server_error")
        choices = [_generate(body, i) for i in range(int(body.get("n") or 1))]
        headers = {"x-model-version": self.model_version} if self.model_version else {}
        prompt_ids = _ids(_prompt_text(body))
        if body.get("stream"):
            chunks = self._chat_chunks if chat else self._completion_chunks
            gen = chunks(body, prompt_ids, choices)
            return StreamingResponse(
                self._sse(gen, body.get("model") == "broken-stream"),
                media_type="text/event-stream",
                headers=headers,
            )
        full = (
            self._chat_body(body, prompt_ids, choices)
            if chat
            else self._completion_body(body, prompt_ids, choices)
        )
        return JSONResponse(full, headers=headers)

    async def _responses(self, request: Request) -> Any:
        if not self.serves_responses:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        self.calls.append(Seen(request.url.path, dict(request.headers), body))
        rejected = self._rejected(body)
        if rejected is not None:
            message = f"Unrecognized request argument supplied: {rejected}"
            error = {"message": message, "type": "invalid_request_error", "param": rejected, "code": 400}
            return JSONResponse({"error": error}, 400)
        return upstream_double_responses.respond(body)

    async def _lora(self, request: Request, load: bool) -> Any:
        """vLLM's load/unload of a LoRA adapter (``vllm/entrypoints/openai/models/serving.py``)."""
        body = await request.json()
        self.calls.append(Seen(request.url.path, dict(request.headers), body))
        name, path = body.get("lora_name"), body.get("lora_path")
        if not load:
            if not name:
                return _error("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
            if name not in self.adapters:
                return _error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
            del self.adapters[name]
            return Response(f"Success: LoRA adapter '{name}' removed successfully.")
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name == BASE_MODEL:
            return _error(f"The lora adapter '{name}' conflicts with a served base model.", 400)
        if name in self.adapters and not body.get("load_inplace"):
            message = (
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
            return _error(message, 400)
        if not (Path(path) / "adapter_config.json").is_file():
            return _error(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
        self.adapters[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    def _rejected(self, body: dict[str, Any]) -> str | None:
        """The first parameter of the request that ``strict`` makes this double reject."""
        names = {"return_token_ids"} if self.strict is True else set(self.strict or ())
        return next((n for n in sorted(names) if n in body), None)

    @staticmethod
    async def _sse(chunks: list[dict[str, Any]], broken: bool) -> Any:
        for i, chunk in enumerate(chunks):
            if broken and i == 2:
                raise RuntimeError("stream cut off (test double)")
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _usage(prompt_ids: list[int], choices: list[_Choice]) -> dict[str, int]:
        completion = sum(len(c.pieces) for c in choices)
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }

    @staticmethod
    def _head(body: dict[str, Any], kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{_seed(body):08x}", "created": CREATED, "model": body.get("model")}

    def _chat_body(
        self, body: dict[str, Any], prompt_ids: list[int], choices: list[_Choice]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {**self._head(body, "chatcmpl"), "object": "chat.completion", "choices": []}
        for c in choices:
            message: dict[str, Any] = {"role": "assistant", "content": None if c.tool_call else c.text}
            if c.tool_call:
                message["tool_calls"] = [
                    {
                        "id": c.tool_call["id"],
                        "type": "function",
                        "function": {"name": c.tool_call["name"], "arguments": c.text},
                    }
                ]
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c.pieces) if body.get("logprobs") else None,
            }
            if body.get("return_token_ids"):
                choice["token_ids"] = [p.token_id for p in c.pieces]
            out["choices"].append(choice)
        out["usage"] = self._usage(prompt_ids, choices)
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt_ids
        return out

    def _chat_chunks(
        self, body: dict[str, Any], prompt_ids: list[int], choices: list[_Choice]
    ) -> list[dict[str, Any]]:
        head = {**self._head(body, "chatcmpl"), "object": "chat.completion.chunk"}
        ids, lps = body.get("return_token_ids"), body.get("logprobs")
        first = {
            **head,
            "choices": [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in choices
            ],
        }
        if ids:
            first["prompt_token_ids"] = prompt_ids
            for ch in first["choices"]:
                ch["token_ids"] = []
        chunks = [first]
        for step in range(max(len(c.pieces) for c in choices)):
            for c in choices:  # n > 1: choices interleave, as vLLM does
                if step >= len(c.pieces):
                    continue
                p = c.pieces[step]
                if c.tool_call:
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": p.text}}
                    if step == 0:
                        call.update(id=c.tool_call["id"], type="function")
                        call["function"]["name"] = c.tool_call["name"]
                    delta: dict[str, Any] = {"tool_calls": [call]}
                else:
                    delta = {"content": p.text}
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "finish_reason": None,
                    "logprobs": _chat_logprobs([p]) if lps else None,
                }
                if ids:
                    choice["token_ids"] = [p.token_id]
                chunks.append({**head, "choices": [choice]})
        for c in choices:
            last = {"index": c.index, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}
            chunks.append({**head, "choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": self._usage(prompt_ids, choices)})
        return chunks

    def _completion_body(
        self, body: dict[str, Any], prompt_ids: list[int], choices: list[_Choice]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {**self._head(body, "cmpl"), "object": "text_completion", "choices": []}
        for c in choices:
            choice: dict[str, Any] = {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(c.pieces) if body.get("logprobs") is not None else None,
            }
            if body.get("return_token_ids"):  # vLLM: per choice for completions
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = [p.token_id for p in c.pieces]
            out["choices"].append(choice)
        out["usage"] = self._usage(prompt_ids, choices)
        return out

    def _completion_chunks(
        self, body: dict[str, Any], prompt_ids: list[int], choices: list[_Choice]
    ) -> list[dict[str, Any]]:
        head = {**self._head(body, "cmpl"), "object": "text_completion"}
        ids, lps = body.get("return_token_ids"), body.get("logprobs") is not None
        chunks = []
        for c in choices:
            offset = 0
            for step, p in enumerate(c.pieces):
                last = step == len(c.pieces) - 1
                choice: dict[str, Any] = {
                    "index": c.index,
                    "text": p.text,
                    "finish_reason": c.finish_reason if last else None,
                    "logprobs": _completion_logprobs([p], offset) if lps else None,
                }
                offset += len(p.text)
                if ids:
                    choice["token_ids"] = [p.token_id]
                    if step == 0:
                        choice["prompt_token_ids"] = prompt_ids
                chunks.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": self._usage(prompt_ids, choices)})
        return chunks
