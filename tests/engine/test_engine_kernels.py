"""The engine's C kernel for a decode step's attention: built with the system's compiler, as exact
as a float64 reference allows, used by the engine's own forward, and never required."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import chat_body, make_engine, teacher_forced_logprobs

from agentbolt.engine import kernels
from tests.conftest import need


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    need(kernels.available(), f"the engine's C kernel: {kernels.status()}")


def _case(B: int, KV: int, G: int, D: int, L: int, dtype: torch.dtype, mask_kind: str, seed: int = 0):
    """Queries, a cache view of L columns inside a buffer with spare room, and a 0/1 mask."""
    g = torch.Generator().manual_seed(seed)
    buf_k = (3 * torch.randn(B, KV, L + 13, D, generator=g)).to(dtype)
    buf_v = torch.randn(B, KV, L + 13, D, generator=g).to(dtype)
    q = (3 * torch.randn(B, KV, G, D, generator=g)).to(dtype)
    mask = torch.ones(B, L, dtype=torch.long)
    if mask_kind in ("padded", "empty row"):
        for b in range(B):
            mask[b, : (b * 5) % max(1, L // 2)] = 0  # left padding of several lengths
        mask[B - 1, L // 3 : L // 3 + 4 * (L > 8)] = (
            0  # padding mid-row (a shared prefix, then the row's own)
        )
    if mask_kind == "empty row":
        mask[0] = 0
    return q, buf_k[:, :, :L], buf_v[:, :, :L], mask


def _reference(q, k, v, mask, scale) -> torch.Tensor:
    """float64 attention; a row with no token gets zeros."""
    scores = torch.einsum("bhgd,bhld->bhgl", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("bhgl,bhld->bhgd", weights, v.double())


@pytest.mark.parametrize("mask_kind", ["full", "padded", "empty row"])
@pytest.mark.parametrize(("KV", "G", "D"), [(3, 3, 64), (4, 1, 32), (2, 4, 128), (1, 5, 40)])
def test_float32_matches_a_float64_reference(KV: int, G: int, D: int, mask_kind: str) -> None:
    q, k, v, mask = _case(6, KV, G, D, 37, torch.float32, mask_kind)
    got = kernels.decode_attention(q, k, v, mask, D**-0.5)
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    want = _reference(q, k, v, mask, D**-0.5)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (got.double() - want).abs().max()
    if mask_kind == "empty row":
        assert not got[0].any()


@pytest.mark.parametrize("mask_kind", ["full", "padded"])
@pytest.mark.parametrize("L", [1, 44, 300])
def test_bfloat16_is_the_reference_rounded_and_no_further_than_the_flash_kernel(
    L: int, mask_kind: str
) -> None:
    q, k, v, mask = _case(32, 3, 3, 64, L, torch.bfloat16, mask_kind)
    if mask_kind == "padded":
        mask[:, -1] = 1  # a decode step's own column always holds its token
    got = kernels.decode_attention(q, k, v, mask, 0.125)
    assert got is not None and got.dtype == torch.bfloat16
    want = _reference(q, k, v, mask, 0.125)
    flash = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :], scale=0.125)
    err, flash_err = (got.double() - want).abs(), (flash.double() - want).abs()
    assert err.max() <= flash_err.max() and err.mean() <= flash_err.mean(), (err.max(), flash_err.max())
    # float32 throughout, rounded once: nearly every element is the float64 result rounded
    assert (got == want.to(torch.bfloat16)).double().mean() > 0.999


def test_any_row_and_head_strides_are_read_in_place() -> None:
    """Rows that share one prefix (a broadcast view: row stride 0) and a transposed buffer."""
    q, k, v, mask = _case(1, 3, 3, 64, 20, torch.float32, "full")
    k4, v4 = k.expand(4, -1, -1, -1), v.expand(4, -1, -1, -1)
    q4 = torch.randn(4, 3, 3, 64)
    got = kernels.decode_attention(q4, k4, v4, mask.expand(4, -1), 0.125)
    assert got is not None
    assert torch.allclose(got.double(), _reference(q4, k4, v4, mask.expand(4, -1), 0.125), atol=2e-6)
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads strided inside each column
    assert k_t.stride() != k.stride()
    assert torch.equal(
        kernels.decode_attention(q, k_t, v, mask, 0.125), kernels.decode_attention(q, k, v, mask, 0.125)
    )


def test_what_it_does_not_take_is_left_to_pytorch() -> None:
    q, k, v, mask = _case(2, 3, 3, 64, 10, torch.float32, "full")
    assert kernels.decode_attention(q.half(), k.half(), v.half(), mask, 0.125) is None  # float16
    assert kernels.decode_attention(q, k.double(), v, mask, 0.125) is None  # mixed dtypes
    assert kernels.decode_attention(q, k[:, :, :5], v, mask, 0.125) is None  # shapes disagree
    assert kernels.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, mask, 0.125) is None
    too_many_heads = torch.randn(2, 1, 17, 64)
    assert kernels.decode_attention(too_many_heads, k[:, :1], v[:, :1], mask, 0.125) is None


def test_a_missing_compiler_or_the_switch_leaves_pytorch_attention(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setenv("AGENTBOLT_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not kernels.available()
    assert "no C compiler" in kernels.status() and "no-such-compiler-here" in kernels.status()
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())
    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setenv("AGENTBOLT_KERNELS", "0")
    assert not kernels.available() and "AGENTBOLT_KERNELS=0" in kernels.status()


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "kernels.c"
    broken.write_text("int kernels_abi(void) { return 1 }\n")  # a missing semicolon
    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "SOURCE", broken)
    monkeypatch.setenv("AGENTBOLT_CACHE", str(tmp_path))
    assert not kernels.available()
    assert kernels.status().startswith("building kernels.c failed") and "error" in kernels.status()
    assert list((tmp_path / "kernels").iterdir()) == []  # no half-written library left behind


def test_the_build_is_cached_and_replaced_atomically(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTBOLT_CACHE", str(tmp_path))
    first = kernels._build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert kernels._build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]


async def test_the_engine_serves_through_the_kernel_with_exact_logprobs(tiny_dir: Path) -> None:
    """float32: the logprobs the engine returns (kernel attention in every decode step) equal a
    teacher-forced pass to 1e-4; with kernels=False the engine uses PyTorch's attention."""
    with make_engine(tiny_dir) as engine:
        assert engine.stats()["attention"] == "kernel" and engine.stats()["attention_note"] == ""
        bodies = [
            chat_body(f"Tell me story {i}.", max_tokens=12, logprobs=True, ignore_eos=True) for i in range(5)
        ]
        responses = await asyncio.gather(*[engine.chat(b) for b in bodies])
        for response in responses:
            choice = response["choices"][0]
            returned = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
            expected = teacher_forced_logprobs(
                engine.model, response["prompt_token_ids"], choice["token_ids"]
            )
            assert (returned - expected).abs().max() < 1e-4
    with make_engine(tiny_dir, kernels=False) as engine:
        stats = engine.stats()
        assert stats["attention"] == "torch" and "switched off" in stats["attention_note"]
    with make_engine(tiny_dir, forward="transformers") as engine:
        assert engine.stats()["attention"] == "torch"
        assert engine.stats()["attention_note"] == "transformers' forward serves"
