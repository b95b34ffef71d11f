"""The one path of a trained policy, shared by SFT and GRPO: where it is served, how new weights
reach it, and how each new policy becomes a resources version the runners sample from.

* :class:`EnginePolicy` — the embedded engine in this process: new weights (LoRA merged) are
  swapped in place between requests; the model name stays the same.
* :class:`RemotePolicy` — any vLLM-compatible server (vLLM started with ``--enable-lora``, or
  ``agentbolt model serve`` elsewhere): each update is written as a PEFT adapter to a folder the
  server can read and loaded with ``POST /v1/load_lora_adapter``; the adapter's name becomes
  the model the agent asks for.
* :func:`publish` — a new resources version whose LLM resource points at the policy server.

Several servers (replicas of one model, behind the gateway): a policy holds every server's base
URL (``servers``) and the ones that hold its current weights (``serving``). A sync sends the new
weights to every server; one that is dead or fails leaves ``serving`` (a warning says why) and
is tried again at the next sync, and :func:`publish` names only ``serving`` in the LLM resource
(``base_url`` and ``upstreams``), so the new version is served by those that hold it. A sync
that reaches no server at all raises :class:`~agentbolt.errors.ConfigError`.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from torch import nn

from agentbolt.algorithms.train_state import export_weights, merged_state_dict, trained_weights
from agentbolt.client import Client
from agentbolt.errors import ConfigError
from agentbolt.schemas import LLM, ModelWeights, Resource

if TYPE_CHECKING:
    from agentbolt.engine import ModelEngine

__all__ = ["EnginePolicy", "PolicyServer", "RemotePolicy", "publish", "serve_policy", "server_urls"]

log = logging.getLogger("agentbolt.policy")

PROBE_TIMEOUT = 5.0  # seconds an embedded engine's server has to answer GET /models after a sync


def _is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def server_urls(urls: str | Sequence[str]) -> list[str]:
    """Model servers' base URLs from a list or one comma-separated string (GRPO's and SFT's
    ``serve_url``), without trailing slashes; :class:`ConfigError` for a URL that is not
    http(s) or one named twice."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    found: list[str] = []
    for item in items:
        url = str(item).strip().rstrip("/")
        if not re.fullmatch(r"https?://[\x21-\x7e]+", url):
            raise ConfigError(f"a model server URL must be an http(s) URL, got {str(item).strip()!r}")
        if url in found:
            raise ConfigError(f"model server {url} is named twice")
        found.append(url)
    if not found:
        raise ConfigError("no model server URL given")
    return found


class PolicyServer(abc.ABC):
    servers: list[str]
    """Every model server's base URL."""
    serving: list[str]
    """The servers that hold the current weights: what :func:`publish` names."""
    model_name: str
    base_model_path: str
    """Local Hugging Face directory of the base weights (the trainer loads the same)."""

    @property
    def base_url(self) -> str:
        """The first server holding the current weights (the LLM resource's ``base_url``)."""
        return (self.serving or self.servers)[0]

    @base_url.setter
    def base_url(self, url: str) -> None:  # a subclass with one server may just set it
        self.servers, self.serving = [url], [url]

    @property
    def upstreams(self) -> list[str]:
        """The other servers holding the current weights (the LLM resource's ``upstreams``)."""
        return (self.serving or self.servers)[1:]

    def _sync_each(self, version: int | str, load: Callable[[str], None]) -> None:
        """``load(url)`` on every server (at once when there are several): ``serving`` becomes
        those it succeeded on. None: :class:`ConfigError` naming each failure."""
        if len(self.servers) == 1:
            outcomes: list[Exception | None] = [_outcome(load, self.servers[0])]
        else:
            with ThreadPoolExecutor(len(self.servers), thread_name_prefix="agentbolt-sync") as pool:
                outcomes = list(pool.map(lambda url: _outcome(load, url), self.servers))
        failed = {url: exc for url, exc in zip(self.servers, outcomes, strict=True) if exc is not None}
        if len(failed) == len(self.servers):
            if len(failed) == 1:
                exc = next(iter(failed.values()))
                raise exc if isinstance(exc, ConfigError) else ConfigError(_failure(self.servers[0], exc))
            reasons = "; ".join(_failure(url, exc) for url, exc in failed.items())
            raise ConfigError(f"no model server took the weights of version {version}: {reasons}")
        for url, exc in failed.items():
            log.warning(
                "%s: it leaves the rotation until a later sync reaches it", _failure(url, exc).rstrip(".")
            )
        self.serving = [url for url in self.servers if url not in failed]

    @abc.abstractmethod
    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        """Serve ``model``'s current weights as ``version``; returns the model name to request
        from now on. ``saved``: the folder :func:`export_weights` just wrote them to, if any."""

    @property
    @abc.abstractmethod
    def weights_uri(self) -> str: ...


