"""The engine's own C kernels for the work of a decode step around its matrix products.

With its weights packed for oneDNN, a decode step of SmolLM2 (bfloat16, 32 rows, 2 threads) spent
half its time in the matrix products and the rest in PyTorch calls too small to use the CPU well
(``inference_throughput.py --profile-steps``, 35.6 ms a step): the CPU flash-attention kernel took
291 us per layer for about 7 million multiply-adds (a quarter of the step), and a thousand small
elementwise calls took most of what was left. ``kernels.c`` does that work in a few calls per
layer, on the batch's own tensors:

- ``decode_attention``: one query position per row against that row's cached keys and values
  (any strides), per row and key-value head, its query heads together: float32 scores, a float32
  softmax over the row's token columns (the batcher's 0/1 mask; padding skipped), the weighted sum
  of the values in float32, rounded to the model's dtype once. The flash kernel rounds the softmax
  weights to bfloat16 before the values' product; this one does not, so its output is at least as
  close to a float64 reference (tested). With AVX-512, sixteen scores are reduced at once;
  without it, portable loops compute the same (tested with a build of ``-mno-avx512f``).
- ``rope_append``: the rotary embedding of the step's query and key heads and the write of the
  keys and values into the cache's new column (``kv_cache.append_column``), in place of eight
  elementwise ops, two copies and the cache's bookkeeping per layer.
- ``add_rms_norm`` and ``silu_mul``: the residual add with the next RMSNorm, and the gated MLP's
  ``silu(gate) * up``.
- ``row_stats``: each row's largest logit, its first column and the log-sum-exp, from which
  ``sample_step`` takes greedy tokens and every log-probability, instead of a float32 copy of the
  logits and a log-softmax over the whole vocabulary.

Each rounds to the model's dtype where the PyTorch ops it replaces round, so in bfloat16 RoPE,
the residual add and the norm give PyTorch's bits (the norm's sum of squares is taken in another
order, which changed no bfloat16 result in the tests' rows) and the SiLU, with its own exp, is
within one unit in the last place; in float32 the results agree to float32 rounding.

They are C called through ``ctypes``, not a PyTorch C++ extension: no PyTorch header, so the
build takes about half a second with the system's C compiler (``$CC``, else ``cc``) and needs
neither ninja nor a matching PyTorch ABI. ``-march=native`` (``$AGENTBOLT_KERNEL_CFLAGS`` adds flags) lets the compiler use the CPU's vector
instructions; ``-fopenmp`` links ``libgomp.so.1``, which resolves to the OpenMP runtime PyTorch has
already loaded, so the kernels' parallel loops run on the same thread team with the thread count
PyTorch was given (``torch.set_num_threads``, which the engine's thread tuner sets). The library is
cached under ``kernels/`` of the model cache (``$AGENTBOLT_CACHE``, else ``~/.cache/agentbolt``) by
a hash of the source, the compiler's version and flags and the CPU's feature flags; a new build
replaces it atomically, so processes building it at once do not clash.

Where they cannot be built (no compiler, a failed build), or with ``AGENTBOLT_KERNELS=0`` or
``EngineConfig(kernels=False)`` (``agentbolt model serve --no-kernels``), the engine keeps
PyTorch's ops; ``status()`` says why, ``ModelEngine.stats()["attention"]`` which attention serves.
Every function here returns None, having changed nothing, for tensors it does not take, and the
caller then runs the PyTorch ops.
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
from typing import Any

import torch

from agentbolt.engine.model_files import cache_root

__all__ = ["add_rms_norm", "available", "decode_attention", "rope_append", "row_stats", "silu_mul", "status"]

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
ABI = 3
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_SIGNATURES = {  # (pointer arguments, int64 arguments, whether a float comes last)
    "decode_attention": (5, 12, True),
    "add_rms_norm": (4, 5, True),
    "silu_mul": (3, 5, False),
    "rope_append": (3, 3, False),  # then 5 pointers and 11 int64s: see _open
    "row_stats": (1, 3, False),  # then 3 pointers: see _open
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet


def status() -> str:
    """``built: PATH (AVX-512)`` or ``built: PATH (portable loops)``, or why the kernels are not
    used (building them first if not yet tried)."""
    _load()
    assert _status is not None
    return _status


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
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
    fn = _function("decode_attention", q_BKGD, keys_BKLD, values_BKLD)
    if fn is None or q_BKGD.dim() != 4 or keys_BKLD.dim() != 4:
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
    code = fn(
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


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """``x += residual`` in place (rounded to the dtype; skipped when ``residual`` is None), then
    the RMS norm of every row of ``x`` times ``weight``, as a new tensor: in bfloat16 the
    normalised row is rounded before the weight's product (``LlamaRMSNorm``'s steps), in float32
    one product. None (nothing changed) when the kernel does not take these tensors."""
    n = x.shape[-1]
    fn = _function("add_rms_norm", x, weight, *([] if residual is None else [residual]))
    rows = _rows(x)
    if fn is None or rows is None or weight.shape != (n,) or not weight.is_contiguous():
        return None
    res_rows = None if residual is None else _rows(residual)
    if residual is not None and (residual.shape != x.shape or res_rows is None or res_rows[0] != rows[0]):
        return None
    h = torch.empty(x.shape, dtype=x.dtype)
    res_ptr, res_stride = (None, 0) if residual is None else (residual.data_ptr(), res_rows[1])  # type: ignore[index]
    fn(x.data_ptr(), res_ptr, weight.data_ptr(), h.data_ptr(), rows[0], n, rows[1], res_stride, n, eps)
    return h


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` (in bfloat16 the activation rounded first, as PyTorch's two ops do);
    None when the kernel does not take these tensors."""
    fn = _function("silu_mul", gate, up)
    g_rows, u_rows = _rows(gate), _rows(up)
    if fn is None or g_rows is None or u_rows is None or gate.shape != up.shape or g_rows[0] != u_rows[0]:
        return None
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype)
    fn(gate.data_ptr(), up.data_ptr(), out.data_ptr(), g_rows[0], n, g_rows[1], u_rows[1], n)
    return out


