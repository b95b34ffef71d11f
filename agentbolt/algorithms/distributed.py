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
is slower there (docs/training.md, "Distributed training (torchrun)"), so replicas are the
default.

``AGENTBOLT_DIST_STRATEGY=fsdp2`` shards instead, for a policy whose weights plus optimizer state
do not fit on one device: every rank builds the model on the CPU and keeps only its shard of each
decoder layer and of the rest (``fully_shard``; the shards go to the rank's device). The loss
runs inside the forward of a root module (:class:`_Call`) that owns every parameter outside the
decoder layers, so the chunked output layer of ``masked_logprobs`` (which calls the body and the
head directly) still sees all-gathered weights. Every rank runs the same number of forward and
backward passes (a rank with fewer micro-batches adds zero-weight passes), FSDP reduce-scatters
the gradients as a sum (divide factor 1: the loss is already divided by the whole batch's token
count), the gradients are clipped by their global norm and each rank steps an optimizer over its
shards. Rank 0 also keeps the full model (``state.model``, moved to the CPU, without optimizer
state): after each update the trainable parameters are all-gathered into it, so checkpoints,
export and ``policy.sync`` work unchanged; a checkpoint's optimizer state is gathered from the shards when it is written
(``state.optimizer.state_dict()``), as a full state that resumes on any number of ranks.

Waiting: between updates rank 0 runs rollouts for minutes, so the other ranks do not wait inside
a collective (its timeout would end them); they poll the store for the next command and watch
rank 0's heartbeat (a counter it bumps every few seconds from a thread), and end with a message
when it stops (``AGENTBOLT_DIST_LIVENESS`` seconds, default 120). Collectives time out after
``AGENTBOLT_DIST_TIMEOUT`` seconds (default 1800): a rank that died mid-update ends the others
with a message, not a hang.
"""

from __future__ import annotations

import contextlib
import copy
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

from agentbolt.algorithms.batch import to_device as _to_device
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
    "strategy",
    "update",
    "world_size",
]

_TIMEOUT_ENV = "AGENTBOLT_DIST_TIMEOUT"
_LIVENESS_ENV = "AGENTBOLT_DIST_LIVENESS"
_BACKEND_ENV = "AGENTBOLT_DIST_BACKEND"
_STRATEGY_ENV = "AGENTBOLT_DIST_STRATEGY"
STRATEGIES = ("replicate", "fsdp2")
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
    strategy()  # a bad AGENTBOLT_DIST_STRATEGY: the same one-line error on every rank
    if not isinstance(algorithm, GRPO | SFT):
        raise ConfigError(
            f"{name} does not train over several ranks (WORLD_SIZE={world_size()}): only "
            f"{' and '.join(DISTRIBUTED_ALGORITHMS)} do; run it as one process, without torchrun"
        )


def strategy() -> str:
    """``AGENTBOLT_DIST_STRATEGY``: ``replicate`` (the default: a full replica per rank, summed
    gradients) or ``fsdp2`` (weights, gradients and optimizer state sharded over the ranks)."""
    chosen = os.environ.get(_STRATEGY_ENV) or "replicate"
    if chosen not in STRATEGIES:
        raise ConfigError(f"{_STRATEGY_ENV}={chosen!r}: choose {' or '.join(STRATEGIES)}")
    return chosen


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
    sharded: _Sharded | None = None
    """With ``fsdp2``: this rank's shards of the model being trained."""


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
    if group.sharded is not None and dist.is_initialized():
        # fsdp2: every rank is done with the shards' collectives before any tears the group down
        # (a rank closing it under the others' last messages aborted a run in 1 of 5)
        group.sharded = None
        with contextlib.suppress(Exception):
            dist.monitored_barrier(timeout=timedelta(seconds=30))
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
    strategy: str = "replicate"


@dataclass(frozen=True)
class _Load:
    step: int
    optimizer: dict[str, Any] | None
    """None (``fsdp2``): every rank keeps the optimizer state of its shards."""


@dataclass(frozen=True)
class _Gather:
    """``fsdp2``: the optimizer state of every shard, gathered to rank 0 (a checkpoint)."""


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
    chosen = strategy()
    _send(_group, _Setup(model, state.config, reference=state.reference is not None, strategy=chosen))
    _group.sharded = None
    if chosen == "fsdp2":  # rank 0 shards a copy; state.model stays the full model, on the CPU
        state.model.cpu()  # the optimizer holds no state yet: its parameters move with the model
        reference = copy.deepcopy(state.reference.cpu()) if state.reference is not None else None
        _group.sharded = _make_sharded(copy.deepcopy(state.model), reference, state.config, _group.device)
        state.optimizer.__class__ = _GatheringAdamW
    share_state(state)


def share_state(state: TrainState) -> None:
    """On rank 0: every rank takes ``state``'s trainable parameters, optimizer state and step
    (after a fresh start or a resume; a no-op on one rank)."""
    if not leading():
        return
    group = _group
    assert group is not None
    if group.sharded is not None:
        # the full model's weights, and its optimizer state when one was loaded (a resume)
        shadow = state.optimizer
        full = _cpu(torch.optim.Optimizer.state_dict(shadow)) if shadow.state else None
        _send(group, _Load(state.step, full))
        _load_sharded(group.sharded, dict(_trainable_named(state.model)), full, state.step)
        shadow.state.clear()  # the shards hold it now
        return
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
        if _group.sharded is not None:
            out = _step_sharded(_group, _group.sharded, state, batches, loss_fn, bf16, reference)
            state.step = _group.sharded.step
            return out
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
            sharded = group.sharded
            if isinstance(command, _Setup):
                group.sharded = None
                if command.strategy == "fsdp2":
                    full = _build(command, torch.device("cpu"))  # only the shards go to the device
                    sharded = group.sharded = _make_sharded(
                        full.model, full.reference, full.config, group.device
                    )
                    del full
                    state = sharded.view()
                else:
                    state = _build(command, group.device)
            elif state is None:
                raise DistributedError(f"rank 0 sent {type(command).__name__} before the model")
            elif isinstance(command, _Load) and sharded is not None:
                _load_sharded(sharded, None, command.optimizer, command.step)
                state.step = sharded.step
            elif isinstance(command, _Load):
                _load(state, command)
            elif isinstance(command, _Gather) and sharded is not None:
                _gather_optimizer(sharded)
            elif isinstance(command, _Step) and sharded is not None:
                _step_sharded(
                    group, sharded, None, command.batches, command.loss_fn, command.bf16, command.reference
                )
                state.step = sharded.step
            elif isinstance(command, _Step):
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
    return make_train_state(model.to(device), setup.config, reference=setup.reference)


def _load(state: TrainState, load: _Load) -> None:
    _broadcast_trainable(state.model)
    if load.optimizer is not None:
        state.optimizer.load_state_dict(load.optimizer)
    state.step = load.step


# ---------------------------------------------------------------------------- FSDP2 (fsdp2)


class _Call(nn.Module):
    """The FSDP2 root: ``fn(model, *args)`` (the loss, the reference log-probs) runs inside its
    forward, so the parameters outside the decoder layers (embedding, final norm, output layer)
    are all-gathered for all of it, also where ``masked_logprobs`` calls the body and the output
    layer directly instead of the model's forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Any, *args: Any) -> Any:
        return fn(self.model, *args)


@dataclass
class _Sharded:
    """One rank's shards: the root, the reference's root (full fine-tuning with KL; None: the
    LoRA model with its adapter disabled is the reference), the optimizer over the shards."""

    root: _Call
    reference: _Call | None
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    device: torch.device
    step: int = 0

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return _trainable_named(self.root.model)

    def view(self) -> TrainState:
        """A :class:`TrainState` over the shards (what ``follow`` returns)."""
        return TrainState(self.root.model, self.optimizer, self.step, self.config)


def _trainable_named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the Hugging Face model's ``_no_split_modules`` classes, else the
    entries of its longest ``ModuleList``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=lambda m: sum(1 for _ in m))) if lists else []


def _shard(model: nn.Module, device: torch.device) -> _Call:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    root = _Call(model)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):  # a sum: the loss is divided by the whole batch's tokens
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return root


def _make_sharded(
    model: nn.Module, reference: nn.Module | None, config: TrainConfig, device: torch.device
) -> _Sharded:
    root = _shard(model.float(), device)
    reference_root = _shard(reference.float(), device) if reference is not None else None
    params = [p for _, p in _trainable_named(root.model)]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return _Sharded(root, reference_root, optimizer, config, device)


def _scatter(full: torch.Tensor | None, like: Any) -> Any:
    """Rank 0's ``full`` tensor as a DTensor sharded like the parameter ``like`` (other ranks
    pass None: a collective)."""
    from torch.distributed.tensor import distribute_tensor

    if full is None:
        full = torch.empty(like.shape, dtype=like.dtype, device=like.to_local().device)
    return distribute_tensor(
        full.to(like.to_local().device), like.device_mesh, like.placements, src_data_rank=0
    )


@torch.no_grad()
def _load_sharded(
    sharded: _Sharded, full: dict[str, torch.Tensor] | None, optimizer: dict[str, Any] | None, step: int
) -> None:
    """Every rank takes its shard of rank 0's full trainable parameters (``full``, None on the
    other ranks) and of the full optimizer state (the same on every rank; None: keep)."""
    params = sharded.trainable()
    if full is not None and full.keys() != dict(params).keys():
        raise DistributedError("the full model's trainable parameters differ from the sharded model's")
    for name, p in params:
        p.copy_(_scatter(full[name].detach() if full is not None else None, p))
    if optimizer is not None:
        state: dict[Any, Any] = {}
        for index, values in optimizer["state"].items():
            p = params[int(index)][1]
            state[index] = {
                k: _scatter(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                for k, v in values.items()
            }
        sharded.optimizer.load_state_dict({"state": state, "param_groups": optimizer["param_groups"]})
    sharded.step = step


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _gather_optimizer(sharded: _Sharded) -> dict[str, Any]:
    """The optimizer state of the whole model (every rank calls it: one all-gather per tensor),
    in ``torch.optim`` form (indexed like the trainable parameters), on the CPU."""
    own = sharded.optimizer.state_dict()
    state = {
        index: {k: _full(v).detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for index, values in sorted(own["state"].items())
    }
    return {"state": state, "param_groups": own["param_groups"]}


class _GatheringAdamW(torch.optim.AdamW):
    """Rank 0's optimizer of the full model with ``fsdp2``: it holds no state between updates
    (the shards do); ``state_dict()`` gathers the shards' state, so a checkpoint is the full state."""

    def state_dict(self) -> dict[str, Any]:
        group = _group
        if self.state or group is None or group.sharded is None or not leading():
            return super().state_dict()  # a state just loaded (a resume), not shared yet
        _send(group, _Gather())
        return _gather_optimizer(group.sharded)


