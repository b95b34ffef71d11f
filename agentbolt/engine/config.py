"""How an engine serves: :class:`EngineConfig`, read by the engine and by the preparation of
its requests (:mod:`agentbolt.engine.prepare`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32
    """Most sequences decoded together (the rest wait their turn)."""
    max_context: int | None = None
    """Longest prompt + completion; None: the model's max_position_embeddings, capped at 8192."""
    default_max_tokens: int = 1024
    """Completion length for chat requests that give no max_tokens."""
    prefill_tokens: int = 4096
    """Padded prompt tokens prefilled in one step (bounds the pause new requests cause)."""
    drain_timeout_s: float = 60.0
    """How long a weight update waits for running sequences to finish on the old weights."""
    strict_model_name: bool = False
    """Refuse requests whose `model` is not a served name (404) instead of serving them anyway."""
    cpu_matmul: str = "auto"
    """How a bfloat16 model on the CPU multiplies matrices: "native" (PyTorch's bfloat16 kernels),
    "packed" (the same oneDNN kernels with weights packed once instead of at every product;
    identical products, one more copy of the linear weights in memory; the q/k/v and gate/up
    projections of a layer as one product each, see :mod:`agentbolt.engine.matmul`), "float32" (bfloat16 weights
    converted block by block and multiplied in float32, result rounded to bfloat16; see
    :mod:`agentbolt.engine.matmul`) or "auto": packed when the CPU has bfloat16 instructions
    (AVX512-BF16/AMX), float32 when it lacks them, where PyTorch's bfloat16 kernels are 4-5x
    slower. Other dtypes and devices ignore it."""
    forward: str = "auto"
    """Whose forward pass serves prefills and decode steps: "engine" (the engine's own for Llama
    models, :mod:`agentbolt.engine.forward`: less per-step work outside the matrix products),
    "transformers" (the model's own ``forward``) or "auto" (the default): the engine's where the
    model is supported, transformers' otherwise (``stats()["forward"]`` says which,
    ``"forward_note"`` why). Served by ``agentbolt model serve`` (32 chats x 64 tokens, SmolLM2,
    bfloat16, quiet 2-core AVX512-BF16 machine, two runs of 3 and 4 rounds), the engine's own gave
    342-508 tokens/s against 301-353 for transformers', faster in every round. It used to measure
    slower served (0.84-0.96x) while faster step by step in one process: the server then ran the
    engine's loop in a second thread, where OpenMP's workers are throttled
    (:meth:`ModelEngine.run_here`) and the cheaper forward lost its lead."""
    release_idle_memory: bool = True
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``) each time the batch
    empties: the freed key-value caches and activations otherwise stay mapped, and a long-running
    server's memory follows the largest batches it ever served (figures at ``Batcher._idle``)."""
    gather_s: float = 0.004
    """An idle engine that receives a request waits until none has arrived for this long (at
    most ten times it in all) before prefilling, so a burst of requests is prefilled together
    rather than one request first (``Batcher.gather_s``); 0: start at once."""
    kernels: bool = True
    """Run the work around the matrix products in the engine's C kernels
    (:mod:`agentbolt.engine.kernels`, built on first use with the system's C compiler) for a
    bfloat16 or float32 model on the CPU: each step's logprobs and greedy tokens, and with the
    engine's own forward a decode step's attention, RoPE and cache write, norms and activation.
    PyTorch's ops otherwise, or where the kernels cannot be built (``stats()["attention"]`` says
    which attention serves, ``"attention_note"`` why)."""
