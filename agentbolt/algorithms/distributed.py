"""Data-parallel GRPO and SFT updates over several ranks launched by ``torchrun``.

Rank 0 runs everything that talks to the store: the Trainer, its server and runners, the
rollouts, the policy server and weight publishing. The other ranks only join each update
(:func:`follow`, entered from ``Trainer.fit``). Per update rank 0 announces a command through the
process group's key-value store and broadcasts its payload (``broadcast_object_list``):

- ``Setup``: build the model the same way (a Hugging Face folder, or a pickled module) and make
  it trainable with rank 0's :class:`~agentbolt.algorithms.train_state.TrainConfig`;
- ``Load``: rank 0's trainable parameters and optimizer state (a fresh LoRA adapter is random,
  a resumed one comes from the checkpoint), so every replica starts identical;
- ``Step``: the micro-batches of one update and the loss; every rank trains on its share;
- ``Stop``: the run ended (or failed on rank 0: its error is the message).

One update (:func:`update`): the micro-batches are spread over the ranks by padded token count
(greedy: the largest first, each to the least loaded rank), every rank accumulates the gradient
of its micro-batches with the loss divided by the token count of the WHOLE batch (so the sum
over ranks is the one-rank loss), the gradients are summed after accumulation (all-reduce over
flat 64 MB buckets; a rank without micro-batches adds zeros: ranks with different
numbers of micro-batches cannot deadlock), clipped, and every rank steps its optimizer. The
replicas stay identical, so rank 0's model is the full model: checkpoints, weight export and
``PolicyServer.sync`` need no gathering, and a checkpoint resumes on any number of ranks.

This is DDP's scheme (replicated weights, summed gradients) with the all-reduce done by hand:
``DistributedDataParallel``'s hooks reduce inside the backward pass and need the same number of
backward passes on every rank. FSDP2 (``fully_shard``) was measured against it on CPU/gloo and
is slower there (docs/training.md, "Distributed training (torchrun)").

Waiting: between updates rank 0 runs rollouts for minutes, so the other ranks do not wait inside
a collective (its timeout would end them); they poll the store for the next command and watch
rank 0's heartbeat (a counter it bumps every few seconds from a thread), and end with a message
when it stops (``AGENTBOLT_DIST_LIVENESS`` seconds, default 120). Collectives time out after
``AGENTBOLT_DIST_TIMEOUT`` seconds (default 1800): a rank that died mid-update ends the others
with a message, not a hang.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentbolt.algorithms.losses import Batch, LossFn, reference_logprobs
from agentbolt.algorithms.train_state import TrainConfig, TrainState, make_train_state
from agentbolt.errors import ConfigError

__all__ = [
    "DistributedError",
    "balance",
    "check_launch",
    "follow",
    "leading",
    "launched",
    "rank",
    "share_state",
    "setup_followers",
    "stop_followers",
    "update",
    "world_size",
]

_TIMEOUT_ENV = "AGENTBOLT_DIST_TIMEOUT"
_LIVENESS_ENV = "AGENTBOLT_DIST_LIVENESS"
_BACKEND_ENV = "AGENTBOLT_DIST_BACKEND"
_HEARTBEAT_SECONDS = 2.0
DISTRIBUTED_ALGORITHMS = ("GRPO", "SFT")


class DistributedError(RuntimeError):
    """A rank stopped answering or the process group failed; the message says which."""


# ---------------------------------------------------------------------------- the launch


def world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def launched() -> bool:
    """Whether this process is one of several ranks (torchrun with more than one process)."""
    return world_size() > 1


def check_launch(algorithm: Any) -> None:
    """A clear error, on every rank, for an algorithm that cannot train over several ranks."""
    from agentbolt.algorithms.grpo import GRPO
    from agentbolt.algorithms.sft import SFT

    name = type(algorithm).__name__
    if not isinstance(algorithm, GRPO | SFT):
        raise ConfigError(
            f"{name} does not train over several ranks (WORLD_SIZE={world_size()}): only "
            f"{' and '.join(DISTRIBUTED_ALGORITHMS)} do; run it as one process, without torchrun"
        )


def _backend(device: torch.device) -> str:
    chosen = os.environ.get(_BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")
    if chosen not in ("gloo", "nccl"):
        raise ConfigError(f"{_BACKEND_ENV}={chosen!r}: choose gloo (CPU) or nccl (CUDA GPUs)")
    if chosen == "nccl" and device.type != "cuda":
        raise ConfigError(f"{_BACKEND_ENV}=nccl needs CUDA GPUs; training runs on {device}: use gloo")
    if chosen == "nccl" and not dist.is_nccl_available():
        raise ConfigError("this PyTorch build has no NCCL: use gloo (AGENTBOLT_DIST_BACKEND=gloo)")
    return chosen


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected seconds") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: expected seconds > 0")
    return value


def _local_device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get(_BACKEND_ENV, "") != "gloo":
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


@dataclass
class _Group:
    """This process's membership: the c10d store (commands, heartbeat) and the command count."""

    store: Any
    rank: int
    size: int
    device: torch.device
    sent: int = 0
    heartbeat: threading.Thread | None = None
    stopping: threading.Event | None = None
    warned_idle: bool = False


