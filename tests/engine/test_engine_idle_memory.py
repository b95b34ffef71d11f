"""The engine hands the heap's free pages back each time its batch empties (``release_idle_memory``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from engine_helpers import chat_body, make_engine

from agentbolt.engine import ModelEngine


async def _settled(engine: ModelEngine, releases: int, timeout: float = 10.0) -> int:
    """The engine's hand-back count once it reaches ``releases`` (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while engine.stats()["idle_releases"] < releases and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return engine.stats()["idle_releases"]


async def _greedy(engine: ModelEngine, n: int = 4) -> list[list[int]]:
    replies = await asyncio.gather(
        *[engine.chat(chat_body(f"Say {i} things.", max_tokens=12, temperature=0)) for i in range(n)]
    )
    return [r["choices"][0]["token_ids"] for r in replies]


async def test_the_heap_is_handed_back_once_each_time_the_batch_empties(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_batch=16)
    try:
        await asyncio.sleep(0.6)  # idle from the start: nothing ran, nothing to hand back
        assert engine.stats()["idle_releases"] == 0
        first = await _greedy(engine)
        assert await _settled(engine, 1) == 1
        await asyncio.sleep(1.2)  # two more idle waits of the loop: still one hand-back
        assert engine.stats()["idle_releases"] == 1
        assert await _greedy(engine) == first  # the next batch is served as before
        assert await _settled(engine, 2) == 2
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        state["lm_head.weight"] += 0.5
        await engine.aupdate_weights(state_dict=state)  # the swap frees the old weights' copies
        assert await _settled(engine, 3) == 3
        stats = engine.stats()
        assert stats["idle_release_s"] > 0
    finally:
        engine.close()


async def test_an_engine_told_to_keep_its_memory_never_trims(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_batch=16, release_idle_memory=False)
    try:
        await _greedy(engine)
        await asyncio.sleep(1.2)
        assert engine.stats()["idle_releases"] == 0
        assert engine.stats()["idle_release_s"] == 0
    finally:
        engine.close()


SERVE_AND_MEASURE = """
import asyncio, json, sys, time
sys.path.insert(0, {helpers!r})
from engine_helpers import chat_body, make_engine
from agentbolt.engine.testing import tiny_model_dir
from agentbolt.memory import pss_bytes, release_free_memory
import os

path = tiny_model_dir({path!r}, hidden_size=256, max_position_embeddings=4096)
engine = make_engine(path, max_batch=32, max_context=4096, release_idle_memory={release})

async def main():
    prompt = " ".join(["word"] * 300)  # about 1,500 tokens
    await asyncio.gather(*[engine.chat(chat_body(prompt + str(i), max_tokens=64, temperature=0)) for i in range(32)])

asyncio.run(main())
time.sleep(1.5)  # the loop's idle step
held = pss_bytes(os.getpid())
release_free_memory()  # what the engine left free in the heap, handed back now
free_mb = (held - pss_bytes(os.getpid())) / 2**20
print(json.dumps({{"free_mb": free_mb, "releases": engine.stats()["idle_releases"]}}))
engine.close()
"""


def test_after_a_large_batch_the_released_engine_leaves_no_free_pages_in_the_heap(tmp_path: Path) -> None:
    """Served in fresh processes: 32 rows of about 1,500 prompt tokens on a 256-wide model free
    their key-value caches and activations into the heap. Once the engine is idle, a trim of
    our own finds nothing left to hand back where the engine released its memory, and finds
    what the batch freed where it was told to keep it."""
    helpers = str(Path(__file__).parent)
    free_mb = {}
    for release in (True, False):
        script = SERVE_AND_MEASURE.format(helpers=helpers, path=str(tmp_path / "m"), release=release)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["releases"] == (1 if release else 0)
        free_mb[release] = result["free_mb"]
    assert free_mb[True] < 5 and free_mb[False] > 50, free_mb  # measured: 0.0 against 119-250 MB
