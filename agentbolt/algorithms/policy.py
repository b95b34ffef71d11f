"""Where the policy being trained is served, and how new weights reach it.

* :class:`EnginePolicy` — the embedded engine in this process: new weights (LoRA merged) are
  swapped in place between requests; the model name stays the same.
* :class:`RemotePolicy` — any vLLM-compatible server (vLLM started with ``--enable-lora``, or
  ``agentbolt model serve`` elsewhere): each update is written as a PEFT adapter to a folder the
  server can read and loaded with ``POST /v1/load_lora_adapter``; the adapter's name becomes
  the model the agent asks for.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from torch import nn

from agentbolt.algorithms.train_state import export_weights, merged_state_dict
from agentbolt.errors import ConfigError

__all__ = ["EnginePolicy", "PolicyServer", "RemotePolicy", "serve_policy"]


class PolicyServer(abc.ABC):
    base_url: str
    model_name: str
    base_model_path: str
    """Local Hugging Face directory of the base weights (the trainer loads the same)."""

    @abc.abstractmethod
    def sync(self, model: nn.Module, step: int) -> str:
        """Serve ``model``'s current weights; returns the model name to request from now on."""

    @property
    @abc.abstractmethod
    def weights_uri(self) -> str: ...


class EnginePolicy(PolicyServer):
    def __init__(self, engine: Any, base_url: str, base_model_path: str) -> None:
        self.engine, self.base_url, self.base_model_path = engine, base_url, base_model_path
        self.model_name = engine.name

    def sync(self, model: nn.Module, step: int) -> str:
        self.engine.update_weights(state_dict=merged_state_dict(model), version=step)
        return self.model_name

    @property
    def weights_uri(self) -> str:
        return f"engine://{self.engine.name}@{self.engine.version}"


class RemotePolicy(PolicyServer):
    def __init__(self, base_url: str, model_name: str, base_model_path: str, adapter_dir: Path,
                 api_key: str | None = None, timeout: float = 300.0) -> None:  # fmt: skip
        self.base_url, self.model_name, self.base_model_path = (
            base_url.rstrip("/"),
            model_name,
            base_model_path,
        )
        self.adapter_dir, self.timeout = adapter_dir, timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._last = ""

    def sync(self, model: nn.Module, step: int) -> str:
        path = (self.adapter_dir / f"step-{step:05d}").resolve()
        if export_weights(model, path) != "lora":
            raise ConfigError("a remote policy server takes LoRA adapters: train with lora=True")
        name = f"policy-step-{step}"
        response = httpx.post(f"{self.base_url}/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                              headers=self.headers, timeout=self.timeout)  # fmt: skip
        if response.status_code >= 400:
            raise ConfigError(
                f"{self.base_url} refused the adapter ({response.status_code}): {response.text[:300]}"
            )
        self.model_name, self._last = name, str(path)
        return name

    @property
    def weights_uri(self) -> str:
        return self._last or self.base_model_path


@contextlib.contextmanager
def serve_policy(model: str, serve_url: str | None, serve_model: str | None, run_dir: Path, dtype: str | None,
                 console: Any) -> Iterator[PolicyServer]:  # fmt: skip
    """A remote policy when ``serve_url`` is given, else the embedded engine started here."""
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model

    path = str(ensure_model(model))
    if serve_url:
        yield RemotePolicy(serve_url, serve_model or model, path, run_dir / "adapters")
        return
    console.print(f"loading the policy model ({model}) into the embedded engine ...")
    engine = ModelEngine.from_pretrained(path, dtype=dtype)
    try:
        with EngineServer(engine) as server:
            yield EnginePolicy(engine, server.base_url, path)
    finally:
        engine.close()  # stops the batcher thread, which outlives the HTTP server otherwise