_group: _Group | None = None
_joins = 0
"""Groups this process joined: the store's keys of each are apart (every rank counts alike)."""


def _join(device: torch.device) -> _Group:
    """Join the process group torchrun describes (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``), with the backend ``device`` calls for and a timeout on every collective."""
    global _group
    if _group is not None:
        return _group
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if not os.environ.get(name):
            raise ConfigError(f"{name} is not set: launch the ranks with torchrun (docs/training.md)")
    backend = _backend(device)
    timeout = timedelta(seconds=_seconds(_TIMEOUT_ENV, 1800.0))
    try:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL's collectives run on the current device
        dist.init_process_group(backend, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a clear one-line message, whatever c10d raised
        raise DistributedError(f"rank {rank()} could not join the process group ({backend}): {exc}") from exc
    global _joins
    _joins += 1
    store = dist.PrefixStore(f"agentbolt/{_joins}/", dist.distributed_c10d._get_default_store())
    _group = _Group(store=store, rank=dist.get_rank(), size=dist.get_world_size(), device=device)
    return _group


def _leave() -> None:
    """Close the group this module joined (never one the caller made itself)."""
    global _group
    group, _group = _group, None
    if group is None:
        return
    if group.stopping is not None:
        group.stopping.set()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def leading() -> bool:
    """Whether this is rank 0 of a running group (its updates must be spread over the ranks)."""
    return _group is not None and _group.rank == 0 and _group.size > 1


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class _Setup:
    model: str | nn.Module
    config: TrainConfig
    reference: bool


@dataclass(frozen=True)
class _Load:
    step: int
    optimizer: dict[str, Any]


@dataclass(frozen=True)
class _Step:
    batches: list[Batch]
    loss_fn: LossFn
    bf16: bool
    reference: bool


@dataclass(frozen=True)
class _Stop:
    error: str | None = None


def _send(group: _Group, command: Any) -> None:
    group.sent += 1
    group.store.set(f"cmd/{group.sent}", type(command).__name__)
    dist.broadcast_object_list([command], src=0)


def _receive(group: _Group, liveness: float) -> Any:
    """The next command; a :class:`DistributedError` when rank 0's heartbeat stops first."""
    key = f"cmd/{group.sent + 1}"
    beat, beat_seen, pause = b"", time.monotonic(), 0.01
    while True:
        try:  # check, not wait: a timed-out wait logs a warning from c10d every time
            if group.store.check([key]):
                break
            current = group.store.get("heartbeat") if group.store.check(["heartbeat"]) else b""
        except Exception as exc:  # noqa: BLE001 - the store is gone with rank 0's host
            raise DistributedError(f"rank {group.rank}: lost rank 0's store ({exc}); ending") from exc
        now = time.monotonic()
        if current != beat:
            beat, beat_seen = current, now
        if now - beat_seen > liveness:
            raise DistributedError(
                f"rank {group.rank}: rank 0 sent nothing for {liveness:g} s ({_LIVENESS_ENV}); ending"
            )
        time.sleep(pause)
        pause = min(0.25, pause * 2)
    group.sent += 1
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _start_heartbeat(group: _Group) -> None:
    stopping = threading.Event()

    def beat() -> None:
        count = 0
        while not stopping.wait(_HEARTBEAT_SECONDS):
            count += 1
            try:
                group.store.set("heartbeat", str(count))
            except Exception:  # noqa: BLE001 - the group is being torn down
                return

    group.stopping = stopping
    group.store.set("heartbeat", "0")
    group.heartbeat = threading.Thread(target=beat, name="agentbolt-heartbeat", daemon=True)
    group.heartbeat.start()


# ---------------------------------------------------------------------------- rank 0's side


def setup_followers(state: TrainState, model: str | nn.Module) -> None:
    """On rank 0 inside :func:`leader` (a no-op on one rank): have every other rank build
    ``model`` (a Hugging Face folder each rank can read at that path, or a module, pickled to
    them) made trainable like ``state``, and give them ``state``'s weights."""
    if not leading():
        return
    assert _group is not None
    _send(_group, _Setup(model, state.config, reference=state.reference is not None))
    share_state(state)


def share_state(state: TrainState) -> None:
    """On rank 0: every rank takes ``state``'s trainable parameters, optimizer state and step
    (after a fresh start or a resume; a no-op on one rank)."""
    if not leading():
        return
    group = _group
    assert group is not None
    optimizer = state.optimizer.state_dict()
    _send(group, _Load(state.step, _cpu(optimizer)))
    _broadcast_trainable(state.model)


def stop_followers(error: BaseException | None = None) -> None:
    """On rank 0: the other ranks leave their loop (with rank 0's error, if any) and the group
    is closed. Safe to call when not distributed."""
    if leading():
        assert _group is not None
        text = f"{type(error).__name__}: {error}" if error is not None else None
        with contextlib.suppress(Exception):
            _send(_group, _Stop(text))
    _leave()


@contextlib.contextmanager
def leader(device: torch.device) -> Iterator[None]:
    """Rank 0's part of a run (nothing on one rank): join the group with the backend
    ``device`` calls for and start the heartbeat; the other ranks are stopped when the run ends,
    however it ends."""
    if launched():
        group = _join(device)
        if group.heartbeat is None:
            _start_heartbeat(group)
    try:
        yield
    except BaseException as exc:
        stop_followers(exc)
        raise
    stop_followers()


def update(
    state: TrainState,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    bf16: bool = False,
    reference: bool = False,
) -> dict[str, float]:
    """One optimizer step over ``batches`` (all of the update's micro-batches, on the CPU),
    spread over the ranks when launched with several, else on this process alone. ``loss_fn``
    must pickle (a :class:`~agentbolt.algorithms.losses.PolicyLoss`, ``sft_loss``).
    ``reference``: each rank adds the reference log-probs of its micro-batches (the KL term).

    Metrics as :func:`~agentbolt.algorithms.train_state.optimizer_step`'s (token-weighted
    means over every micro-batch of every rank), with ``*_min`` / ``*_max`` metrics reduced by
    min / max, plus ``ranks_idle``: ranks that got no micro-batch."""
    batches = list(batches)
    if leading():
        assert _group is not None
        _send(_group, _Step(batches, loss_fn, bf16, reference))
        return _step(_group, state, batches, loss_fn, bf16, reference)
    return _step(None, state, batches, loss_fn, bf16, reference)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(v) for v in value)
    return value


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _broadcast_trainable(model: nn.Module) -> None:
    with torch.no_grad():
        for p in _trainable(model):
            dist.broadcast(p.data, src=0)


