"""Swapping the served weights in place: a full (or partial) state dict, or a LoRA adapter.

A LoRA adapter is merged into the weights (``W = W_base + B @ A * scale``) instead of being run as
a side branch, so serving costs nothing extra. Each adapter is applied to the *base* weights, not
on top of the previous adapter: the base of every weight an adapter touched is kept once (in the
served dtype), and a weight the new adapter no longer touches gets its base back. A state dict
becomes the new base. Checking and merging happen in the caller's thread; only the final copy
into the model's parameters runs between two engine steps.

Supported adapters: PEFT LoRA on linear layers (``lora_A``/``lora_B``, ``use_rslora``,
``fan_in_fan_out``, per-module ``rank_pattern``/``alpha_pattern``) plus ``modules_to_save``
weights; DoRA and LoRA on embeddings are refused.

The engine may hold a linear weight only in packed form (``agentbolt.engine.matmul``:
``PackedMatmul(release_plain=...)`` leaves a placeholder): its values are read back with
``plain_weight`` where a merge or a kept base needs them, and it is written by assigning a fresh
tensor, which the engine packs at its next step.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from agentbolt.engine.matmul import is_placeholder, plain_weight
from agentbolt.engine.protocol import EngineRequestError

__all__ = ["WeightManager", "load_tensors"]

_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def load_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` (or torch ``.bin``/``.pt``) state dict from disk."""
    path = Path(path)
    if not path.is_file():
        raise EngineRequestError(
            f"no weights file at {path}", status_code=404, param="path", code="not_found"
        )
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        key = key.removeprefix(prefix)
    return key