class EnginePolicy(PolicyServer):
    """Embedded engines in this process: ``engine`` served at ``base_url``, and ``replicas``
    ((engine, base URL) pairs) beside it. Every engine gets the new weights in place; with
    replicas, those whose server then answers ``GET /models`` are the ones published."""

    def __init__(
        self,
        engine: ModelEngine,
        base_url: str,
        base_model_path: str,
        replicas: Sequence[tuple[ModelEngine, str]] = (),
    ) -> None:
        self.engine, self.base_model_path = engine, base_model_path
        self.engines = {base_url: engine, **{url: eng for eng, url in replicas}}
        if len(self.engines) != 1 + len(replicas):
            raise ConfigError("an EnginePolicy's servers must have different base URLs")
        self.servers = list(self.engines)
        self.serving = list(self.servers)
        self.model_name = engine.name

    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        adapter = saved is not None and _is_adapter(saved)
        # the engines merge the small adapter file themselves: no merged copy of the model here;
        # otherwise only what training changed (LoRA: the adapted layers, merged), else everything
        state = None if adapter else _weights_to_send(model)

        def load(url: str) -> None:
            engine = self.engines[url]
            if adapter:
                engine.update_weights(adapter_path=str(saved), version=version)
            else:
                engine.update_weights(state_dict=state, version=version)
            if len(self.servers) > 1:  # which of them can serve it
                httpx.get(f"{url.rstrip('/')}/models", timeout=PROBE_TIMEOUT).raise_for_status()

        self._sync_each(version, load)
        return self.model_name

    @property
    def weights_uri(self) -> str:
        return f"engine://{self.engine.name}@{self.engine.version}"


class RemotePolicy(PolicyServer):
    """vLLM-compatible servers (``base_url``: one, a list, or a comma-separated string), each
    sent every adapter; the adapter folder must be readable by all of them at the same path."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model_name: str,
        base_model_path: str,
        adapter_dir: Path,
        api_key: str | None = None,
        timeout: float = 300.0,
    ) -> None:
        self.servers = server_urls(base_url)
        self.serving = list(self.servers)
        self.model_name = model_name
        self.base_model_path, self.adapter_dir, self.timeout = base_model_path, adapter_dir, timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._last = ""
        # vLLM refuses (400) to load a name it has loaded already: a resumed run syncs its
        # checkpoint's step again, and two runs may share one server. A tag per policy (per
        # process) keeps every name new without replacing another run's adapter in place.
        self.tag = secrets.token_hex(3)

    def sync(self, model: nn.Module, version: int | str, saved: Path | None = None) -> str:
        path = saved.resolve() if saved is not None else self._write(model, version)
        if not _is_adapter(path):
            raise ConfigError("a remote policy server takes LoRA adapters: train with lora=True")
        name = (
            f"policy-{self.tag}-step-{version}"
            if isinstance(version, int)
            else f"policy-{self.tag}-{version}"
        )

        def load(url: str) -> None:
            response = httpx.post(
                f"{url}/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path)},
                headers=self.headers,
                timeout=self.timeout,
            )
            if response.status_code >= 400:
                raise ConfigError(
                    f"{url} refused the adapter ({response.status_code}): {response.text[:300]}"
                )

        self._sync_each(version, load)
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
    serve_url: str | Sequence[str] | None = None,
    serve_model: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    forward: str | None = None,
) -> Iterator[PolicyServer]:
    """A remote policy when ``serve_url`` is given (one server, or several: a list or a
    comma-separated string), else the embedded engine started here, on ``device`` (None:
    ``cuda`` when available, else ``cpu``), running ``forward`` (``EngineConfig.forward``; None:
    its default)."""
    from agentbolt.engine import EngineServer, ModelEngine, ensure_model

    urls = server_urls(serve_url) if serve_url else None  # bad URLs fail before the model loads
    path = str(ensure_model(model))
    if urls:
        yield RemotePolicy(urls, serve_model or model, path, run_dir / "adapters")
        return
    console.print(f"loading the policy model ({model}) into the embedded engine ...")
    options: dict[str, Any] = {"forward": forward} if forward else {}
    engine = ModelEngine.from_pretrained(path, device=device, dtype=dtype, **options)
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
        base_url=policy.base_url,
        upstreams=policy.upstreams,
        model=policy.model_name,
        sampling_parameters=params,
    )
    resources.update(weights or {})
    if latest is not None and not weights and resources == latest.resources:
        return latest.version
    return client.publish_resources(resources, metadata).version


def _weights_to_send(model: nn.Module) -> dict[str, Any]:
    """What an engine serving the base model needs to serve ``model``: the weights training can
    have changed (:func:`trained_weights`: the LoRA-adapted layers, merged), or all of them."""
    changed = trained_weights(model)
    return changed if changed is not None else merged_state_dict(model)


def _outcome(load: Callable[[str], None], url: str) -> Exception | None:
    try:
        load(url)
    except (httpx.HTTPError, OSError, ConfigError, RuntimeError) as exc:
        return exc
    return None


def _failure(url: str, exc: Exception) -> str:
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"model server {url} did not take the new weights ({type(exc).__name__}: {exc})"