# ---------------------------------------------------------------------------- one update


def balance(costs: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``costs`` for each of ``ranks``: the largest first, each to the least loaded
    rank (ties: the lowest rank), in their original order within a rank."""
    loads = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += costs[i]
    return [sorted(ix) for ix in owned]


def _to_device(batch: Batch, device: torch.device) -> Batch:
    tensors = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def _step(
    group: _Group | None,
    state: TrainState,
    batches: list[Batch],
    loss_fn: LossFn,
    bf16: bool,
    reference: bool,
) -> dict[str, float]:
    """Every rank's part of one update (``group`` None: this process alone)."""
    num_tokens = sum(b.num_tokens for b in batches)
    if num_tokens == 0:
        return {"num_tokens": 0.0}
    ranks, me = (group.size, group.rank) if group is not None else (1, 0)
    owned = balance([int(b.input_ids_BT.numel()) for b in batches], ranks)
    device = next(state.model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    state.model.train()
    state.optimizer.zero_grad(set_to_none=True)
    seen: list[tuple[int, float, dict[str, float]]] = []
    with autocast:
        for i in owned[me]:
            batch = _to_device(batches[i], device)
            if reference:
                batch = replace(batch, ref_logprobs_BT=reference_logprobs(state.reference_model, batch))
            loss, metrics = loss_fn(state.model, batch, float(num_tokens))
            loss.backward()
            seen.append((batch.num_tokens, float(loss.detach()), metrics))
    params = _trainable(state.model)
    if group is not None:
        _all_reduce_grads(params)
        gathered: list[Any] = [None] * group.size
        dist.all_gather_object(gathered, seen)
        seen = [s for part in gathered for s in part]
    max_norm = state.config.max_grad_norm or float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    state.optimizer.step()
    state.step += 1
    out = _combine(seen, num_tokens)
    out.update(grad_norm=grad_norm, num_tokens=float(num_tokens), ranks_idle=float(sum(not o for o in owned)))
    if group is not None and group.rank == 0 and out["ranks_idle"] and not group.warned_idle:
        group.warned_idle = True
        print(
            f"agentbolt: {int(out['ranks_idle'])} of {group.size} ranks had no micro-batch in an update "
            f"({len(batches)} micro-batches): lower max_tokens_per_micro_batch or use fewer ranks",
            file=sys.stderr,
        )
    return out


_BUCKET_ELEMENTS = 16 * 1024 * 1024
"""Gradient elements summed per all-reduce (64 MB of float32): few collectives, and no second
copy of a fully fine-tuned model's gradients at once."""


def _all_reduce_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients over the ranks, in flat buckets of consecutive parameters (a parameter
    without a gradient on this rank, e.g. a rank without micro-batches, adds zeros). Every rank
    forms the same buckets: the same parameters in the same order."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        if bucket and (size + p.numel() > _BUCKET_ELEMENTS or p.dtype != bucket[0].dtype):
            _reduce_bucket(bucket)
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(params: list[nn.Parameter]) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    except Exception as exc:  # noqa: BLE001 - a peer died or timed out: one clear message
        raise DistributedError(f"gradient all-reduce failed (a rank died or timed out): {exc}") from exc
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p)  # a view, as DDP's bucket views
        offset += n


def _combine(seen: list[tuple[int, float, dict[str, float]]], num_tokens: int) -> dict[str, float]:
    """The losses summed, other metrics token-weighted; ``*_min`` / ``*_max`` by min / max."""
    out: dict[str, float] = {"loss": sum(loss for _, loss, _ in seen)}
    extremes: dict[str, list[float]] = {}
    for tokens, _, metrics in seen:
        for name, value in metrics.items():
            if name.endswith(("_min", "_max")):
                extremes.setdefault(name, []).append(value)
            else:
                out[name] = out.get(name, 0.0) + value * tokens / num_tokens
    for name, values in extremes.items():
        out[name] = min(values) if name.endswith("_min") else max(values)
    return out


# ---------------------------------------------------------------------------- the other ranks


def follow() -> TrainState | None:
    """The loop of a rank > 0: build the model rank 0 describes, then join each update until
    rank 0 says stop; returns this rank's replica (None if rank 0 set none up). Raises
    :class:`DistributedError` when rank 0 fails or goes silent."""
    group = _join(_local_device())
    liveness = _seconds(_LIVENESS_ENV, 120.0)
    state: TrainState | None = None
    try:
        while True:
            command = _receive(group, liveness)
            if isinstance(command, _Stop):
                if command.error:
                    raise DistributedError(f"rank {group.rank}: rank 0 failed: {command.error}")
                return state
            if isinstance(command, _Setup):
                state = _build(command, group.device)
            elif isinstance(command, _Load):
                if state is None:
                    raise DistributedError("rank 0 sent weights before the model")
                _load(state, command)
            elif isinstance(command, _Step):
                if state is None:
                    raise DistributedError("rank 0 sent an update before the model")
                _step(group, state, command.batches, command.loss_fn, command.bf16, command.reference)
            else:
                raise DistributedError(f"unknown command from rank 0: {type(command).__name__}")
    finally:
        _leave()


def _build(setup: _Setup, device: torch.device) -> TrainState:
    if isinstance(setup.model, nn.Module):
        model = setup.model.float()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(setup.model, dtype=torch.float32)
    return make_train_state(model.to(device), setup.config, reference=setup.reference)  # type: ignore[arg-type]


def _load(state: TrainState, load: _Load) -> None:
    _broadcast_trainable(state.model)
    state.optimizer.load_state_dict(load.optimizer)
    state.step = load.step
