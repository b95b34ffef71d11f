"""The OpenAI-compatible HTTP face of a ``ModelEngine``, and a loopback server for tests and the Trainer.

Routes are thin: each parses JSON, calls the engine, and maps ``EngineRequestError`` to an
OpenAI error body (``{"error": {"message", "type", "param", "code"}}``) with its status.
LoRA adapters are served side by side as vLLM serves them (``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, vLLM's routes and bodies; a request names one as its ``model``).
Weight updates (``/v1/update_weights`` with a checkpoint ``path``, this engine's own) run in a
worker thread so the event loop keeps serving while running requests drain. vLLM 0.34.0 has no ``/v1/update_weights``: its
``POST /update_weights`` (no ``/v1``, only with ``VLLM_SERVER_DEV_MODE=1``) takes
``update_info`` for a weight-transfer engine (NCCL or IPC), not a path
(``tests/contracts/vllm_0_34_0.json``, ``behaviour.update_weights``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentbolt.engine.engine import ModelEngine
from agentbolt.engine.protocol import EngineRequestError
from agentbolt.web import FASTAPI_TELEMETRY_OFF, error_body

__all__ = ["EngineServer", "create_engine_app"]

log = logging.getLogger(__name__)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw or b"null")
    except json.JSONDecodeError as exc:
        raise EngineRequestError(f"the body is not valid JSON: {exc}") from None


def _answer(exc: EngineRequestError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status_code)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape of :class:`EngineRequestError`, whatever raised it."""

    @app.exception_handler(EngineRequestError)
    async def _engine_error(_: Request, exc: EngineRequestError) -> JSONResponse:
        return _answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(EngineRequestError(str(exc.errors()[0].get("msg", exc))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _answer(EngineRequestError(str(exc.detail), status_code=exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("engine request failed")
        message = f"{type(exc).__name__}: {exc}"
        return _answer(EngineRequestError(message, status_code=500, type="server_error"))


def _sse(chunks) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # the status line is gone; report in-band like OpenAI
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(exc), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def create_engine_app(engine: ModelEngine) -> FastAPI:
    """FastAPI app serving ``engine`` under ``/v1`` (plus ``/health``)."""
    app = FastAPI(title="agentbolt model engine", version="1", telemetry=FASTAPI_TELEMETRY_OFF)  # type: ignore[arg-type]
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.name} | engine.stats()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return engine.models()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_body(request)
        if isinstance(body, dict) and body.get("stream"):
            gen = engine.chat_stream(body)
            first = await anext(gen)  # validation errors surface here, before the 200 goes out
            return _sse(_prepend(first, gen))
        return await engine.chat(body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        if isinstance(body, dict) and body.get("stream"):
            gen = engine.complete_stream(body)
            first = await anext(gen)  # validation errors surface here, before the 200 goes out
            return _sse(_prepend(first, gen))
        return await engine.complete(body)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        body = _require(await _json_body(request), "lora_name", "lora_path")
        version = await asyncio.to_thread(engine.load_lora_adapter, body["lora_name"], body["lora_path"])
        return {"status": "ok", "lora_name": body["lora_name"], "model_version": version}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        body = _require(await _json_body(request), "lora_name")
        engine.unload_lora_adapter(body["lora_name"])
        return {"status": "ok", "lora_name": body["lora_name"]}

    @app.post("/v1/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        body = _require(await _json_body(request), "path")
        version = await asyncio.to_thread(engine.update_weights, body["path"], None, body.get("version"))
        return {"status": "ok", "model_version": version}

    return app


async def _prepend(first, rest):
    yield first
    async for item in rest:
        yield item


def _require(body: Any, *names: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise EngineRequestError("request body must be a JSON object")
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            raise EngineRequestError(f"{name} (a string) is required", param=name)
    return body


class EngineServer:
    """Serve an engine with uvicorn in a background thread on loopback; ``base_url`` ends with ``/v1``.

    >>> with EngineServer(engine) as server:
    ...     client = openai.OpenAI(base_url=server.base_url, api_key="none")
    """

    def __init__(
        self, engine: ModelEngine, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ):
        self.engine = engine
        # idle connections closed by the client (the gateway's pool) first: see KEEP_ALIVE_S
        config = uvicorn.Config(
            create_engine_app(engine), host=host, port=port, log_level=log_level, timeout_keep_alive=75
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> EngineServer:
        self.engine.start()
        self._thread = threading.Thread(target=self._server.run, name="agentbolt-engine-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def serve_here(self) -> int:
        """Serve until SIGINT/SIGTERM (or ``stop()``) with the engine's loop in the calling thread
        and HTTP in a background thread: ``agentbolt model serve``. Call it from the main thread,
        where the engine's forward passes run fastest (:meth:`ModelEngine.run_here` says why);
        from the main thread it also takes over SIGINT and SIGTERM: the first lets requests in
        flight finish (HTTP stops taking new ones, then the engine stops), a second stops at once.
        Returns 0, or 1 when the HTTP server never started (the port taken, say: uvicorn logs why).
        """
        started = threading.Event()

        def http() -> None:
            try:
                self._server.run()
            finally:
                if self._server.started:
                    started.set()
                self.engine.close()  # the engine's loop in the caller's thread ends with HTTP

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)
        self._thread = threading.Thread(target=http, name="agentbolt-engine-http", daemon=True)
        self._thread.start()
        try:
            self.engine.run_here()
        finally:
            self._server.should_exit = True
            self._thread.join(30)
        return 0 if started.is_set() else 1

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._server.should_exit:  # the second signal: do not wait for requests in flight
            self._server.force_exit = True
            self.engine.close()
        self._server.should_exit = True

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
