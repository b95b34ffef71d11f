"""The engine's own C kernel for a decode step's attention, built on first use.

A decode step attends one new query position per row to that row's cached keys and values. For
SmolLM2 (32 rows, 9 query heads sharing 3 key-value heads, 64 dimensions, about 100 cached
positions) that is about 7 million multiply-adds per layer, a few tens of microseconds of
arithmetic; PyTorch's CPU flash kernel spent 291 us per layer on it inside a served decode step
(a quarter of the step, ``inference_throughput.py --profile-steps``), mostly on work that does not
grow with the cache: splitting into blocks, converting them to float32 and back, masking.
``kernels.c`` does the same computation directly on the batch's cache: per row and key-value head,
the scores of its query heads in float32, a float32 softmax over the row's token columns (the
attention mask read from the batcher's 0/1 mask, padding skipped), the weighted sum of the values
in float32, rounded to the model's dtype once. The flash kernel rounds the softmax weights to
bfloat16 before the values' product; this kernel does not, so its output is at least as close to
a float64 reference (tested).

It is C called through ``ctypes``, not a PyTorch C++ extension: it includes no PyTorch header, so
it builds in about half a second with the system's C compiler (``$CC``, else ``cc``) where a
C++ extension takes about a minute, and it needs neither ninja nor a matching PyTorch ABI.
``-march=native`` lets the compiler use the CPU's vector instructions; ``-fopenmp`` links
``libgomp.so.1``, which resolves to the OpenMP runtime PyTorch has already loaded, so the kernel's
parallel loop runs on the same thread team, with the thread count PyTorch was given
(``torch.set_num_threads``, which the engine's thread tuner sets). The library is cached under
``kernels/`` of the model cache (``$AGENTBOLT_CACHE``, else ``~/.cache/agentbolt``) by a hash of the source, the
compiler's version and flags and the CPU's feature flags; a new build replaces it atomically, so
processes building it at once do not clash.

Where it cannot be built (no compiler, a failed build), or with ``AGENTBOLT_KERNELS=0`` or
``EngineConfig(kernels=False)``, the engine keeps PyTorch's attention; ``status()`` says why, and
``ModelEngine.stats()["attention"]`` which one serves.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from agentbolt.engine.model_files import cache_root

__all__ = ["available", "decode_attention", "status"]

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
ABI = 1
_DTYPES = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet


def status() -> str:
    """ "built: PATH", or why the kernel is not used (building it first if not yet tried)."""
    _load()
    assert _status is not None
    return _status


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def decode_attention(
    q_BKGD: torch.Tensor,
    keys_BKLD: torch.Tensor,
    values_BKLD: torch.Tensor,
    mask_BL: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one query position per row, the query heads of each key-value head packed
    (``q_BKGD``: rows x key-value heads x query heads per key-value head x dims), over ``keys`` and
    ``values`` (rows x key-value heads x L columns x dims, any strides but the last) where
    ``mask_BL`` (rows x L) is nonzero; None when the kernel is unavailable or the tensors are not
    CPU tensors of one supported dtype (the caller then uses PyTorch's attention)."""
    lib = _load()
    dtype = q_BKGD.dtype
    if lib is None or dtype not in _DTYPES or q_BKGD.device.type != "cpu":
        return None
    if keys_BKLD.dtype != dtype or values_BKLD.dtype != dtype or keys_BKLD.device.type != "cpu":
        return None
    B, KV, G, D = q_BKGD.shape
    L = keys_BKLD.shape[2]
    if keys_BKLD.shape != (B, KV, L, D) or values_BKLD.shape != (B, KV, L, D) or mask_BL.shape != (B, L):
        return None
    if keys_BKLD.stride(3) != 1 or values_BKLD.stride(3) != 1:
        return None
    q = q_BKGD.contiguous()
    mask = mask_BL if mask_BL.dtype == torch.int64 and mask_BL.stride(1) == 1 else mask_BL.long().contiguous()
    out = torch.empty_like(q)
    code = getattr(lib, _DTYPES[dtype])(
        q.data_ptr(),
        keys_BKLD.data_ptr(),
        values_BKLD.data_ptr(),
        mask.data_ptr(),
        out.data_ptr(),
        B,
        KV,
        G,
        D,
        L,
        *keys_BKLD.stride()[:3],
        *values_BKLD.stride()[:3],
        mask.stride(0),
        scale,
    )
    return out if code == 0 else None


def _load() -> ctypes.CDLL | None:
    global _lib, _status
    if _status is not None:
        return _lib
    with _lock:
        if _status is None:
            if os.environ.get("AGENTBOLT_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
                _status = "switched off (AGENTBOLT_KERNELS=0)"
            else:
                try:
                    path = _build()
                    _lib = _open(path)
                    _status = f"built: {path}"
                except KernelBuildError as exc:
                    _status = str(exc)
    return _lib


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded (the message says why)."""


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if shutil.which(cc[0]) is None:
        raise KernelBuildError(f"no C compiler: {cc[0]!r} not found (set CC, or install gcc)")
    return cc


def _build() -> Path:
    cc = _compiler()
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"the C compiler {cc[0]!r} did not run: {exc}") from exc
    key = hashlib.sha256()
    for part in (
        source,
        version.encode(),
        " ".join(FLAGS).encode(),
        platform.machine().encode(),
        _cpu_flags(),
    ):
        key.update(part + b"\0")
    folder = _cache_dir()
    path = folder / f"kernels-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel to {folder}: {exc}") from exc
    try:
        done = subprocess.run(
            [*cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise KernelBuildError(
                f"building {SOURCE.name} failed: {(done.stderr or done.stdout).strip()[-500:]}"
            )
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {SOURCE.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {path} failed: {exc}") from exc
    if lib.kernels_abi() != ABI:
        raise KernelBuildError(f"{path} reports another interface version")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in _DTYPES.values():
        fn = getattr(lib, name)
        fn.argtypes = [pointer] * 5 + [size] * 12 + [ctypes.c_float]
        fn.restype = ctypes.c_int
    return lib


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags (``-march=native`` builds for them), or b"" where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