class WeightManager:
    """Turns published weights into a ready-to-copy ``{param_name: tensor}`` and copies it in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # remove_duplicate=False keeps tied names (lm_head.weight next to embed_tokens.weight)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._base: dict[str, torch.Tensor] = {}

    # ----------------------------------------------------------- caller thread: check + merge
    def prepare_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not state_dict:
            raise EngineRequestError("the state dict is empty", param="state_dict")
        out = {}
        for key, tensor in state_dict.items():
            name = self._param_name(_strip(key))
            out[name] = self._checked(name, tensor)
        return out

    def prepare_adapter(self, adapter_path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
        """The adapter merged: ``{param_name: base + delta}`` (and its ``modules_to_save``)."""
        config, pairs, full = self._adapter_parts(Path(adapter_path))
        merged = {name: self._merge_lora(name, ab, config) for name, ab in pairs.items()}
        return {**merged, **full}

    def prepare_row_adapter(
        self, adapter_path: str | os.PathLike[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter unmerged, for serving beside others (:mod:`agentbolt.engine.lora_rows`):
        ``{param_name: (A, B * scale)}`` in float32. An adapter that replaces whole
        weights (``modules_to_save``) cannot be served per row and is refused."""
        folder = Path(adapter_path)
        config, pairs, full = self._adapter_parts(folder)
        if config.get("fan_in_fan_out"):
            raise EngineRequestError("fan_in_fan_out adapters (Conv1D layers) cannot be served per row")
        if full:
            raise EngineRequestError(
                f"adapter at {folder} replaces whole weights ({', '.join(sorted(full))}): it cannot be "
                "served beside other adapters; merge it with update_weights instead",
                param="lora_path",
            )
        out = {}
        for name, ab in pairs.items():
            param, scale = self.params[name], self._scale(ab["module"], ab, config)
            a, b = ab["A"].float(), ab["B"].float() * scale
            if (b.shape[0], a.shape[1]) != tuple(param.shape):
                raise EngineRequestError(
                    f"LoRA for {name!r} has shape {(b.shape[0], a.shape[1])}, expected {tuple(param.shape)}"
                )
            out[name] = (a.to(param.device), b.to(param.device))  # float32: small, fast on every CPU
        return out

    def _adapter_parts(self, folder: Path) -> tuple[dict, dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
        """The adapter's config, its LoRA pairs by parameter name, its full weights."""
        config = self._adapter_config(folder)
        tensors = self._adapter_tensors(folder)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        full: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            match = _LORA_KEY.match(_strip(key))
            if match:
                pairs.setdefault(match["module"], {})[match["ab"]] = tensor
            elif "lora_" in key:
                raise EngineRequestError(f"unsupported adapter tensor {key} (only LoRA on linear layers)")
            else:  # modules_to_save: a full replacement of that weight
                name = self._param_name(_strip(key).replace(".modules_to_save.default", ""))
                full[name] = self._checked(name, tensor)
        if not pairs and not full:
            raise EngineRequestError(f"adapter at {folder} holds no LoRA weights", param="lora_path")
        return config, self._by_param(pairs), full

    # ----------------------------------------------------------- engine thread: copy
    def apply_state_dict(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._restore_base()
        self._base.clear()
        self._copy(weights)

    def apply_adapter(self, weights: Mapping[str, torch.Tensor]) -> None:
        for name in weights:
            if name not in self._base:
                base = plain_weight(self.params[name])
                self._base[name] = base if is_placeholder(self.params[name]) else base.clone()
        self._restore_base(skip=set(weights))
        self._copy(weights)

    # ----------------------------------------------------------- helpers
    def _param_name(self, key: str) -> str:
        if key in self.params:
            return key
        if key + ".weight" in self.params:
            return key + ".weight"
        raise EngineRequestError(f"weight {key!r} does not belong to this model", param="state_dict")

    def _checked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = self.params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise EngineRequestError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}",
                param="state_dict",
            )
        return tensor.detach().to(device=param.device, dtype=param.dtype)

    def _adapter_config(self, folder: Path) -> dict:
        path = folder / "adapter_config.json"
        if not path.is_file():
            raise EngineRequestError(
                f"no adapter_config.json in {folder}", status_code=404, param="lora_path"
            )
        config = json.loads(path.read_text())
        if config.get("use_dora"):
            raise EngineRequestError("DoRA adapters are not supported; merge them and publish a state dict")
        return config

    def _adapter_tensors(self, folder: Path) -> dict[str, torch.Tensor]:
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            if (folder / name).is_file():
                return load_tensors(folder / name)
        raise EngineRequestError(
            f"no adapter_model.safetensors in {folder}", status_code=404, param="lora_path"
        )

    def _by_param(self, pairs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
        out = {}
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise EngineRequestError(f"adapter module {module} lacks lora_A or lora_B")
            out[self._param_name(module)] = ab | {"module": module}
        return out

    @staticmethod
    def _scale(module: str, ab: dict, config: dict) -> float:
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", ab["A"].shape[0]))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        return float(alpha / (rank**0.5 if config.get("use_rslora") else rank))

    def _merge_lora(self, name: str, ab: dict, config: dict) -> torch.Tensor:
        delta = (ab["B"].float() @ ab["A"].float()) * self._scale(ab["module"], ab, config)
        if config.get("fan_in_fan_out"):
            delta = delta.T
        param = self.params[name]
        base = self._base.get(name)
        if base is None:
            base = plain_weight(param)
        if tuple(delta.shape) != tuple(param.shape):
            raise EngineRequestError(
                f"LoRA for {name!r} has shape {tuple(delta.shape)}, expected {tuple(param.shape)}"
            )
        return (base.float() + delta.to(param.device)).to(param.dtype)

    def _restore_base(self, skip: Set[str] = frozenset()) -> None:
        for name, base in list(self._base.items()):
            if name not in skip:
                _write(self.params[name], base)
                del self._base[name]

    def _copy(self, weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                _write(self.params[name], tensor)


def _write(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copies ``value`` into ``param``; a placeholder gets a fresh tensor of its own."""
    if is_placeholder(param):
        param.data = value.detach().to(dtype=param.dtype).clone(memory_format=torch.contiguous_format)
    else:
        param.data.copy_(value)


def _pattern_value(pattern: dict, module: str, default):
    for key, value in pattern.items():
        if module == key or module.endswith("." + key) or re.search(key, module):
            return value
    return default