def rope_append(
    q_B1X: torch.Tensor,
    k_B1X: torch.Tensor,
    v_B1X: torch.Tensor,
    cos_BD: torch.Tensor,
    sin_signed_BD: torch.Tensor,
    buf_k: torch.Tensor,
    buf_v: torch.Tensor,
    column: int,
    head_dim: int,
) -> torch.Tensor | None:
    """One decode step's rotary embedding and cache write for one layer: the query heads of
    ``q_B1X`` (rows x 1 x heads*dims) rotated into a new rows x heads x dims tensor, the key heads
    rotated and the value heads copied into column ``column`` of the cache buffers (rows x
    key-value heads x capacity x dims); rotation as ``x * cos + roll(x, dims/2) * sin_signed``
    with each product and the sum rounded to the dtype. None (nothing written) when the kernel
    does not take these tensors."""
    fn = _function("rope_append", q_B1X, k_B1X, v_B1X, cos_BD, sin_signed_BD, buf_k, buf_v)
    if fn is None or q_B1X.dim() != 3 or q_B1X.shape[1] != 1:
        return None
    B, KV, C, D = buf_k.shape
    H = q_B1X.shape[2] // head_dim
    if D != head_dim or q_B1X.shape != (B, 1, H * D) or buf_v.shape != buf_k.shape or not 0 <= column < C:
        return None
    if k_B1X.shape != (B, 1, KV * D) or v_B1X.shape != (B, 1, KV * D) or cos_BD.shape != (B, D):
        return None
    if any(t.stride(2) != 1 for t in (q_B1X, k_B1X, v_B1X)) or buf_k.stride(3) != 1 or buf_v.stride(3) != 1:
        return None
    if not (cos_BD.is_contiguous() and sin_signed_BD.is_contiguous() and sin_signed_BD.shape == (B, D)):
        return None
    q_out = torch.empty(B, H, D, dtype=q_B1X.dtype)
    code = fn(
        q_B1X.data_ptr(),
        k_B1X.data_ptr(),
        v_B1X.data_ptr(),
        q_B1X.stride(0),
        k_B1X.stride(0),
        v_B1X.stride(0),
        cos_BD.data_ptr(),
        sin_signed_BD.data_ptr(),
        q_out.data_ptr(),
        buf_k.data_ptr(),
        buf_v.data_ptr(),
        B,
        H,
        KV,
        D,
        *buf_k.stride()[:3],
        *buf_v.stride()[:3],
        column,
    )
    return q_out if code == 0 else None


