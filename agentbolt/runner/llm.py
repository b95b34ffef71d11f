"""OpenAI clients for an ``LLM`` resource, cheap to make once per rollout.

Inside a rollout the ``LLM`` resource points at the gateway of that attempt, so agents build a
client per rollout. A fresh ``openai.AsyncOpenAI`` builds its own HTTP client and TLS context
(~0.1 s of CPU here); these helpers share one HTTP connection pool per event loop (per thread
for the sync client) instead, which makes a new client cost about a millisecond.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from agentbolt.schemas import LLM

__all__ = ["async_openai", "sync_openai"]

_async_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
_local = threading.local()


def async_openai(llm: LLM, timeout: float = 300.0, max_retries: int = 0, **kwargs: Any) -> Any:
    """An ``openai.AsyncOpenAI`` for ``llm`` sharing this event loop's connection pool."""
    import openai

    loop = asyncio.get_running_loop()
    pool = _async_pools.get(loop)
    if pool is None:
        pool = _async_pools[loop] = openai.DefaultAsyncHttpxClient()
    return openai.AsyncOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key or "none",
        timeout=timeout,
        max_retries=max_retries,
        http_client=pool,
        **kwargs,
    )


def sync_openai(llm: LLM, timeout: float = 300.0, max_retries: int = 0, **kwargs: Any) -> Any:
    """An ``openai.OpenAI`` for ``llm`` sharing this thread's connection pool."""
    import openai

    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = openai.DefaultHttpxClient()
    return openai.OpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key or "none",
        timeout=timeout,
        max_retries=max_retries,
        http_client=pool,
        **kwargs,
    )
