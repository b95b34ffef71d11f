"""The resources ``agentbolt train`` publishes besides ``--resources``, so that prompt
optimization and evaluation run offline with nothing but a task spec: the spec's own system
prompt as the ``system_prompt`` resource (APO's seed), and the bundled model, served by the
embedded engine for the run, as the ``llm`` resource when none is given. GRPO and SFT serve
their own policy and get neither."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

__all__ = ["run_resources"]

SERVES_ITS_OWN = ("sft", "grpo")
"""Algorithms that serve the policy they train: no ``llm`` resource is added for them."""
BUNDLED = "smollm2"


@contextmanager
def run_resources(algorithm: str, trainer: dict[str, Any], own_agent: Any) -> Iterator[dict[str, Any] | None]:
    """``--resources`` with the additions above; the bundled model is served while the block
    runs. ``own_agent``: the task spec's agent when it plays (None: the user's agent)."""
    from agentbolt.schemas import LLM, PromptTemplate

    given = dict(trainer.get("resources") or {})
    prompt = getattr(own_agent, "system_prompt", None)
    if isinstance(prompt, str) and "system_prompt" not in given:
        given["system_prompt"] = PromptTemplate(template=prompt, engine="plain")
    has_llm = any(_kind(r) == "llm" for r in given.values())
    if algorithm in SERVES_ITS_OWN or has_llm or trainer.get("server_url"):
        yield given or None
        return
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model

    console = trainer.get("console") or Console(stderr=True)
    console.print(f"no LLM resource given: serving the bundled model ({BUNDLED}) in the embedded engine")
    engine = ModelEngine.from_pretrained(str(ensure_model(BUNDLED)))
    try:
        with EngineServer(engine) as server:
            yield {**given, "llm": LLM(base_url=server.base_url, model=BUNDLED)}
    finally:
        engine.close()


def _kind(resource: Any) -> str | None:
    kind = resource.get("type") if isinstance(resource, dict) else getattr(resource, "type", None)
    return str(kind) if kind is not None else None
