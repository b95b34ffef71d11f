"""The engine's C kernel for a decode step's attention: built with the system's compiler, as exact
as a float64 reference allows, used by the engine's own forward, and never required."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import chat_body, make_engine, max_logprob_error

from agentbolt.engine import kernels
from tests.conftest import need


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    need(kernels.available(), f"the engine's C kernel: {kernels.status()}")


@pytest.fixture(scope="module")
def portable_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("portable-kernels")


@pytest.fixture(params=["native", "portable"])
def build(request: pytest.FixtureRequest, portable_cache: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernels as built here (-march=native), and as built without AVX-512 (the loops a CPU
    without it runs, e.g. AVX2 only): both must give the same numbers."""
    if request.param == "portable":
        monkeypatch.setattr(kernels, "_status", None)
        monkeypatch.setattr(kernels, "_lib", None)
        monkeypatch.setenv("AGENTBOLT_CACHE", str(portable_cache))
        monkeypatch.setenv("AGENTBOLT_KERNEL_CFLAGS", "-mno-avx512f")
        assert kernels.available() and kernels.status().endswith("(portable loops)"), kernels.status()
    elif "avx512f" in Path("/proc/cpuinfo").read_text():
        assert kernels.status().endswith("(AVX-512)"), kernels.status()
    return request.param


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
def test_float32_matches_a_float64_reference(KV: int, G: int, D: int, mask_kind: str, build: str) -> None:
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
    L: int, mask_kind: str, build: str
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


def test_any_row_and_head_strides_are_read_in_place(build: str) -> None:
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
    assert kernels.decode_attention(q[:, 0], k, v, mask, 0.125) is None  # not rows x heads x queries x dims
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
        assert max_logprob_error(engine.model, responses) < 1e-4
    with make_engine(tiny_dir, kernels=False) as engine:
        stats = engine.stats()
        assert stats["attention"] == "torch" and "switched off" in stats["attention_note"]
    with make_engine(tiny_dir, forward="transformers") as engine:
        assert engine.stats()["attention"] == "torch"
        assert engine.stats()["attention_note"] == "transformers' forward serves"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_layer_kernels_give_pytorchs_numbers(dtype: torch.dtype, build: str) -> None:
    """RMSNorm with the residual add and RoPE with the cache write: the same bits as the engine's
    PyTorch ops (bfloat16: each step rounded where PyTorch's ops round; the norm's sum of squares
    in another order); SiLU times up within an ulp (its own exp)."""
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 1, 96, generator=g).to(dtype), torch.randn(5, 1, 96, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    want_x = x + res
    normed = F.rms_norm(want_x.float(), (96,), eps=1e-5)
    want_h = F.rms_norm(want_x, (96,), weight, 1e-5) if dtype == torch.float32 else weight * normed.to(dtype)
    got_x = x.clone()
    got_h = kernels.add_rms_norm(got_x, res, weight, 1e-5)
    assert got_h is not None and torch.equal(got_x, want_x)
    assert torch.allclose(
        got_h.float(), want_h.float(), atol=0, rtol=1e-6
    )  # the sum of squares' order differs
    assert torch.equal(kernels.add_rms_norm(want_x[:, -1:], None, weight, 1e-5), got_h)
    # gate and up as slices of one product (rows strided), with a tail past the vector width
    gate_up = (3 * torch.randn(4, 1, 2 * 70, generator=g)).to(dtype)
    gate, up = gate_up.split(70, dim=-1)
    got, want = kernels.silu_mul(gate, up), F.silu(gate) * up  # its own exp: within an ulp of PyTorch's
    assert got is not None and torch.allclose(
        got.float(), want.float(), atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 2e-6
    )
    assert (got == want).double().mean() > (0.99 if dtype == torch.bfloat16 else 0.5)
    # one decode step's RoPE for 9 query and 3 key-value heads of 64 dims, into cache column 5
    B, H, KV, D = 4, 9, 3, 64
    qkv = (3 * torch.randn(B, 1, (H + 2 * KV) * D, generator=g)).to(dtype)
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    angle = 6 * torch.rand(B, D, generator=g)
    cos, sin = angle.cos().to(dtype), torch.cat([-angle[:, :32].sin(), angle[:, 32:].sin()], -1).to(dtype)
    buf_k, buf_v = torch.zeros(B, KV, 9, D, dtype=dtype), torch.zeros(B, KV, 9, D, dtype=dtype)
    q_rot = kernels.rope_append(q, k, v, cos, sin, buf_k, buf_v, 5, D)

    def rope(t: torch.Tensor, heads: int) -> torch.Tensor:
        t = t.view(B, heads, D)
        return t * cos[:, None] + t.roll(32, -1) * sin[:, None]

    assert q_rot is not None and torch.equal(q_rot, rope(q, H))
    assert torch.equal(buf_k[:, :, 5], rope(k, KV)) and torch.equal(buf_v[:, :, 5], v.view(B, KV, D))
    assert not buf_k[:, :, :5].any() and not buf_k[:, :, 6:].any()  # only that column written
    assert kernels.rope_append(q, k, v, cos, sin, buf_k, buf_v, 9, D) is None  # past the buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_step_statistics_give_the_same_tokens_and_logprobs(dtype: torch.dtype, build: str) -> None:
    from agentbolt.engine.sampling import SamplingParams, sample_step

    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(6, 1000, generator=g)).to(dtype)
    logits[2, 7] = logits[2, 900] = logits[2].max() + 1  # a tie: the first column wins
    params = [SamplingParams(temperature=0.0, top_logprobs=4) for _ in range(6)]
    params[4] = SamplingParams(temperature=0.8, seed=11, top_logprobs=4)  # a sampled row among them
    plain = sample_step(logits, params, [p.make_generator() for p in params], 4)
    fast = sample_step(logits, params, [p.make_generator() for p in params], 4, fast=True)
    assert fast.token_ids == plain.token_ids and fast.token_ids[2] == 7
    assert fast.top_ids == plain.top_ids
    assert max(abs(a - b) for a, b in zip(fast.logprobs, plain.logprobs, strict=True)) < 5e-6
    every = [SamplingParams(temperature=1.0, seed=i) for i in range(6)]  # rollouts: all rows sampled
    plain = sample_step(logits, every, [p.make_generator() for p in every])
    fast = sample_step(logits, every, [p.make_generator() for p in every], fast=True)
    assert fast.token_ids == plain.token_ids
    assert max(abs(a - b) for a, b in zip(fast.logprobs, plain.logprobs, strict=True)) < 5e-6
    stats = kernels.row_stats(logits)
    assert stats is not None and torch.equal(stats[1], logits.float().argmax(-1))
    want = torch.logsumexp(logits.float() - logits.float().amax(-1, keepdim=True), -1)
    assert torch.allclose(stats[2], want, atol=1e-6)
    # a vocabulary's width with one dominant logit: tens of thousands of terms far below an ulp
    # of the sum, which a float32 running sum rounds away (2e-4 nats low, on an AVX2-only build)
    wide = torch.full((1, 49152), -12.0)
    wide[0, 0] = 0.0
    wide_stats = kernels.row_stats(wide.to(dtype))
    assert wide_stats is not None
    exact = torch.logsumexp(wide.to(dtype).double(), -1).float()
    assert torch.allclose(wide_stats[2], exact, atol=1e-6), (wide_stats[2] - exact).abs().max()
    logits[3, 5] = float("nan")
    assert kernels.row_stats(logits) is None  # PyTorch's rules for NaN, then
    assert sample_step(logits, params, [p.make_generator() for p in params], 0, fast=True).token_ids[3] == 5
