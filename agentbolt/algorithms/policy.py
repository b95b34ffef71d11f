"""The one path of a trained policy, shared by SFT and GRPO: where it is served, how new weights
reach it, and how each new policy becomes a resources version the runners sample from.

* :class:`EnginePolicy` — the embedded engine in this process: new weights (LoRA merged) are
  swapped in place between requests; the model name stays the same.
* :class:`RemotePolicy` — any vLLM-compatible server (vLLM started with ``--enable-lora``, or
  ``agentbolt model serve`` elsewhere): each update is written as a PEFT adapter to a folder the
  server can read and loaded with ``POST /v1/load_lora_adapter``; the adapter's name becomes
  the model the agent asks for.
* :func:`publish` — a new resources version whose LLM resource points at the policy server.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from torch import nn

from agentbolt.algorithms.train_state import export_weights, merged_state_dict
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.schemas import LLM, ModelWeights, Resource

if TYPE_CHECKING:
    from agentbolt.engine import ModelEngine

__all__ = ["EnginePolicy", "PolicyServer", "RemotePolicy", "publish", "serve_policy"]


def _is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


class PolicyServer(abc.ABC):
    base_url: str
    model_name: str
    base_model_path: str
    """Local Hugging Face directory of the base weights (the trainer loads the same)."""

    @abc.abstractmethod
    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        """Serve ``model``'s current weights as ``version``; returns the model name to request
        from now on. ``saved``: the folder :func:`export_weights` just wrote them to, if any."""

    @property
    @abc.abstractmethod
    def weights_uri(self) -> str: ...


class EnginePolicy(PolicyServer):
    def __init__(self, engine: ModelEngine, base_url: str, base_model_path: str) -> None:
        self.engine, self.base_url, self.base_model_path = engine, base_url, base_model_path
        self.model_name = engine.name

    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        if saved is not None and _is_adapter(saved):
            # the engine merges the small adapter file itself: no merged copy of the model here
            self.engine.update_weights(adapter_path=str(saved), version=version)
        else:
            self.engine.update_weights(state_dict=merged_state_dict(model), version=version)
        return self.model_name

    @property
    def weights_uri(self) -> str:
        return f"engine://{self.engine.name}@{self.engine.version}"


class RemotePolicy(PolicyServer):
    def __init__(
        self,
        base_url: str,
        model_name: str,
        base_model_path: str,
        adapter_dir: Path,
        api_key: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        self.base_url, self.model_name = base_url.rstrip("/"), model_name
        self.base_model_path, self.adapter_dir, self.timeout = base_model_path, adapter_dir, timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._last = ""

    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        path = saved.resolve() if saved is not None else self._write(model, version)
        if not _is_adapter(path):
            raise ConfigError("a remote policy server takes LoRA adapters: train with lora=True")
        name = f"policy-step-{version}" if isinstance(version, int) else f"policy-{version}"
        response = httpx.post(
            f"{self.base_url}/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            headers=self.headers,
            timeout=self.timeout,
        )
        if response.status_code >= 400:
            raise ConfigError(
                f"{self.base_url} refused the adapter ({response.status_code}): {response.text[:300]}"
            )
        self.model_name, self._last = name, str(path)
        return name

    def _write(self, model: nn.Module, version: int | str) -> Path:
        """The weights under ``adapter_dir``, in a folder the server can read."""
        folder = f"step-{version:05d}" if isinstance(version, int) else version
        path = (self.adapter_dir / folder).resolve()
        export_weights(model, path)
        return path

    @property
    def weights_uri(self) -> str:
        return self._last or self.base_model_path


@contextlib.contextmanager
def serve_policy(
    model: str,
    run_dir: Path,
    console: Console,
    *,
    serve_url: str | None = None,
    serve_model: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> Iterator[PolicyServer]:
    """A remote policy when ``serve_url`` is given, else the embedded engine started here, on
    ``device`` (None: ``cuda`` when available, else ``cpu``)."""
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model

    path = str(ensure_model(model))
    if serve_url:
        yield RemotePolicy(serve_url, serve_model or model, path, run_dir / "adapters")
        return
    console.print(f"loading the policy model ({model}) into the embedded engine ...")
    engine = ModelEngine.from_pretrained(path, device=device, dtype=dtype)
    try:
        with EngineServer(engine) as server:
            yield EnginePolicy(engine, server.base_url, path)
    finally:
        engine.close()  # stops the batcher thread, which outlives the HTTP server otherwise


def publish(
    client: Client,
    policy: PolicyServer,
    metadata: dict[str, Any],
    *,
    llm_resource: str = "llm",
    sampling: Mapping[str, Any] | None = None,
    weights: Mapping[str, ModelWeights] | None = None,
) -> int:
    """A new resources version: the latest resources, ``llm_resource`` pointed at ``policy``
    (its sampling parameters updated with ``sampling``) and ``weights``. Without new weights and
    with nothing changed, the latest version is returned and nothing is published."""
    latest = client.latest_resources()
    resources: dict[str, Resource] = dict(latest.resources) if latest else {}
    old = resources.get(llm_resource)
    params = {**(old.sampling_parameters if isinstance(old, LLM) else {}), **(sampling or {})}
    resources[llm_resource] = LLM(
        base_url=policy.base_url, model=policy.model_name, sampling_parameters=params
    )
    resources.update(weights or {})
    if latest is not None and not weights and resources == latest.resources:
        return latest.version
    return client.publish_resources(resources, metadata).version
