"""``ModelEngine.drive_while``: a caller that would only wait lends its thread to the engine's
steps (synchronous GRPO does, waiting for rollouts), and the engine's own thread takes over after."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from engine_helpers import chat_body

from agentbolt.engine import ModelEngine


def _record_decode_threads(engine: ModelEngine) -> list[str]:
    batcher = engine._batcher
    seen: list[str] = []
    decode = batcher._decode

    def recording() -> None:
        seen.append(threading.current_thread().name)
        decode()

    batcher._decode = recording  # type: ignore[method-assign]
    return seen


def _chat(engine: ModelEngine, text: str) -> dict:
    return asyncio.run(engine.chat(chat_body(text, max_tokens=12, temperature=0, ignore_eos=True)))


def test_the_steps_run_on_the_lending_thread_and_go_back_after(fresh_engine: ModelEngine) -> None:
    engine = fresh_engine
    reference = _chat(engine, "lend me your thread")  # served by the engine's own thread
    seen = _record_decode_threads(engine)
    me = threading.current_thread().name
    during: dict[str, object] = {}

    def wait_for_rollouts() -> str:
        during["loop_thread"] = engine.stats()["loop_thread"]
        during["caller"] = threading.current_thread().name
        return _chat(engine, "lend me your thread")["choices"][0]["message"]["content"]

    text = engine.drive_while(wait_for_rollouts)
    assert text == reference["choices"][0]["message"]["content"]  # same greedy answer
    assert during["loop_thread"] == me  # the steps ran here while the call waited
    assert during["caller"] != me  # the waiting call ran in a helper thread
    assert seen and set(seen) == {me}
    seen.clear()
    assert engine.stats()["loop_thread"] == "agentbolt-engine"  # back to its own thread
    _chat(engine, "and now without")
    assert seen and set(seen) == {"agentbolt-engine"}


def test_the_callers_error_is_raised_and_the_engine_keeps_serving(fresh_engine: ModelEngine) -> None:
    engine = fresh_engine
    threads = torch.get_num_threads()

    def fails() -> None:
        _chat(engine, "one answer first")
        raise ValueError("the store went away")

    with pytest.raises(ValueError, match="the store went away"):
        engine.drive_while(fails)
    assert torch.get_num_threads() == threads  # the lending thread keeps its own thread count
    assert _chat(engine, "still there?")["choices"][0]["finish_reason"] == "length"


def test_closing_the_engine_while_driven_fails_its_requests_and_returns(fresh_engine: ModelEngine) -> None:
    engine = fresh_engine

    async def wait_then_close() -> str:
        body = chat_body("a long one", max_tokens=400, temperature=0, ignore_eos=True)
        answer = asyncio.create_task(engine.chat(body))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        threading.Thread(target=engine.close).start()  # from yet another thread, mid-generation
        with pytest.raises(RuntimeError, match="engine stopped"):
            await answer
        return "failed cleanly"

    assert engine.drive_while(lambda: asyncio.run(wait_then_close())) == "failed cleanly"
    assert engine.stats()["loop_thread"] is None