def _padding(batches: list[Batch]) -> Batch:
    """A zero-weight micro-batch for a rank with fewer than the others: one row of the smallest
    micro-batch, one with model tokens (every parameter a real pass uses gets a gradient, as on
    the other ranks); its loss is multiplied by 0, it only keeps the collectives in step."""
    for small in sorted(batches, key=lambda b: int(b.input_ids_BT.numel())):
        trained = (small.loss_mask_BT.sum(dim=1) > 0).nonzero()
        if len(trained):
            row = int(trained[0, 0])
            tensors = {f.name: getattr(small, f.name) for f in fields(small)}
            picked = {k: v[row : row + 1] for k, v in tensors.items() if isinstance(v, torch.Tensor)}
            return replace(small, **picked)
    raise AssertionError("an update with model tokens has a micro-batch with model tokens")


def _sft_loss_one_pass(model: nn.Module, batch: Batch, num_tokens: float | None = None) -> Any:
    """``sft_loss`` without the shared-prefix pass (:func:`_one_pass`)."""
    from agentbolt.algorithms.losses import masked_logprobs

    logprobs_BT, _ = masked_logprobs(model, batch, 0)
    mask_BT = batch.loss_mask_BT
    divisor = num_tokens if num_tokens is not None else float(mask_BT.sum().clamp(min=1))
    loss = -(logprobs_BT * mask_BT).sum() / divisor
    return loss, {"nll": float(-(logprobs_BT.detach() * mask_BT).sum() / mask_BT.sum().clamp(min=1))}


