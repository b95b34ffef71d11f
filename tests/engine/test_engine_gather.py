"""An idle engine gathers a burst of requests into one prefill, and never waits long for one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from engine_helpers import chat_body, make_engine


async def test_an_idle_engine_prefills_a_burst_together(tiny_dir: Path) -> None:
    prefills = {}
    for gather_s in (0.3, 0.0):
        with make_engine(tiny_dir, gather_s=gather_s) as engine:
            before = engine.stats()["prefills"]
            first = asyncio.create_task(engine.chat(chat_body("One story.", max_tokens=40, ignore_eos=True)))
            await asyncio.sleep(0.1)  # the second arrives while the first waits (0.3) or runs (0)
            second = asyncio.create_task(
                engine.chat(chat_body("Another tale.", max_tokens=40, ignore_eos=True))
            )
            for reply in await asyncio.gather(first, second):
                assert reply["usage"]["completion_tokens"] == 40
            prefills[gather_s] = engine.stats()["prefills"] - before
    assert prefills == {0.3: 1, 0.0: 2}


async def test_a_steady_stream_does_not_hold_the_first_request_back(tiny_dir: Path) -> None:
    """Requests every 30 ms, each resetting the 50 ms quiet wait: the first prefill still comes
    within ten waits (0.5 s), while the stream goes on."""
    with make_engine(tiny_dir, gather_s=0.05) as engine:
        before = engine.stats()["prefills"]
        started = time.monotonic()
        tasks, first_prefill = [], None
        while time.monotonic() - started < 1.2:
            tasks.append(asyncio.create_task(engine.chat(chat_body("Go on.", max_tokens=4))))
            await asyncio.sleep(0.03)
            if first_prefill is None and engine.stats()["prefills"] > before:
                first_prefill = time.monotonic() - started
        await asyncio.gather(*tasks)
    assert first_prefill is not None and first_prefill < 0.8, first_prefill
