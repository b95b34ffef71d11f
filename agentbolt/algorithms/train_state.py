"""The train-state side of GRPO and SFT: how a causal LM is made trainable (LoRA or full),
the optimizer step, checkpoints that resume exactly, and the trained weights written out or merged.
The losses it steps on live in :mod:`agentbolt.algorithms.losses`.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from agentbolt.algorithms.batch import Batch
from agentbolt.algorithms.lora_products import fuse_lora_products, is_peft
from agentbolt.algorithms.losses import LossFn
from agentbolt.algorithms.train_attention import use_train_attention

__all__ = [
    "Checkpoint",
    "RngState",
    "TrainConfig",
    "TrainState",
    "capture_rng_state",
    "export_weights",
    "fast_bf16",
    "frozen_base_to",
    "frozen_embeddings_to",
    "load_adapter",
    "load_checkpoint",
    "make_train_state",
    "make_trainable",
    "merge_lora",
    "trained_weights",
    "merged_state_dict",
    "optimizer_step",
    "restore_rng_state",
    "save_checkpoint",
]


# ---------------------------------------------------------------------------- making a model trainable


@dataclass(frozen=True)
class TrainConfig:
    """How a causal LM is made trainable and optimized."""

    lora: bool = True
    """False: full fine-tuning of every parameter."""
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    """PEFT's ``"all-linear"``: every linear projection except the output layer."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclass
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    config: TrainConfig = field(default_factory=TrainConfig)
    reference: nn.Module | None = None
    """A frozen copy of the initial weights, the KL term's reference in full fine-tuning
    (``make_train_state(..., reference=True)``): a second copy of the model in memory. None with
    LoRA, whose reference is the model with its adapter disabled (no copy), or without KL."""

    @property
    def reference_model(self) -> nn.Module:
        """The model whose log-probabilities are the initial policy's: the frozen copy, or the
        LoRA model itself (:func:`~agentbolt.algorithms.losses.reference_logprobs` disables the
        adapter). A full fine-tuning state made without ``reference=True`` has none."""
        if self.reference is not None:
            return self.reference
        if is_peft(self.model):
            return self.model
        raise ValueError("full fine-tuning keeps no reference model: make_train_state(..., reference=True)")


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` alias; not ours to fix."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def make_trainable(model: nn.Module, config: TrainConfig) -> nn.Module:
    """Wrap ``model`` in a LoRA adapter (or leave it whole for full fine-tuning); either way its
    attention takes :func:`~agentbolt.algorithms.train_attention.train_attention` (faster
    training passes on the CPU, sdpa otherwise)."""
    use_train_attention(model)
    if not config.lora:
        return model
    from peft import LoraConfig, get_peft_model  # only LoRA needs peft (2-3 s to import)

    targets = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    with _quiet_peft():
        model = get_peft_model(model, lora)
    fuse_lora_products(model)  # the same function in fewer passes over the activations
    return model


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matrix products are fast on ``device``: a GPU that supports them, or a
    CPU with native bfloat16 instructions (AVX512-BF16 or AMX). On an AVX2-only CPU PyTorch
    emulates them: a linear layer of SmolLM2's shapes ran at 9 GFLOP/s in bfloat16 against
    57-79 in float32 on one core of such a machine; train and serve in float32 there."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    from agentbolt.engine.matmul import native_bf16_matmul  # one check for engine and trainer

    return native_bf16_matmul()


@torch.no_grad()
def frozen_base_to(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen base weights of ``model``'s LoRA-adapted linear layers in ``dtype``
    (bfloat16 when training under bfloat16 autocast): returns how many bytes that spared.

    Under autocast a linear layer's product runs on its weight cast to bfloat16 at every call,
    so a frozen weight kept in float32 is never used at more than bfloat16's precision: stored
    in bfloat16 it gives the same logits and gradients at half the memory (SmolLM2-135M: 430 MB
    of float32 projections become 215 MB). The adapter, embeddings and norms stay as they are.
    Every other tensor is copied out of the weights file the model may have been loaded from
    (a memory map): the file's pages read during the cast then leave the process. A model
    without LoRA layers is left unchanged (0)."""
    if not is_peft(model):
        return 0
    from peft.tuners.lora import LoraLayer

    spared = 0
    converted: set[int] = set()
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        for param in base.parameters(recurse=False):
            if param.requires_grad or not param.dtype.is_floating_point or param.dtype == dtype:
                continue
            before = param.numel() * param.element_size()
            param.data = param.data.to(dtype)
            spared += before - param.numel() * param.element_size()
            converted.add(id(param))
    if converted:  # no tensor left in a memory-mapped file: all of its pages can go
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in converted:
                tensor.data = tensor.data.clone()
    return spared


@torch.no_grad()
def frozen_embeddings_to(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen input embeddings of a LoRA ``model`` in ``dtype`` (bfloat16 when training
    under bfloat16 autocast), with the output layer when it is tied to them; returns how many
    bytes that spared.

    Each lookup is cast back to the embeddings' former dtype, so the layers still add up float32
    hidden states; what changes is the embedding values, rounded to ``dtype`` as an engine serving
    the model in ``dtype`` holds them (bfloat16: a relative error of at most 2^-8). A tied
    output layer gives the same logits under autocast, which multiplies in bfloat16 anyway, and
    autocast no longer casts the whole float32 matrix at every call of it (SmolLM2: 57 MB each
    time, with 113 MB of float32 embeddings becoming 57 MB). Trainable embeddings, a model without
    LoRA and embeddings already in ``dtype`` are left unchanged (0)."""
    if not is_peft(model):
        return 0
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or weight.requires_grad or weight.dtype == dtype:
        return 0
    if not weight.dtype.is_floating_point:
        return 0
    wide = weight.dtype
    before = weight.numel() * weight.element_size()
    weight.data = weight.data.to(dtype)

    def widen(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return out.to(wide)

    embeddings.register_forward_hook(widen)
    return before - weight.numel() * weight.element_size()


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def make_train_state(
    model: nn.Module, config: TrainConfig = TrainConfig(), *, reference: bool = False
) -> TrainState:
    """``model`` made trainable, with its optimizer. ``reference``: keep what a KL penalty to the
    initial weights needs; for full fine-tuning that is a frozen copy of ``model`` taken now, on
    the same device (twice the weights' memory), for LoRA nothing (the adapter is disabled)."""
    frozen = _frozen_copy(model) if reference and not config.lora else None
    model = make_trainable(model, config)
    params = [p for _, p in _trainable(model)]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return TrainState(model=model, optimizer=optimizer, config=config, reference=frozen)


def _frozen_copy(model: nn.Module) -> nn.Module:
    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


def optimizer_step(state: TrainState, batches: Sequence[Batch], loss_fn: LossFn) -> dict[str, float]:
    """One update from gradients accumulated over ``batches`` (the micro-batches of one batch:
    ``[pad_batch(mb) for mb in micro_batches(rows, max_tokens=4096)]``), clipped to
    ``state.config.max_grad_norm``.

    Metrics are token-weighted means over the micro-batches; a batch without model tokens
    changes nothing and reports ``num_tokens`` 0."""
    num_tokens = sum(b.num_tokens for b in batches)
    if num_tokens == 0:
        return {"num_tokens": 0.0}
    state.model.train()
    state.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {"loss": 0.0}
    for batch in batches:
        loss, metrics = loss_fn(state.model, batch, float(num_tokens))
        loss.backward()
        totals["loss"] += float(loss.detach())
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value * batch.num_tokens / num_tokens
    params = [p for _, p in _trainable(state.model)]
    max_norm = state.config.max_grad_norm or float("inf")
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    state.optimizer.step()
    state.step += 1
    return {**totals, "num_tokens": float(num_tokens)}


# ---------------------------------------------------------------------------- checkpoints

RngState = dict[str, Any]


def capture_rng_state() -> RngState:
    state: RngState = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: RngState) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Checkpoint:
    step: int
    extra: dict[str, Any]


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rng_state: RngState | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write trainable parameters, optimizer state, RNG state (now, unless given), step and
    JSON ``extra``; written beside ``directory`` and renamed into place."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().contiguous() for n, p in _trainable(model)}, tmp / "trainable.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state or capture_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> Checkpoint:
    """Restore what :func:`save_checkpoint` wrote into a model prepared the same way."""
    directory = Path(directory)
    params = dict(_trainable(model))
    saved = load_file(directory / "trainable.safetensors")
    if saved.keys() != params.keys():
        raise ValueError(
            f"checkpoint parameters differ from the model's: {sorted(saved.keys() ^ params.keys())[:5]}"
        )
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
    if restore_rng:
        restore_rng_state(torch.load(directory / "rng.pt", weights_only=True))
    state = json.loads((directory / "state.json").read_text())
    return Checkpoint(step=state["step"], extra=state["extra"])


# ---------------------------------------------------------------------------- export and merge


def export_weights(model: nn.Module, directory: str | Path) -> Literal["lora", "full"]:
    """A PEFT adapter (adapter_config.json + safetensors) or a full HF model; returns which,
    ready for :class:`~agentbolt.schemas.ModelWeights`'s ``format``."""
    model.save_pretrained(str(directory), safe_serialization=True)  # type: ignore[operator]
    return "lora" if is_peft(model) else "full"


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """``model`` with the PEFT LoRA adapter saved in ``adapter_dir`` on top (not merged)."""
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(adapter_dir))


@torch.no_grad()
def merge_lora(model: nn.Module, *, in_place: bool = False) -> nn.Module:
    """The plain model with its LoRA adapter merged into the base weights; ``model`` itself when
    it has no adapter. A copy is merged unless ``in_place`` (the model trains on: its adapter
    must stay); ``in_place`` spares that copy's memory when the PEFT model is not needed after."""
    if not is_peft(model):
        return model
    return (model if in_place else copy.deepcopy(model)).merge_and_unload()


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Full weights under the base model's names, LoRA merged in; the model is not changed.
    Fresh tensors, safe to hand to an engine while training goes on."""
    merged = merge_lora(model)
    if merged is not model:  # merged into a copy: its tensors are fresh already
        return dict(merged.state_dict())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def trained_weights(model: nn.Module) -> dict[str, Tensor] | None:
    """The weights training can have changed, LoRA merged, under the base model's names: for a
    PEFT model with one active plain LoRA adapter on linear layers and nothing else trainable,
    each adapted layer's merged weight (fresh tensors). Every other weight is the frozen base,
    which a model server started from the same base holds already: a sync need not copy the
    whole model (:func:`merged_state_dict` deep-copies it to merge) nor send the embeddings.
    None where that does not hold (no adapter, DoRA, embedding or convolution adapters, other
    trainable parameters, an adapter merged already): send :func:`merged_state_dict` then."""
    if not is_peft(model):
        return None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    out: dict[str, Tensor] = {}
    covered: set[int] = set()
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear) or module.merged or len(module.active_adapters) != 1:
            return None
        adapter = module.active_adapters[0]
        covered.update(id(p) for p in module.parameters())
        if adapter not in module.lora_A:
            continue  # this layer has no weights of the active adapter: it is the base
        if module.use_dora.get(adapter) or module.lora_embedding_A:
            return None
        weight: Tensor = module.get_base_layer().weight  # type: ignore[assignment]
        # merged in float32 at least, then stored as the base is (a bfloat16 base: bfloat16)
        wide = torch.promote_types(weight.dtype, torch.float32)
        merged = weight.to(wide) + module.get_delta_weight(adapter).to(wide)
        out[f"{name}.weight"] = merged.to(weight.dtype)
    if not out or any(p.requires_grad and id(p) not in covered for p in model.parameters()):
        return None
    return out