@torch.no_grad()
def _reference_one_pass(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``reference_logprobs`` without the shared-prefix pass (:func:`_one_pass`): a rank whose
    micro-batch shares a prefix would call each layer once more than another rank, and the
    all-gathers would no longer line up."""
    from agentbolt.algorithms.lora_products import is_peft
    from agentbolt.algorithms.losses import masked_logprobs

    was_training = model.training
    model.eval()
    try:
        if is_peft(model):
            with model.disable_adapter():
                return masked_logprobs(model, batch, 0)[0]
        return masked_logprobs(model, batch, 0)[0]
    finally:
        model.train(was_training)


def _one_pass(loss_fn: LossFn) -> LossFn:
    """The loss with each decoder layer called once per micro-batch: the shared-prefix path
    (the prefix as one row, then the suffixes) calls every layer twice, so ranks with and
    without a shared prefix would all-gather a different number of times, and FSDP2 frees a
    layer's gathered weights after its first backward, which the second needs. Same values.
    A loss of your own must call each layer once per micro-batch too."""
    from agentbolt.algorithms.losses import PolicyLoss, sft_loss

    if isinstance(loss_fn, PolicyLoss):
        return replace(loss_fn, share_prefix=False)
    if loss_fn is sft_loss:
        return _sft_loss_one_pass
    return loss_fn


def _step_sharded(
    group: _Group,
    sharded: _Sharded,
    full: TrainState | None,
    batches: list[Batch],
    loss_fn: LossFn,
    bf16: bool,
    reference: bool,
) -> dict[str, float]:
    """Every rank's part of one ``fsdp2`` update; ``full`` (rank 0): the full model, which takes
    the updated trainable parameters."""
    num_tokens = sum(b.num_tokens for b in batches)
    if num_tokens == 0:
        return {"num_tokens": 0.0}
    owned = balance([int(b.input_ids_BT.numel()) for b in batches], group.size)
    mine = owned[group.rank]
    passes = max(len(o) for o in owned)  # the same on every rank: FSDP's collectives line up
    pad = _padding(batches)
    device = sharded.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    root = sharded.root
    root.train()
    loss_fn = _one_pass(loss_fn)
    sharded.optimizer.zero_grad(set_to_none=True)
    seen: list[tuple[int, float, dict[str, float]]] = []
    with autocast:
        for k in range(passes):
            real = k < len(mine)
            batch = _to_device(batches[mine[k]] if real else pad, device)
            if reference:
                with torch.no_grad():
                    ref_root = sharded.reference or root
                    batch = replace(batch, ref_logprobs_BT=ref_root(_reference_one_pass, batch))
            loss, metrics = root(loss_fn, batch, float(num_tokens))
            if real:
                loss.backward()
                seen.append((batch.num_tokens, float(loss.detach()), metrics))
            else:
                (loss * 0.0).backward()
    params = [p for _, p in sharded.trainable()]
    gathered: list[Any] = [None] * group.size
    dist.all_gather_object(gathered, seen)
    seen = [s for part in gathered for s in part]
    max_norm = sharded.config.max_grad_norm or float("inf")
    grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
    sharded.optimizer.step()
    sharded.step += 1
    with torch.no_grad():  # the full model on rank 0 takes the new weights (sync, export, checkpoints)
        target = dict(full.model.named_parameters()) if full is not None else {}
        for name, p in sharded.trainable():
            value = _full(p.detach())
            if full is not None:
                target[name].copy_(value)
    out = _combine(seen, num_tokens)
    out.update(grad_norm=grad_norm, num_tokens=float(num_tokens), ranks_idle=float(sum(not o for o in owned)))
    return out
