"""The kernel tests' tolerances can fail: per op family, a 5% error (a weight or a softmax scale
off by 5%, passed to the real kernel) fails the same ``assert_close`` call, with the same shapes,
dtype and ``reduce_dim``, that the unperturbed kernel passes (tests/utils.py REL_RMS).

fp16 and bf16 only: fp32's bounds are tighter still. Shapes and seeds mirror the kernel tests
(test_gemm, test_moe, test_norm, test_activation, test_rope, test_attention, test_mla).
"""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_mul
from kernels.attention import decode_attention, prefill_attention
from kernels.gemm import gemm
from kernels.mla import mla_decode, mla_prefill_attention
from kernels.moe import fused_moe, softmax_topk
from kernels.norm import rmsnorm
from kernels.reference import (
    decode_attention_reference,
    fused_moe_reference,
    gemm_reference,
    mla_decode_reference,
    prefill_attention_reference,
    rmsnorm_reference,
    rope_reference,
    silu_mul_reference,
)
from kernels.rope import build_rope_cache, rope
from tests.kernels.test_attention import SMALL_TILES, f64, make_paged
from tests.kernels.test_mla import make_decode_inputs, mla_prefill_reference
from tests.kernels.test_moe import moe_rel_rms
from tests.utils import assert_close

DTYPES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]
OFF = 1.05  # the 5% error


def _scaled(t: torch.Tensor, factor: float = OFF) -> torch.Tensor:
    return (t.float() * factor).to(t.dtype)


def _passes_then_fails(check, good: torch.Tensor, bad: torch.Tensor) -> None:
    check(good)
    with pytest.raises(AssertionError):
        check(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gemm_tolerance_catches_a_5pct_weight_error(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 256, generator=gen).to(dtype)
    w = (torch.randn(96, 256, generator=gen) / 16).to(dtype)
    expected = gemm_reference(x.double(), w.double())
    _passes_then_fails(lambda out: assert_close(out, expected, dtype, reduce_dim=256),
                       gemm(x, w), gemm(x, _scaled(w)))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("where", ["w2", "routing_weights"])
def test_moe_tolerance_catches_a_5pct_weight_error(dtype, where):
    gen = torch.Generator().manual_seed(508)
    num_experts, hidden, inter = 8, 32, 16
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = softmax_topk(torch.randn(5, num_experts, generator=gen), 2, True)
    expected = fused_moe_reference(x.double(), w13.double(), w2.double(), weights.double(), ids)
    bad = (fused_moe(x, w13, _scaled(w2), weights, ids) if where == "w2"
           else fused_moe(x, w13, w2, weights * OFF, ids))
    _passes_then_fails(
        lambda out: assert_close(out, expected, dtype, reduce_dim=hidden,
                                 rel_rms=moe_rel_rms(dtype)),
        fused_moe(x, w13, w2, weights, ids), bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rmsnorm_tolerance_catches_a_5pct_weight_error(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 145, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(145, generator=gen)).to(dtype)
    expected = rmsnorm_reference(x.double(), weight.double(), 1e-6)
    _passes_then_fails(lambda out: assert_close(out, expected, dtype),
                       rmsnorm(x, weight, 1e-6), rmsnorm(x, _scaled(weight), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul_tolerance_catches_a_5pct_error(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 80, generator=gen).to(dtype)
    expected = silu_mul_reference(x.double())
    up_off = torch.cat([x[:, :40], _scaled(x[:, 40:])], dim=1)  # the up projection 5% off
    _passes_then_fails(lambda out: assert_close(out, expected, dtype), silu_mul(x),
                       silu_mul(up_off))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rope_tolerance_catches_a_5pct_cache_error(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 64, generator=gen).to(dtype)
    k = torch.randn(3, 8, 64, generator=gen).to(dtype)
    cache = build_rope_cache(64, 257, 10000.0)
    positions = torch.randint(0, 257, (3,), generator=gen)
    expected, _ = rope_reference(q.double(), k.double(), positions, cache.double(), True)
    _passes_then_fails(lambda out: assert_close(out, expected, dtype),
                       rope(q, k, positions, cache, True)[0],
                       rope(q, k, positions, cache * OFF, True)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_attention_tolerance_catches_a_5pct_scale_error(dtype):
    q_lens, ctx_lens, head_dim = [5, 33, 1], [5, 50, 19], 32
    k_cache, v_cache, tables, gen = make_paged(ctx_lens, 2, head_dim, 16, dtype, seed=2)
    q = torch.randn(sum(q_lens), 4, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, 5, 38, 39], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = prefill_attention_reference(*f64(q, k_cache, v_cache), tables, cu, ctx, scale)

    def run(s: float) -> torch.Tensor:
        return prefill_attention(q, k_cache, v_cache, tables, cu, ctx, s, max_q_len=33,
                                 config=SMALL_TILES)

    _passes_then_fails(lambda out: assert_close(out, expected, dtype, reduce_dim=max(ctx_lens)),
                       run(scale), run(scale * OFF))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_decode_attention_tolerance_catches_a_5pct_scale_error(dtype):
    lens = [77, 0, 1, 33]
    k_cache, v_cache, tables, gen = make_paged(lens, 2, 32, 8, dtype, seed=4)
    q = torch.randn(4, 4, 32, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = decode_attention_reference(*f64(q, k_cache, v_cache), tables, seq_lens, 0.2)

    def run(s: float) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, tables, seq_lens, s, max_seq_len=80,
                                split_size=32)

    _passes_then_fails(lambda out: assert_close(out, expected, dtype, reduce_dim=max(lens)),
                       run(0.2), run(0.2 * OFF))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_mla_decode_tolerance_catches_a_5pct_scale_error(dtype):
    seq_lens, latent_dim, rope_dim, block_size = [40, 0, 64, 17], 32, 16, 16
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, 4, latent_dim, rope_dim, block_size, 5, dtype)
    scale = (latent_dim + rope_dim) ** -0.5
    expected = mla_decode_reference(q_latent.double(), q_pe.double(), cache.double(), tables,
                                    lens, scale)

    def run(s: float) -> torch.Tensor:
        return mla_decode(q_latent, q_pe, cache, tables, lens, s, max_seq_len=80,
                          split_size=16)

    _passes_then_fails(
        lambda out: assert_close(out, expected, dtype, reduce_dim=latent_dim + rope_dim),
        run(scale), run(scale * OFF))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_mla_prefill_tolerance_catches_a_5pct_scale_error(dtype):
    q_lens, k_lens, heads, qk_dim, v_dim = [5, 33, 1], [5, 70, 9], 4, 24, 16
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), heads, qk_dim, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), heads, qk_dim, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), heads, v_dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0, 5, 38, 39], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 75, 84], dtype=torch.int32)
    scale = qk_dim**-0.5
    expected = mla_prefill_reference(q.double(), k.double(), v.double(), cu_q, cu_k, scale)

    def run(s: float) -> torch.Tensor:
        return mla_prefill_attention(q, k, v, cu_q, cu_k, s, max_q_len=33)

    _passes_then_fails(lambda out: assert_close(out, expected, dtype, reduce_dim=qk_dim),
                       run(scale), run(scale * OFF))