def row_stats(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row: the largest logit (float32), the first column holding it (int64: what
    ``torch.argmax`` returns) and ``log(sum(exp(logits - largest)))`` (float32), so that
    ``log_softmax(logits)[j] == (logits[j] - largest) - logsum``: one pass of the kernel instead of
    a float32 copy, a log-softmax over the whole vocabulary and an argmax. None when the kernel
    does not take the tensor or a row holds NaN (PyTorch's rules decide then)."""
    fn = _function("row_stats", logits_BV)
    if fn is None or logits_BV.dim() != 2 or logits_BV.stride(1) != 1 or logits_BV.shape[1] == 0:
        return None
    B, V = logits_BV.shape
    top = torch.empty(B, dtype=torch.float32)
    arg = torch.empty(B, dtype=torch.int64)
    logsum = torch.empty(B, dtype=torch.float32)
    code = fn(
        logits_BV.data_ptr(), B, V, logits_BV.stride(0), top.data_ptr(), arg.data_ptr(), logsum.data_ptr()
    )
    return (top, arg, logsum) if code == 0 else None


def _function(name: str, *tensors: torch.Tensor) -> Any:
    """The kernel ``name`` for the dtype of ``tensors`` (all CPU tensors of one supported dtype), or None."""
    lib = _load()
    dtype = tensors[0].dtype
    if lib is None or dtype not in _SUFFIX:
        return None
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    return getattr(lib, f"{name}_{_SUFFIX[dtype]}")


def _rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of ``t`` seen as rows of its last dimension, or None where its leading
    dimensions do not step by one stride (the last dimension must be contiguous)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    n = t.shape[-1]
    rows = t.numel() // n if n else 0
    if t.is_contiguous():
        return rows, n
    lead = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True) if size != 1]
    if len(lead) == 1:  # one dimension of rows, any stride (a slice of a wider product)
        return rows, lead[0][1]
    return None


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
                    loops = "AVX-512" if _lib.kernels_avx512() else "portable loops"
                    _status = f"built: {path} ({loops})"
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


def _flags() -> list[str]:
    """The compiler flags: ``FLAGS``, then ``$AGENTBOLT_KERNEL_CFLAGS`` (say ``-mno-avx512f`` for
    the portable loops only, or a ``-march`` for another CPU)."""
    return [*FLAGS, *shlex.split(os.environ.get("AGENTBOLT_KERNEL_CFLAGS", ""))]


def _build() -> Path:
    cc = _compiler()
    flags = _flags()
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"the C compiler {cc[0]!r} did not run: {exc}") from exc
    key = hashlib.sha256()
    for part in (
        source,
        version.encode(),
        " ".join(flags).encode(),
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
            [*cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
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
    for name, (pointers, sizes, last_float) in _SIGNATURES.items():
        args = [pointer] * pointers + [size] * sizes + ([ctypes.c_float] if last_float else [])
        if name == "rope_append":
            args += [pointer] * 5 + [size] * 11
        elif name == "row_stats":
            args += [pointer] * 3
        for suffix in _SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes = args
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
