"""Path invariance of the kernels: a token's row has the same bits whether a decode step or a
prefill chunk computes it.

- attention: prefill with the decode's split size (and the policy's tiles: a 64- or 128-row
  query tile against decode's 16-row head tile) gives each query row exactly the decode
  kernel's output for that query at that position, whatever the chunking and the other
  sequences of the prefill step; without the split size (one split a row), or with another KV
  tile, the rows differ (negative controls);
- GEMM: under ``OpsConfig.gemm_mode`` a row has the same bits at the decode's M and at a
  prefill's (corun's own policy may split K by M: negative control at a real shape, GPU).

Runs in the interpreter (CI) and natively on a GPU, where it checks that the MMA gives a row the
same bits in a 16-row and a 128-row tile (the kernels' premise); ``test_real_shape_on_gpu`` does
so at Qwen3-8B's attention shape.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.attention import (
    PrefillAttentionConfig,
    decode_attention,
    decode_block_n,
    prefill_attention,
    prefill_attention_config,
)
from kernels.gemm import gemm
from kernels.mode import Mode
from models.forward_batch import OpsConfig
from tests.utils import assert_bitwise_equal

BLOCK_SIZE = 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _prompt(seed: int, length: int, num_kv_heads: int, group: int, head_dim: int,
            dtype: torch.dtype, block_size: int = BLOCK_SIZE):
    """q, and a cache holding the prompt's K/V in shuffled blocks (junk elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    num_blocks = -(-length // block_size)
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks + 2, generator=gen)[:num_blocks].to(torch.int32)
    return q, k_cache, v_cache, table.view(1, -1)


def _prefill(q, k_cache, v_cache, table, chunk, split_size, config=None):
    """The prompt prefilled in chunks of ``chunk`` tokens (its K/V already cached)."""
    outs = []
    for start in range(0, q.shape[0], chunk):
        end = min(start + chunk, q.shape[0])
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        ctx = torch.tensor([end], dtype=torch.int32)
        outs.append(prefill_attention(q[start:end], k_cache, v_cache, table, cu, ctx, 0.125,
                                      max_q_len=end - start, mode=Mode.CORUN,
                                      split_size=split_size, config=config))
    return torch.cat(outs)


def _decode_each(q, k_cache, v_cache, table, split_size, positions):
    """Each listed position's query decoded alone over its own prefix (one batch)."""
    positions = torch.tensor(positions)
    return decode_attention(q[positions], k_cache, v_cache,
                            table.expand(len(positions), -1).contiguous(),
                            (positions + 1).to(torch.int32), 0.125,
                            max_seq_len=q.shape[0], mode=Mode.CORUN, split_size=split_size)


@settings(max_examples=4)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 100),
    chunk=st.sampled_from([16, 48, 64, 150]),
    split_size=st.sampled_from([16, 32, 64]),
    group=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(DTYPES),
)
@example(seed=3, length=150, chunk=64, split_size=32, group=4, dtype=torch.bfloat16)
@example(seed=4, length=97, chunk=48, split_size=16, group=2, dtype=torch.float32)
def test_prefill_row_equals_its_decode(seed, length, chunk, split_size, group, dtype):
    """Every prompt row, prefilled in chunks with the policy's tiles, equals its decode."""
    q, k_cache, v_cache, table = _prompt(seed, length, 2, group, 16, dtype)
    prefilled = _prefill(q, k_cache, v_cache, table, chunk, split_size)
    decoded = _decode_each(q, k_cache, v_cache, table, split_size, list(range(length)))
    assert_bitwise_equal(prefilled, decoded, f"prefill vs decode, split {split_size}")


