"""Continuous batching over a Hugging Face causal LM, in one background thread.

The loop runs one step at a time. Before each step it admits waiting sequences (up to
``max_batch`` running, and a token budget for the prefill), prefills them together and merges
their KV cache into the running batch; then it runs one decode step for every running sequence.
A request that arrives while a step runs joins at the next step; each sequence stops on its own
and leaves the batch at once, freeing its row. Nothing is recomputed: the KV cache of a running
sequence is kept across steps and across merges.

Where this departs from vLLM / transformers' own continuous batching (``generate_batch``, paged
attention): the KV cache is one dense ``DynamicCache`` whose rows are left-padded to a common
length, not a paged block table. On CPU the dense layout lets every decode step be one batched
``sdpa`` call; transformers' paged path measured 55 tokens/s against 220 tokens/s for the dense
batch (SmolLM2-135M, 32 sequences, 2 cores), and its sampler offers one global seed, reports
log-probabilities of the *processed* distribution and no top-k alternatives, which training needs
otherwise. The price: admitting sequences copies the cache once (pad + concatenate) and padding
wastes attention work when lengths differ a lot; left columns that no running row uses are cut
after every eviction. Identical prompts admitted together are prefilled once (``n`` > 1 and
GRPO groups) and their cache rows copied.

Shared prompt prefixes are computed once (:mod:`agentbolt.engine.prefix`).

With ``forward="auto"`` or ``"engine"`` the forward passes of a Llama-family model (SmolLM2
included) are the engine's own (:mod:`agentbolt.engine.forward`, where their speed is measured);
other models keep transformers' forward (``ModelEngine.stats()["forward"]`` says which serves).
LoRA adapters served beside each other (:mod:`agentbolt.engine.lora_rows`) need the engine's own.

On CPU the thread count of the forward passes is re-chosen from measured step times
(:mod:`agentbolt.engine.threads`): on a shared machine one thread can beat two by several times.
A bfloat16 model on a CPU without bfloat16 units has its matrix products computed in float32
(:mod:`agentbolt.engine.matmul`, ``float32_matmul``): PyTorch's own bfloat16 kernels are 4-5x
slower there, and they are most of a decode step. On CPUs with bfloat16 units the weights are
packed once for oneDNN instead (``matmul="packed"``), which saves a weight reorder per product.

Weight updates are applied between steps: the loop stops admitting, lets running sequences finish
on the old weights (up to ``drain_timeout_s``), swaps, and resumes. Sequences still running at the
deadline continue on the new weights and report both versions.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.nn.functional as F

from agentbolt.engine import kv_cache
from agentbolt.engine.forward import FORWARDS, LlamaForward, unsupported_reason
from agentbolt.engine.kernels import available as kernels_available
from agentbolt.engine.lora_rows import Adapter, RowAdapters
from agentbolt.engine.matmul import PackedMatmul, make_matmul_mode
from agentbolt.engine.prefix import MIN_SHARED_PREFIX, KeptPrefix
from agentbolt.engine.sampling import sample_step
from agentbolt.engine.sequence import Sequence
from agentbolt.engine.threads import ThreadTuner
from agentbolt.memory import release_free_memory

__all__ = ["Batcher"]

log = logging.getLogger(__name__)


class _PendingUpdate:
    def __init__(self, apply: Callable[[], int | str], deadline: float) -> None:
        self.apply, self.deadline = apply, deadline
        self.future: Future[int | str] = Future()


class Batcher:
    """Owns the model's forward passes: one thread, one batch, one KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        eos_ids: set[int],
        version: int | str = 0,
        max_batch: int = 32,
        max_context: int = 2048,
        prefill_tokens: int = 4096,
        drain_timeout_s: float = 60.0,
        gather_s: float = 0.004,
        tune_threads: bool | None = None,
        float32_matmul: bool = False,
        matmul: str | None = None,
        forward: str = "auto",
        release_idle_memory: bool = True,
        kernels: bool = True,
    ) -> None:
        self.model, self.eos_ids, self.version = model, eos_ids, version
        self.max_batch, self.max_context, self.prefill_tokens = max_batch, max_context, prefill_tokens
        self.drain_timeout_s = drain_timeout_s
        self.gather_s = gather_s
        """An idle batcher that receives a request waits until none has arrived for this long
        (at most ``GATHER_LIMIT`` times it in all) before the first prefill, so a burst of requests is
        prefilled together (see ``_gather``); 0: start at once."""
        self.prefills = 0
        """Prefill forward passes since the loop began (each admits one or more sequences)."""
        self._arrivals = 0  # requests submitted so far
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._waiting: deque[list[Sequence]] = deque()
        self._cond = threading.Condition()
        self._update: _PendingUpdate | None = None
        self._running: list[Sequence] = []
        self._admitting: list[Sequence] = []  # taken from the queue, not yet running
        self._cache: Any = None  # a DynamicCache whose layers hold .keys/.values
        self._kept = KeptPrefix(prefill_tokens)
        self._mask_BL = torch.zeros(0, 0, dtype=torch.long)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.release_idle_memory = release_idle_memory
        self.idle_releases = 0
        """Times the heap's free pages were handed back since the loop began (see ``_idle``)."""
        self.idle_release_s = 0.0
        """Seconds those hand-backs took, all together."""
        self._worked = False  # a step ran since the last hand-back
        if tune_threads is None:
            tune_threads = next(model.parameters()).device.type == "cpu"
        self.tuner = ThreadTuner() if tune_threads else None
        self.matmul_kind = matmul or ("float32" if float32_matmul else None)
        """None (PyTorch's kernels), "float32" or "packed": see :mod:`agentbolt.engine.matmul`."""
        self.matmul_mode = make_matmul_mode(self.matmul_kind, max_batch, model)
        self.kernels = kernels and next(model.parameters()).device.type == "cpu" and kernels_available()
        """The engine's C kernels serve where they apply: the log-softmax and argmax of every step
        (``sample_step(fast=True)``) and, with the engine's own forward, its decode steps."""
        self.own_forward: LlamaForward | None = None
        """The engine's own forward pass (:mod:`agentbolt.engine.forward`), or None: transformers'."""
        self.forward_note = ""
        """Why transformers' forward is used (empty when the engine's own is)."""
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, not {forward!r}")
        reason = "asked for" if forward == "transformers" else unsupported_reason(model)
        if reason is None:
            self.own_forward = LlamaForward(model, max_context + 1, use_kernels=kernels)
            if isinstance(self.matmul_mode, PackedMatmul):
                self.own_forward.packed = self.matmul_mode
        elif forward == "engine":
            raise ValueError(f"forward='engine' is not available for this model: {reason}")
        else:
            self.forward_note = reason
        self.adapters = RowAdapters() if self.own_forward is not None else None
        """LoRA adapters served per row, beside the weights (None: transformers' forward serves)."""
        if self.own_forward is not None:
            self.own_forward.adapters = self.adapters

    @property
    def attention(self) -> str:
        """What runs a decode step's attention: "kernel" (:mod:`agentbolt.engine.kernels`) or "torch"."""
        return "kernel" if self.own_forward is not None and self.own_forward.kernel else "torch"

    @property
    def attention_note(self) -> str:
        """Why a decode step's attention is not the kernel (empty when it is)."""
        if self.own_forward is None:
            return "transformers' forward serves"
        return self.own_forward.kernel_note

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="agentbolt-engine", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the loop in the calling thread until ``stop()`` (from another thread, or a signal
        handler of this one); returns at once if ``stop()`` came first. See
        :meth:`agentbolt.engine.engine.ModelEngine.run_here` for why the main thread."""
        self._thread = threading.current_thread()
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, group: list[Sequence]) -> None:
        """Queue sequences that share one prompt; they are admitted together."""
        with self._cond:
            self._waiting.append(group)
            self._arrivals += 1
            self._cond.notify_all()

    def request_update(
        self, apply: Callable[[], int | str], drain_timeout_s: float | None = None
    ) -> Future[int | str]:
        """Run ``apply`` (which swaps weights and returns the new version) between two steps."""
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with self._cond:
            if self._update is not None:
                raise RuntimeError("a weight update is already in progress")
            self._update = _PendingUpdate(apply, time.monotonic() + timeout)
            self._cond.notify_all()
            return self._update.future

    @property
    def loop_thread(self) -> str | None:
        """The name of the thread running the loop (every forward pass), None when none does."""
        thread = self._thread
        return thread.name if thread is not None and thread.is_alive() and not self._stop.is_set() else None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self._waiting)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # a failed forward must not kill the server
                log.exception("engine step failed; failing the running sequences")
                self._fail_running(exc)
            finally:
                self._admitting = []
        stopped = RuntimeError("engine stopped")
        self._fail_running(stopped)
        with self._cond:
            waiting, self._waiting = [s for g in self._waiting for s in g], deque()
            update, self._update = self._update, None
        for seq in waiting:
            seq.finish(error=stopped)
        if update is not None:
            update.future.set_exception(stopped)

    def _step(self) -> None:
        self._maybe_apply_update()
        admitted = self._take_waiting()
        if not admitted and not self._running:
            self._idle()
            return
        self._worked = True
        self._admitting = [s for g in admitted for s in g]
        with torch.inference_mode():
            if admitted:
                self._prefill(admitted)
            if self._running:
                self._decode()
        self.steps += 1

    def _idle(self) -> None:
        """Nothing runs or was admitted: hand the heap's free pages back once (the first idle
        step after work; :func:`agentbolt.memory.release_free_memory`, where it is measured),
        then wait for a request."""
        if self._worked and self.release_idle_memory:
            started = time.perf_counter()
            if release_free_memory():
                self.idle_release_s += time.perf_counter() - started
                self.idle_releases += 1
        self._worked = False
        with self._cond:
            if not self._waiting and self._update is None and not self._stop.is_set():
                self._cond.wait(timeout=0.5)

    def _gather(self) -> None:
        """With nothing running, wait while requests keep arriving (until none has for
        ``gather_s``, at most ``GATHER_LIMIT`` times ``gather_s`` in all), so that a burst is
        admitted in one prefill. Without it, 32 chats sent at once over HTTP were admitted as 1,
        then 31: two prefills and a one-row decode step (about 60 ms of a 2.5 s batch of
        SmolLM2). Caller holds ``_cond``."""
        if self.gather_s <= 0 or self._running or not self._waiting:
            return
        now = time.monotonic()
        deadline, quiet_until, seen = now + GATHER_LIMIT * self.gather_s, now + self.gather_s, self._arrivals
        while self.num_waiting < self.max_batch and self._update is None and not self._stop.is_set():
            left = min(quiet_until, deadline) - now
            if left <= 0:
                return
            self._cond.wait(left)
            now = time.monotonic()
            if self._arrivals != seen:
                seen, quiet_until = self._arrivals, now + self.gather_s

    def _take_waiting(self) -> list[list[Sequence]]:
        taken: list[list[Sequence]] = []
        with self._cond:
            if self._update is not None:
                return taken  # draining: let running sequences finish on the current weights
            self._gather()
            slots, width = self.max_batch - len(self._running), 0
            while self._waiting:
                group = self._waiting[0]
                width = max(width, len(group[0].prompt_ids))
                if len(group) > slots or (taken and width * (1 + len(taken)) > self.prefill_tokens):
                    break
                taken.append(self._waiting.popleft())
                slots -= len(group)
        _close([s for g in taken for s in g if s.cancelled.is_set()])
        return [[s for s in g if not s.cancelled.is_set()] for g in taken]

    def _forward(
        self,
        ids_BT: torch.Tensor,
        mask_BL: torch.Tensor,
        pos_BT: torch.Tensor,
        cache,
        adapters: list | None = None,
    ) -> torch.Tensor:
        """The last position's logits of each row; ``adapters``: each row's LoRA adapter (None: none)."""
        if self.adapters is not None:
            self.adapters.select(adapters or [None] * ids_BT.shape[0])
        if self.own_forward is not None:
            with self.matmul_mode or contextlib.nullcontext():
                return self.own_forward(ids_BT, mask_BL, pos_BT, cache).cpu()
        device: Any = self.model.device
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kwargs["logits_to_keep"] = 1
        with self.matmul_mode or contextlib.nullcontext():
            out = self.model(
                input_ids=ids_BT.to(device),
                attention_mask=mask_BL.to(device),
                position_ids=pos_BT.to(device),
                **kwargs,
            )
        return out.logits[:, -1, :].cpu()

    def _prefill(self, groups: list[list[Sequence]]) -> None:
        groups = [g for g in groups if g]
        if not groups:
            return
        self.prefills += 1
        if self.tuner:
            self.tuner.prefill_threads()
        for adapter in dict.fromkeys(g[0].adapter for g in groups):  # each adapter's rows apart
            self._prefill_rows([g for g in groups if g[0].adapter == adapter], adapter)

    def _prefill_rows(self, groups: list[list[Sequence]], adapter: Adapter | None) -> None:
        prompts = list(dict.fromkeys(tuple(g[0].prompt_ids) for g in groups))  # identical prompts once
        shared, common = self._kept.shared_length(prompts, adapter)

        def forward(ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
            return self._forward(ids, mask, pos, cache, [adapter] * ids.shape[0])

        if shared >= MIN_SHARED_PREFIX:
            kv = self._kept.keys_values(prompts[0][:shared], forward)
            cache = kv_cache.cache_with_prefix(kv, len(prompts))
        else:
            shared, cache = 0, kv_cache.new_cache()
        suffixes = [p[shared:] for p in prompts]
        width = max(len(s) for s in suffixes)
        ids_PT = torch.tensor([[0] * (width - len(s)) + list(s) for s in suffixes])
        # the shared prefix, then each prompt's own tokens left-padded: padding may sit mid-row
        mask_PL = torch.tensor([[1] * shared + [0] * (width - len(s)) + [1] * len(s) for s in suffixes])
        pos_PT = (mask_PL.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        logits_PV = forward(ids_PT, mask_PL, pos_PT, cache)
        self._kept.remember(
            prompts[0][: common if len(prompts) > 1 else len(prompts[0])], cache, mask_PL, adapter
        )
        seqs = [s for g in groups for s in g]
        rows = torch.tensor([prompts.index(tuple(s.prompt_ids)) for s in seqs])
        for seq in seqs:
            seq.versions.append(seq.adapter.name if seq.adapter else self.version)
        kv_cache.select_rows(cache, rows)
        self._record(seqs, logits_PV[rows])
        self._merge(seqs, cache, mask_PL[rows])

    def _decode(self) -> None:
        seqs = self._running
        last_B1 = torch.tensor([[s.output_ids[-1]] for s in seqs])
        pos_B1 = self._mask_BL.sum(dim=1, keepdim=True)
        self._mask_BL = torch.cat([self._mask_BL, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
        threads = self.tuner.next_threads(len(seqs)) if self.tuner else 0
        started = time.perf_counter()
        logits_BV = self._forward(last_B1, self._mask_BL, pos_B1, self._cache, [s.adapter for s in seqs])
        if self.tuner:
            self.tuner.record(threads, time.perf_counter() - started, len(seqs))
        self._record(seqs, logits_BV)
        self._evict_finished()

    def _record(self, seqs: list[Sequence], logits_BV: torch.Tensor) -> None:
        k = max(s.params.top_logprobs for s in seqs)
        out = sample_step(
            logits_BV, [s.params for s in seqs], [s.generator for s in seqs], k, fast=self.kernels
        )
        for i, seq in enumerate(seqs):
            top = None
            if seq.params.top_logprobs and out.top_ids is not None and out.top_logprobs is not None:
                n = seq.params.top_logprobs
                top = list(zip(out.top_ids[i][:n], out.top_logprobs[i][:n], strict=True))
            seq.append(out.token_ids[i], out.logprobs[i], top, self.eos_ids)
            if not seq.finished and len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context:
                seq.finish_reason = "length"

    def _merge(self, seqs: list[Sequence], cache: Any, mask_BL: torch.Tensor) -> None:
        """Add freshly prefilled rows to the running batch, left-padding whichever side is shorter."""
        keep = [i for i, s in enumerate(seqs) if not _is_over(s)]
        if len(keep) < len(seqs) and keep:
            kv_cache.select_rows(cache, torch.tensor(keep))
            mask_BL = mask_BL[keep]
        new = [seqs[i] for i in keep]
        if not new:
            pass
        elif self._cache is None:
            self._cache, self._mask_BL, self._running = cache, mask_BL, new
        else:
            width = max(self._mask_BL.shape[1], mask_BL.shape[1])
            kv_cache.merge_rows(self._cache, cache, width)
            self._mask_BL = torch.cat([_pad_left_2d(self._mask_BL, width), _pad_left_2d(mask_BL, width)])
            self._running = self._running + new
        _close([s for s in seqs if _is_over(s)])  # after the batch is consistent: callers may look at it

    def _evict_finished(self) -> None:
        over = [s for s in self._running if _is_over(s)]
        if not over:
            return
        keep = [i for i, s in enumerate(self._running) if not _is_over(s)]
        if not keep:
            self._running, self._cache = [], None
            self._mask_BL = torch.zeros(0, 0, dtype=torch.long)
        else:
            self._running = [self._running[i] for i in keep]
            kv_cache.select_rows(self._cache, torch.tensor(keep))
            self._mask_BL = self._mask_BL[keep]
            self._cut_leading_padding()
        _close(over)

    def _cut_leading_padding(self) -> None:
        cut = int((self._mask_BL.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # all-pad columns on the left
        if cut:
            self._mask_BL = self._mask_BL[:, cut:]
            kv_cache.cut_left(self._cache, cut)

    def _fail_running(self, exc: BaseException) -> None:
        running, self._running, self._cache = self._running, [], None
        self._kept.clear()
        self._mask_BL = torch.zeros(0, 0, dtype=torch.long)
        for seq in dict.fromkeys(running + self._admitting):  # a merge may have run already
            seq.finish(error=exc)

    def _maybe_apply_update(self) -> None:
        update = self._update
        if update is None or (self._running and time.monotonic() < update.deadline):
            return
        self._kept.clear()  # computed with the old weights
        try:
            with torch.no_grad():
                self.version = update.apply()
            invalidate = getattr(self.matmul_mode, "invalidate", None)
            if invalidate is not None:  # packed copies of the old weights
                invalidate()
        except Exception as exc:
            update.future.set_exception(exc)
        else:
            for seq in self._running:  # only when the drain timed out
                seq.versions.append(seq.adapter.name if seq.adapter else self.version)
            update.future.set_result(self.version)
        self._worked = True  # the old weights' packed copies are free now
        with self._cond:
            self._update = None


GATHER_LIMIT = 10
"""An idle batcher's longest wait for a burst of requests, in units of ``Batcher.gather_s``."""


def _is_over(seq: Sequence) -> bool:
    return seq.finished or seq.cancelled.is_set()


def _close(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.finish("abort" if seq.cancelled.is_set() else None)


def _pad_left_2d(t_BL: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t_BL, (width - t_BL.shape[1], 0))
