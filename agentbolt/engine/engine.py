"""The in-process model engine: OpenAI-style requests in, vLLM-style responses out.

``ModelEngine`` validates a request, renders the prompt with the chat template, hands the
sequences to the continuous batcher (one background thread that owns every forward pass) and
awaits them from asyncio. Weight updates go through the same thread, between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from agentbolt.engine.batcher import Batcher
from agentbolt.engine.config import EngineConfig
from agentbolt.engine.lora_rows import Adapter, LoraPair
from agentbolt.engine.matmul import cpu_matmul_mode
from agentbolt.engine.model_files import DEFAULT_MODEL, SMOLLM2_DIRNAME, ensure_model
from agentbolt.engine.prepare import RequestPreparer
from agentbolt.engine.protocol import EngineRequestError
from agentbolt.engine.responses import chat_response, completion_response
from agentbolt.engine.sampling import SamplingParams
from agentbolt.engine.sequence import Sequence
from agentbolt.engine.streaming import stream_chat, stream_completion
from agentbolt.engine.weights import WeightManager, load_tensors

__all__ = ["EngineConfig", "ModelEngine"]

log = logging.getLogger(__name__)


class ModelEngine:
    """A causal LM served with continuous batching; see ``chat``, ``complete``, ``update_weights``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        name: str = "model",
        config: EngineConfig | None = None,
        version: int | str = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = config or EngineConfig()
        self.max_context = self.config.max_context or min(
            getattr(model.config, "max_position_embeddings", 2048), 8192
        )
        self.eos_ids = _eos_ids(model, tokenizer)
        self._weights = WeightManager(model)
        self._update_lock = threading.Lock()
        self._served_names = {name}
        self._unloaded: set[str] = set()
        """LoRA adapters unloaded: a request naming one is refused, never served by the base."""
        self._prepare = RequestPreparer(tokenizer, self.max_context, self._served_names)
        self._batcher = Batcher(
            model,
            self.eos_ids,
            version=version,
            max_batch=self.config.max_batch,
            max_context=self.max_context,
            prefill_tokens=self.config.prefill_tokens,
            drain_timeout_s=self.config.drain_timeout_s,
            gather_s=self.config.gather_s,
            matmul=cpu_matmul_mode(self.config.cpu_matmul, model),
            forward=self.config.forward,
            release_idle_memory=self.config.release_idle_memory,
            kernels=self.config.kernels,
        )
        self._started = False
        self._start_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | os.PathLike[str] = DEFAULT_MODEL,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        allow_download: bool = False,
        name: str | None = None,
        **config: Any,
    ) -> ModelEngine:
        """Load ``path_or_name`` (a local HF directory or ``"smollm2"``, converted on first use).

        ``dtype`` defaults to bfloat16 (half the memory of float32; faster on CPUs with bfloat16
        units, and on others the engine multiplies in float32, see ``EngineConfig.cpu_matmul``);
        pass ``"float32"`` when log-probabilities must match a float32 training pass to 1e-4 (in
        bfloat16 they differ by up to about 0.25 nats per token, 0.03 on average, on SmolLM2).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ensure_model(path_or_name, allow_download=allow_download)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tokenizer = AutoTokenizer.from_pretrained(path)
        # typed as the module it is used as: transformers' own ``to`` is typed through a wrapper
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
        model.to(device)
        served = name or (SMOLLM2_DIRNAME if path.name == SMOLLM2_DIRNAME else Path(path).name)
        return cls(model, tokenizer, name=served, config=EngineConfig(**config))

    # ---------------------------------------------------------------- lifecycle
    @property
    def version(self) -> int | str:
        return self._batcher.version

    @property
    def device(self) -> torch.device:
        """Where the served weights are."""
        return next(self.model.parameters()).device

    def start(self) -> ModelEngine:
        with self._start_lock:
            if not self._started:
                log.info("%s", self.serving())
                self._batcher.start()
                self._started = True
        return self

    def serving(self) -> str:
        """One line: what serves the attention and the small ops (the C kernels or PyTorch, and
        why), the forward pass and the products; the engine logs it as it starts."""
        b = self._batcher
        if b.attention == "kernel":
            from agentbolt.engine import kernels

            small = f"the C kernels ({kernels.status()})"
        else:
            small = f"PyTorch ({b.attention_note or 'kernels off'})"
        forward = "the engine's own" if b.own_forward is not None else f"transformers' ({b.forward_note})"
        return (
            f"engine: attention and small ops by {small}; forward pass {forward}; "
            f"products {b.matmul_kind or 'native'}, dtype {str(next(self.model.parameters()).dtype).removeprefix('torch.')}"
        )

    def run_here(self) -> None:
        """Run the engine's loop, and so every forward pass, in the calling thread until
        :meth:`close` (from another thread, or a signal handler of this one); ``agentbolt model
        serve`` runs it in the main thread with HTTP in a background thread. Returns at once if
        ``close()`` came first.

        Why the main thread: PyTorch's CPU build runs its parallel operators on GNU OpenMP
        (libgomp), which gives every thread that starts parallel work its own team of worker
        threads. When it counts more of its threads than CPUs, which a second team makes happen
        on a machine whose CPUs the first team already fills, libgomp lets idle workers spin only
        briefly before sleeping (its throttled spin count), so, as far as we can tell, the ~1,500
        operators of a decode step keep waiting for workers to wake up
        (``OMP_WAIT_POLICY=ACTIVE`` brought a second thread's steps back to the main thread's
        speed when no other team existed, and made them slower still when one did). Stepping the
        same batch (SmolLM2, bfloat16, 32 rows, 2 threads, quiet 2-core machine, alternated in one
        process, 4 rounds), median decode steps took 52.9-68.4 ms in the main thread against
        70.7-144.6 ms in a second one, 1.20-2.12x (``benchmarks/inference_throughput.py
        --thread-ab``)."""
        with self._start_lock:
            if self._started:
                raise RuntimeError("the engine is already running (start() or run_here())")
            self._started = True
        try:
            self._batcher.run_here()
        finally:
            self._started = False

    def close(self) -> None:
        """Stop the engine's loop; sequences still running fail with "engine stopped"."""
        self._batcher.stop()  # also when run_here() has not begun yet: it then returns at once
        self._started = False

    def __enter__(self) -> ModelEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        b = self._batcher
        threads = b.tuner.current if b.tuner else None
        return {
            "running": b.num_running,
            "waiting": b.num_waiting,
            "steps": b.steps,
            "prefills": b.prefills,
            "version": b.version,
        } | {
            "threads": threads,
            "threads_by_batch": b.tuner.chosen() if b.tuner else {},
            "float32_matmul": b.matmul_kind == "float32",
            "cpu_matmul": b.matmul_kind or "native",
            "forward": "engine" if b.own_forward is not None else "transformers",
            "forward_note": b.forward_note,
            "attention": b.attention,
            "attention_note": b.attention_note,
            "loop_thread": b.loop_thread,
            "idle_releases": b.idle_releases,
            "idle_release_s": round(b.idle_release_s, 4),
        }

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` body."""
        data = [
            {
                "id": n,
                "object": "model",
                "owned_by": "agentbolt",
                "created": 0,
                "max_model_len": self.max_context,
            }
            for n in sorted(self._served_names)
        ]
        return {"object": "list", "data": data}

    # ---------------------------------------------------------------- requests
    async def chat(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Answer an OpenAI ``/v1/chat/completions`` body (``stream`` is ignored here)."""
        req, prompt_ids, params = self._prepare.chat(request, self.config)
        seqs = await self._generate(prompt_ids, params, req.n, req.model)
        return chat_response(req, self.name, self.tokenizer, prompt_ids, seqs)

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Answer an OpenAI ``/v1/completions`` body (``stream`` is ignored here)."""
        req, prompts, params = self._prepare.completion(request, self.config)
        runs = [self._generate(ids, p, req.n, req.model) for (_, ids), p in zip(prompts, params, strict=True)]
        seqs = [s for group in await asyncio.gather(*runs) for s in group]
        return completion_response(req, self.name, self.tokenizer, prompts, seqs)

    async def complete_stream(self, request: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The same request as ``complete``, answered as ``text_completion`` chunks."""
        req, prompts, params = self._prepare.completion(request, self.config)
        async for chunk in stream_completion(self, req, prompts, params):
            yield chunk

    async def chat_stream(self, request: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The same request as ``chat``, answered as ``chat.completion.chunk`` dicts."""
        req, prompt_ids, params = self._prepare.chat(request, self.config)
        async for chunk in stream_chat(self, req, prompt_ids, params):
            yield chunk

    def make_sequences(
        self, prompt_ids: list[int], params: SamplingParams, n: int, model: str | None = None
    ) -> list[Sequence]:
        """``n`` sequences of the prompt; ``model`` naming a loaded LoRA adapter runs them on it."""
        tok = self.tokenizer  # decode only (stop strings): safe from the engine thread
        adapters = self._batcher.adapters
        adapter = adapters.loaded.get(model) if adapters is not None and model is not None else None
        if adapter is None and model in self._unloaded:  # never the base in an adapter's place
            raise EngineRequestError(
                f"the LoRA adapter {model!r} was unloaded; this engine serves: {', '.join(sorted(self._served_names))}",
                status_code=404,
                param="model",
                code="model_not_found",
            )

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        seeds = [None if params.seed is None else params.seed + i for i in range(n)]
        return [
            Sequence(list(prompt_ids), replace(params, seed=s), decode=decode, adapter=adapter) for s in seeds
        ]

    def submit(self, seqs: list[Sequence]) -> None:
        self.start()
        self._batcher.submit(seqs)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, model: str | None = None
    ) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        seqs = self.make_sequences(prompt_ids, params, n, model)
        futures = [loop.create_future() for _ in seqs]
        for seq, fut in zip(seqs, futures, strict=True):
            seq.on_done = partial(_call_soon, loop, fut)
        self.submit(seqs)
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for seq in seqs:
                seq.cancelled.set()
            raise
        errors = [s.error for s in done if s.error is not None]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}") from errors[0]
        return list(done)

    # ---------------------------------------------------------------- weights
    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | str | os.PathLike[str] | None = None,
        adapter_path: str | os.PathLike[str] | None = None,
        version: int | str | None = None,
        drain_timeout_s: float | None = None,
    ) -> int | str:
        """Swap in a state dict (mapping or safetensors path) or a LoRA adapter; return the new version.

        Blocks until the swap happened. Requests already running finish on the old weights unless
        that takes longer than ``drain_timeout_s``; new requests wait for the swap.
        """
        if (state_dict is None) == (adapter_path is None):
            raise EngineRequestError("give exactly one of state_dict or adapter_path")
        with self._update_lock:
            if adapter_path is not None:
                weights, apply = self._weights.prepare_adapter(adapter_path), self._weights.apply_adapter
            else:
                assert state_dict is not None
                tensors = (
                    load_tensors(state_dict) if isinstance(state_dict, (str, os.PathLike)) else state_dict
                )
                weights, apply = self._weights.prepare_state_dict(tensors), self._weights.apply_state_dict
            new_version = version if version is not None else _next_version(self.version)

            def swap() -> int | str:
                apply(weights)
                return new_version

            self.start()
            result = self._batcher.request_update(swap, drain_timeout_s).result()
        log.info("engine weights now at version %s", result)
        return result

    async def aupdate_weights(self, *args: Any, **kwargs: Any) -> int | str:
        return await asyncio.to_thread(self.update_weights, *args, **kwargs)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """vLLM's ``/v1/load_lora_adapter``: serve the adapter under ``lora_name`` beside the
        weights and any other adapter (:mod:`agentbolt.engine.lora_rows`). A request whose
        ``model`` is ``lora_name`` runs it; its responses' ``model_version`` is ``lora_name``.
        Loading a name again replaces it for new requests. To change the weights themselves,
        merge an adapter with :meth:`update_weights`."""
        adapters = self._batcher.adapters
        if adapters is None:
            raise EngineRequestError(
                "serving LoRA adapters side by side needs the engine's own forward pass "
                f"({self._batcher.forward_note}); merge an adapter with update_weights instead",
                param="lora_path",
            )
        if lora_name == self.name:
            raise EngineRequestError(f"{lora_name!r} is the base model's name: name the adapter otherwise")
        pairs = self._weights.prepare_row_adapter(lora_path)
        layers = {
            self.model.get_submodule(n.rsplit(".", 1)[0]): LoraPair(a, b) for n, (a, b) in pairs.items()
        }
        adapters.loaded = {**adapters.loaded, lora_name: Adapter(lora_name, layers)}
        self._served_names.add(lora_name)
        self._unloaded.discard(lora_name)
        log.info("serving LoRA adapter %s from %s", lora_name, lora_path)
        return lora_name

    def unload_lora_adapter(self, lora_name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``: new requests may no longer name it; sequences
        running on it finish on it. 404 for a name not loaded."""
        adapters = self._batcher.adapters
        if adapters is None or lora_name not in adapters.loaded:
            loaded = (
                ", ".join(sorted(adapters.loaded)) if adapters is not None and adapters.loaded else "none"
            )
            raise EngineRequestError(
                f"no LoRA adapter named {lora_name!r} is loaded (loaded: {loaded})",
                status_code=404,
                param="lora_name",
                code="not_found",
            )
        adapters.loaded = {n: a for n, a in adapters.loaded.items() if n != lora_name}
        self._served_names.discard(lora_name)
        self._unloaded.add(lora_name)


def _call_soon(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, seq: Sequence) -> None:
    loop.call_soon_threadsafe(_resolve, fut, seq)


def _resolve(fut: asyncio.Future, seq: Sequence) -> None:
    if not fut.done():
        fut.set_result(seq)


def _next_version(current: int | str) -> int:
    if isinstance(current, int):
        return current + 1
    digits = "".join(ch for ch in str(current) if ch.isdigit())
    return int(digits) + 1 if digits else 1


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else list(value or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    aliases = {
        "bf16": "bfloat16",
        "fp32": "float32",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
    }
    value = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float32 or float16")
    return value