@settings(max_examples=1)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=1)
def test_prefill_without_the_split_size_differs(seed):
    """Negative control: a prefill that runs each row as one split (``split_size`` None, the
    default mode's) gives rows past the first split other bits than their decode."""
    length, split_size = 100, 32
    q, k_cache, v_cache, table = _prompt(seed, length, 2, 2, 16, torch.float32)
    config = prefill_attention_config(16, torch.float32, Mode.CORUN, split_size)
    one_split = _prefill(q, k_cache, v_cache, table, length, None, config)
    decoded = _decode_each(q, k_cache, v_cache, table, split_size, list(range(length)))
    assert torch.equal(one_split[:split_size], decoded[:split_size])  # one split either way
    assert not torch.equal(one_split[split_size:], decoded[split_size:])


@settings(max_examples=1)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=2)
def test_prefill_with_another_kv_tile_differs(seed):
    """Negative control: the decode's splits walked in KV tiles of another width (16 where the
    decode takes 32) change the bits: the check sees the tile steps."""
    length, split_size = 80, 32
    q, k_cache, v_cache, table = _prompt(seed, length, 2, 2, 16, torch.float32)
    assert decode_block_n(split_size) == 32
    other = PrefillAttentionConfig(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=1)
    prefilled = _prefill(q, k_cache, v_cache, table, length, split_size, other)
    decoded = _decode_each(q, k_cache, v_cache, table, split_size, list(range(length)))
    assert not torch.equal(prefilled, decoded)


def test_prefill_rejects_a_split_size_its_tile_does_not_divide():
    q, k_cache, v_cache, table = _prompt(0, 20, 1, 1, 16, torch.float32)
    config = PrefillAttentionConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="split_size"):
        _prefill(q, k_cache, v_cache, table, 20, 48, config)


@given(seed=st.integers(0, 2**32 - 1), decode_m=st.integers(1, 64),
       dtype=st.sampled_from(DTYPES))
@example(seed=0, decode_m=1, dtype=torch.bfloat16)
def test_gemm_row_same_at_decode_and_prefill_m(seed, decode_m, dtype):
    """Under path invariance corun's GEMMs run ``gemm_mode``: a row has the same bits in a
    decode-sized product and in a prefill-sized one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(192, 96, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    mode = OpsConfig(Mode.CORUN, backend="triton").gemm_mode
    prefill = gemm(x, w, mode=mode)
    decode = gemm(x[:decode_m], w, mode=mode)
    assert_bitwise_equal(decode, prefill[:decode_m], f"rows at M {decode_m} vs 192")


def test_gemm_mode_follows_path_invariance():
    assert OpsConfig(Mode.CORUN).gemm_mode is Mode.BATCH_INVARIANT_TUNED
    assert OpsConfig(Mode.CORUN, path_invariant=False).gemm_mode is Mode.CORUN
    assert OpsConfig(Mode.DEFAULT).gemm_mode is Mode.DEFAULT
    assert not OpsConfig(Mode.DEFAULT).is_path_invariant
    assert OpsConfig(Mode.BATCH_INVARIANT).prefill_split_size == 256
    assert OpsConfig(Mode.BATCH_INVARIANT, path_invariant=False).prefill_split_size is None


@pytest.mark.gpu
def test_real_shape_on_gpu():
    """Qwen3-8B's attention (32 q heads, 8 kv heads, head_dim 128, bf16, split 512, pages of 16):
    a 3000-token prompt prefilled in chunks of 256 with the policy's tiles (128-row query tiles
    on 8 warps) against the decode of every 7th position (16-row head tiles)."""
    if not torch.cuda.is_available():
        pytest.skip("Qwen3-8B's bf16 shapes and the GPU's MMA need a GPU")
    q, k_cache, v_cache, table = _prompt(11, 3000, 8, 4, 128, torch.bfloat16, block_size=16)
    q, k_cache, v_cache, table = (t.cuda() for t in (q, k_cache, v_cache, table))
    prefilled = _prefill(q, k_cache, v_cache, table, 256, 512)
    positions = list(range(0, 3000, 7)) + [511, 512, 2999]
    decoded = _decode_each(q, k_cache, v_cache, table, 512, positions)
    assert_bitwise_equal(prefilled[torch.tensor(positions, device="cuda")], decoded,
                         "Qwen3-8B shape, prefill vs decode")
