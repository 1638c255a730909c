"""Correctness of paged attention (store_kv, prefill, decode) against the fp64 references.

Small shapes for the Triton interpreter. bf16 runs too: under the interpreter its tl.dot operands
are upcast to fp32 (kernels.utils.upcast_dot_operands), so what it checks here is the loads,
stores, masking and casts; native bf16 dots are checked on the H200.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import attention as attention_module
from kernels.attention import (
    DECODE_TARGET_PROGRAMS,
    PrefillAttentionConfig,
    decode_attention,
    decode_attention_config,
    decode_lanes,
    decode_preloaded_pages,
    prefill_attention,
    prefill_attention_config,
)
from kernels.kv_store import store_kv
from kernels.mode import Mode
from kernels.reference import (
    decode_attention_reference,
    prefill_attention_reference,
    store_kv_reference,
)
from tests.utils import LaunchSpy, assert_bitwise_equal, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMALL_TILES = PrefillAttentionConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)

# Launchers check tensor *contents* only for CPU tensors: on a GPU that would sync with the host
# on every call and break CUDA-graph capture.
VALUE_CHECKS_CPU_ONLY = pytest.mark.interpreter_only(
    reason="value checks read tensor contents, which launchers do only for CPU tensors")


def make_paged(lens, num_kv_heads, head_dim, block_size, dtype, seed, spare_blocks=3):
    """Random caches with each sequence's blocks scattered (shuffled, non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    width = max(1, max(blocks_per_seq))
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros((len(lens), width), dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = perm[used : used + count]
        used += count
    return k_cache, v_cache, tables, gen


def f64(*tensors):
    return [t.to(torch.float64) for t in tensors]


# ----------------------------------------------------------------------------------------------
# store_kv
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_reference_and_skips_padding(dtype):
    k_cache, v_cache, _, gen = make_paged([40], 2, 32, 8, dtype, seed=1)
    qkv = torch.randn(6, 4 + 2 + 2, 32, generator=gen).to(dtype)  # fused qkv: k, v are views
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 17, 40, -1, 9], dtype=torch.int64)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert_bitwise_equal(k_cache, expected_k, "k_cache")
    assert_bitwise_equal(v_cache, expected_v, "v_cache")


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize(
    "q_lens,ctx_lens,block_size,head_dim",
    [([37], [37], 8, 16), ([5, 33, 1], [5, 50, 19], 16, 32)],
    ids=["one-seq-odd", "chunked-with-context"],
)
def test_prefill_attention_matches_reference(dtype, group, q_lens, ctx_lens, block_size, head_dim):
    num_kv_heads = 2
    k_cache, v_cache, tables, gen = make_paged(ctx_lens, num_kv_heads, head_dim, block_size,
                                               dtype, seed=2)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale, max_q_len=max(q_lens),
                            config=SMALL_TILES)
    expected = prefill_attention_reference(*f64(q, k_cache, v_cache), tables, cu, ctx, scale)
    assert out.dtype == dtype
    assert_close(out, expected, dtype, reduce_dim=max(ctx_lens))


def test_prefill_attention_policy_config_fp16():
    """The production tiles (BLOCK_M 128, BLOCK_N 64) on a prompt spanning several KV tiles."""
    lens = [150]
    k_cache, v_cache, tables, gen = make_paged(lens, 1, 16, 16, torch.float16, seed=3)
    q = torch.randn(150, 2, 16, generator=gen).to(torch.float16)
    cu, ctx = torch.tensor([0, 150], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    assert prefill_attention_config(16, torch.float16, Mode.CORUN).BLOCK_N == 64
    out = prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25, max_q_len=150)
    expected = prefill_attention_reference(*f64(q, k_cache, v_cache), tables, cu, ctx, 0.25)
    assert_close(out, expected, torch.float16, reduce_dim=150)


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda g: f"gqa{g}")
# batch_invariant runs corun's policy (fixed split size); the invariance tests cover it.
@pytest.mark.parametrize("mode", [Mode.CORUN, Mode.DEFAULT], ids=str)
def test_decode_attention_matches_reference(dtype, group, mode):
    lens = [77, 0, 1, 33]  # odd lengths, a dummy slot, a single token
    k_cache, v_cache, tables, gen = make_paged(lens, 2, 32, 8, dtype, seed=4)
    q = torch.randn(len(lens), 2 * group, 32, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, max_seq_len=80,
                           mode=mode, split_size=32)
    expected = decode_attention_reference(*f64(q, k_cache, v_cache), tables, seq_lens, 0.2)
    assert out.dtype == dtype
    assert_close(out, expected, dtype, reduce_dim=max(lens))
    assert torch.equal(out[1], torch.zeros_like(out[1])), "seq_len 0 must give zeros"


def test_decode_attention_config_policies():
    """corun/batch_invariant splits follow split_size only; default follows the batch's max."""
    for mode in (Mode.CORUN, Mode.BATCH_INVARIANT):
        small = decode_attention_config(1, 32, 8, 128, 4096, torch.bfloat16, mode)
        large = decode_attention_config(128, 32, 8, 128, 32768, torch.bfloat16, mode)
        assert small.split_size == large.split_size == 256
        assert large.max_num_splits == 128 and large.BLOCK_H == 16
    short = decode_attention_config(8, 32, 8, 128, 1024, torch.bfloat16, Mode.DEFAULT)
    long = decode_attention_config(8, 32, 8, 128, 32768, torch.bfloat16, Mode.DEFAULT)
    assert short.split_size != long.split_size
    assert long.split_size % long.BLOCK_N == 0 and long.max_num_splits <= 64


def test_decode_lanes_fill_the_target_without_exceeding_the_splits():
    """The fixed-split policies' lanes: about target / (B x kv heads) per sequence and kv head,
    at least 1, never more than the splits (a lane past the splits would only exit)."""
    assert decode_lanes(128, 8, 264) == 33  # B 1, Qwen3-8B's kv heads, 32k context
    assert decode_lanes(16, 64, 264) == 5  # B 8
    assert decode_lanes(2, 8, 264) == 2  # capped by the splits
    assert decode_lanes(128, 1024, 264) == 1  # B 128: one lane walks every split
    assert decode_lanes(0, 0, 264) == 1
    cfg = decode_attention_config(8, 32, 8, 128, 4096, torch.bfloat16, Mode.CORUN)
    assert cfg.num_split_programs == decode_lanes(16, 64, DECODE_TARGET_PROGRAMS) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lanes", [1, 2, 8], ids=lambda n: f"lanes{n}")
def test_decode_attention_fused_combine_equals_two_launches(dtype, lanes):
    """The split launch's fused combine (the last lane of each sequence and kv head combines)
    gives the two-launch path's bits, with fewer lanes than splits, as many, or more; one-split
    sequences and dummy slots included. The arrival counts are left at zero, so a held buffer
    serves the next call."""
    lens = [150, 0, 16, 17, 64, 3]
    k_cache, v_cache, tables, gen = make_paged(lens, 2, 32, 8, dtype, seed=6)
    q = torch.randn(len(lens), 8, 32, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    base = dataclasses.replace(
        decode_attention_config(len(lens), 8, 2, 32, 160, dtype, Mode.CORUN, split_size=16),
        num_split_programs=lanes)
    assert base.max_num_splits == 10 and not base.fused_combine
    args = (q, k_cache, v_cache, tables, seq_lens, 0.2)
    two = decode_attention(*args, max_seq_len=160, config=base)
    arrivals = torch.zeros(len(lens) * 2 + 3, dtype=torch.int32)  # longer than needed: fine
    fused_cfg = dataclasses.replace(base, fused_combine=True)
    for _ in range(2):  # the second call reuses the counts the first left at zero
        fused = decode_attention(*args, max_seq_len=160, config=fused_cfg, arrivals=arrivals)
        assert_bitwise_equal(fused, two)
        assert not arrivals.any()
    assert_bitwise_equal(decode_attention(*args, max_seq_len=160, config=fused_cfg), two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_attention_lanes_walking_several_splits_keep_the_bits(dtype):
    """Fewer lanes than splits (a lane walks a run of splits and restarts its softmax state at
    each split boundary) give the reference's result and the bits of one lane per split. The
    other decode tests run at shapes where the policy gives every split its own lane."""
    lens = [150, 0, 16, 17, 64, 3]
    k_cache, v_cache, tables, gen = make_paged(lens, 2, 32, 8, dtype, seed=9)
    q = torch.randn(len(lens), 8, 32, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    base = decode_attention_config(len(lens), 8, 2, 32, 160, dtype, Mode.CORUN, split_size=16)
    assert base.max_num_splits == base.num_split_programs == 10  # one lane per split
    args = (q, k_cache, v_cache, tables, seq_lens, 0.2)
    per_split = decode_attention(*args, max_seq_len=160, config=base)
    expected = decode_attention_reference(*f64(q, k_cache, v_cache), tables, seq_lens, 0.2)
    for lanes in (1, 3, 4, 7):
        out = decode_attention(*args, max_seq_len=160,
                               config=dataclasses.replace(base, num_split_programs=lanes))
        assert_close(out, expected, dtype, reduce_dim=max(lens))
        assert_bitwise_equal(out, per_split, f"{lanes} lanes vs one per split")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "mode,split_size,block_size,lanes,fused,pages",
    [(Mode.CORUN, 16, 8, None, False, 2),  # one lane a split: 2 whole pages
     (Mode.CORUN, 16, 8, 3, False, 8),  # runs of up to 4 splits: 64 tokens, 8 pages
     (Mode.CORUN, 16, 8, 3, True, 8),  # and the last lane combining
     # 48-token splits on 32-token pages, 3 lanes over 4 splits: lane 1's run starts at token 48,
     # inside a page (2 x 48 / 32 + 1 -> 4)
     (Mode.CORUN, 48, 32, 3, False, 4),
     (Mode.BATCH_INVARIANT, 32, 8, 2, False, 16),
     # default: 150 tokens in splits of 64 (one lane each), on 8-token pages
     (Mode.DEFAULT, 16, 8, None, False, 8)],
    ids=["corun", "corun-3-lanes", "corun-3-lanes-fused", "corun-mid-page", "batch-invariant",
         "default"],
)
def test_decode_attention_preloaded_block_ids_keep_the_bits(mode, split_size, block_size, lanes,
                                                            fused, pages, dtype, monkeypatch):
    """A lane's block ids loaded before its token loop and gathered per tile give the bits of
    loading them tile by tile: one-split and several-split sequences, a dummy slot, runs that
    start inside a page, tiles past a sequence's end, and the fused combine."""
    lens = [150, 0, 16, 17, 64, 3]
    k_cache, v_cache, tables, gen = make_paged(lens, 2, 32, block_size, dtype, seed=12)
    q = torch.randn(len(lens), 8, 32, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    max_seq_len = max(lens) if mode == Mode.DEFAULT else 192
    base = decode_attention_config(len(lens), 8, 2, 32, max_seq_len, dtype, mode,
                                   split_size=split_size)
    base = dataclasses.replace(base, num_split_programs=lanes or base.num_split_programs,
                               fused_combine=fused)
    spy = LaunchSpy(attention_module._decode_split_kernel, "LANE_PAGES")
    monkeypatch.setattr(attention_module, "_decode_split_kernel", spy)
    args = (q, k_cache, v_cache, tables, seq_lens, 0.2)
    outs = [decode_attention(*args, max_seq_len=max_seq_len,
                             config=dataclasses.replace(base, preload_pages=preload))
            for preload in (False, True)]
    assert spy.values == [0, pages]
    assert_bitwise_equal(outs[1], outs[0])
    expected = decode_attention_reference(*f64(q, k_cache, v_cache), tables, seq_lens, 0.2)
    assert_close(outs[1], expected, dtype, reduce_dim=max(lens))


def test_decode_preloaded_pages_cover_a_lane_and_fall_back_past_the_cap():
    def pages(batch, max_seq_len, block_size, preload=True, mode=Mode.CORUN, split_size=256):
        cfg = decode_attention_config(batch, 32, 8, 128, max_seq_len, torch.bfloat16, mode,
                                      split_size=split_size)
        return decode_preloaded_pages(dataclasses.replace(cfg, preload_pages=preload), block_size)

    assert pages(1, 4096, 16) == 16  # 16 lanes, one 256-token split each: 16 pages
    assert pages(1, 4096, 16, preload=False) == 0
    assert pages(8, 4096, 16) == 64  # 5 lanes over 16 splits: runs of up to 4 (1024 tokens)
    assert pages(8, 32768, 16) == 0  # 5 lanes over 128 splits: 26 splits, past the cap
    # 33 lanes over 86 splits of 48: runs of up to 3 (144 tokens: 9 pages, 10 from inside one)
    assert pages(1, 4096, 16, split_size=48) == 16
    # default: one split of cdiv(4096, 33) rounded up to 64 tokens (128) a lane, 8 pages
    assert pages(1, 4096, 16, mode=Mode.DEFAULT) == 8


def test_decode_attention_policy_preloads_where_the_ids_fit():
    """The fixed-split policies preload wherever a lane's ids fit, whatever the batch, at 3
    stages while the grid fits two programs an SM (264 on the H200's count); default never; the
    page size counts."""
    def policy(batch, max_seq_len, mode=Mode.CORUN, block_size=16):
        cfg = decode_attention_config(batch, 32, 8, 128, max_seq_len, torch.bfloat16, mode,
                                      block_size=block_size)
        return cfg.preload_pages, cfg.num_stages, batch * 8 * cfg.num_split_programs

    assert policy(1, 4096) == (True, 3, 128)
    assert policy(1, 32768) == (True, 3, 264)  # 33 lanes of up to 4 splits: 64 pages
    assert policy(8, 512) == (True, 3, 128)
    assert policy(8, 4096) == (True, 2, 320)  # 5 lanes: past two programs an SM
    assert policy(8, 4096, Mode.BATCH_INVARIANT) == (True, 2, 320)
    assert policy(8, 32768) == (False, 2, 320)  # 26 splits a lane: past the cap
    assert policy(1, 32768, block_size=8) == (False, 2, 264)  # 128 pages of 8 tokens
    assert policy(1, 4096, Mode.DEFAULT)[:2] == (False, 2)
    assert policy(32, 512) == (True, 2, 512)  # 2 lanes of one split: 16 pages
    assert policy(16, 512) == (True, 3, 256)
    assert policy(128, 4096)[:2] == (False, 2)  # one lane of 16 splits: 256 pages


def test_decode_attention_fused_combine_checks_arrivals():
    args = _decode_args()
    cfg = dataclasses.replace(decode_attention_config(2, 4, 2, 16, 24, torch.float32, Mode.CORUN,
                                                      split_size=16), fused_combine=True)
    for bad, message in ((torch.zeros(3, dtype=torch.int32), "arrivals: expected >= 4"),
                         (torch.zeros(4, dtype=torch.int64), "arrivals: expected dtype"),
                         (torch.zeros(4, dtype=torch.int32, device="meta"),
                          "arrivals: expected device")):
        with pytest.raises(ValueError, match=f"^{message}"):
            decode_attention(*args.values(), max_seq_len=24, config=cfg, arrivals=bad)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _decode_args(**overrides):
    k_cache, v_cache, tables, gen = make_paged([20, 9], 2, 16, 8, torch.float32, seed=5)
    args = dict(q=torch.randn(2, 4, 16, generator=gen), k_cache=k_cache, v_cache=v_cache,
                block_tables=tables, seq_lens=torch.tensor([20, 9], dtype=torch.int32), scale=0.3)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,name",
    [
        (dict(q=torch.randn(2, 3, 16)), "q"),  # 3 q heads over 2 kv heads
        (dict(q=torch.randn(2, 4, 32)), "k_cache"),  # head_dim mismatch
        (dict(q=torch.randn(2, 4, 16, dtype=torch.float16)), "k_cache"),  # dtype mismatch
        (dict(seq_lens=torch.tensor([20, 9], dtype=torch.int64)), "seq_lens"),
        (dict(seq_lens=torch.tensor([20, 25], dtype=torch.int32)), "seq_lens"),  # > max_seq_len
        (dict(block_tables=torch.tensor([[0, 1, 99], [2, 0, 0]], dtype=torch.int32)),
         "block_tables"),  # points past the cache
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables"),
    ],
    ids=["heads", "head_dim", "dtype", "lens-dtype", "lens-beyond-max", "table-past-cache",
         "table-dtype"],
)
def test_decode_attention_rejects_bad_input(overrides, name):
    args = _decode_args(**overrides)
    with pytest.raises(ValueError, match=f"^{name}:"):  # anchored: "q" is in most messages
        decode_attention(*args.values(), max_seq_len=24)


@VALUE_CHECKS_CPU_ONLY
def test_decode_attention_rejects_lengths_beyond_table():
    args = _decode_args(seq_lens=torch.tensor([20, 25], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^seq_lens: .*table capacity 24"):
        decode_attention(*args.values(), max_seq_len=64)  # tables hold 3 blocks of 8 = 24


@VALUE_CHECKS_CPU_ONLY
@pytest.mark.parametrize(
    "cu,ctx,name",
    [([0, 5, 11], [8, 6], "cu_seqlens_q"),  # last offset past T (before T is padding)
     ([0, 6, 10], [5, 4], "context_lens"),  # context shorter than the chunk
     ([0, 6, 10], [6, 30], "context_lens")],  # beyond the table capacity (24)
    ids=["cu-last", "ctx-short", "ctx-capacity"],
)
def test_prefill_attention_rejects_inconsistent_lengths(cu, ctx, name):
    args = _decode_args(q=torch.randn(10, 4, 16))
    with pytest.raises(ValueError, match=f"^{name}:"):
        prefill_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                          torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                          0.3, max_q_len=6)


@VALUE_CHECKS_CPU_ONLY
def test_store_kv_rejects_bad_slots_and_shapes():
    k_cache, v_cache, _, gen = make_paged([16], 2, 16, 8, torch.float32, seed=6)
    k = torch.randn(2, 2, 16, generator=gen)
    with pytest.raises(ValueError, match="^slot_mapping:"):
        store_kv(k, k, k_cache, v_cache, torch.tensor([0, 10**6]))
    with pytest.raises(ValueError, match="^k:"):  # anchored: "k" alone matches any message
        store_kv(torch.randn(2, 3, 16), torch.randn(2, 3, 16), k_cache, v_cache,
                 torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="^k_cache:"):
        store_kv(k, k, k_cache.half(), v_cache.half(), torch.tensor([0, 1]))


# ----------------------------------------------------------------------------------------------
# packed prefill steps
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Launchers' torch.empty / empty_like return NaN-filled tensors, so an output row the kernel
    never writes shows up as NaN instead of whatever the allocator handed back."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_attention_packed_step_matches_reference(dtype, poisoned_outputs):
    """Zero-length rows (q_len 0, context 0, all-zero table row) and trailing padding tokens:
    the real rows match the reference and every padding row is exactly zero."""
    q_lens, ctx_lens, pad = [0, 21, 0, 5, 0], [0, 40, 0, 5, 0], 11
    k_cache, v_cache, tables, gen = make_paged(ctx_lens, 2, 16, 8, dtype, seed=7)
    tables[[0, 2, 4]] = 0
    q = torch.randn(sum(q_lens) + pad, 4, 16, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    out = prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25, max_q_len=21,
                            config=SMALL_TILES)
    expected = prefill_attention_reference(*f64(q, k_cache, v_cache), tables, cu, ctx, 0.25)
    assert_close(out, expected, dtype, reduce_dim=40)
    assert torch.equal(out[26:], torch.zeros_like(out[26:]))


def test_prefill_attention_padding_only_step_gives_zeros(poisoned_outputs):
    """A step of padding only (max_q_len 0) still writes its rows: zeros."""
    k_cache, v_cache, tables, gen = make_paged([0], 2, 16, 8, torch.float16, seed=8)
    q = torch.randn(9, 4, 16, generator=gen).to(torch.float16)
    out = prefill_attention(q, k_cache, v_cache, tables, torch.zeros(2, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), 0.25, max_q_len=0)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3-8B's bf16 shapes need a GPU")
def test_decode_attention_preloaded_block_ids_keep_the_bits_at_real_shapes_on_gpu():
    """The sm_90a loop the preload changes (with 3 stages, two K and two V tiles in flight):
    Qwen3-8B's 32 q / 8 kv heads of 128, 16-token pages scattered, corun's 256-token splits at B 1
    and 8 (one and several splits a lane) and default's, with the two-launch and fused combines."""
    for batch, lens in ((1, [4096]), (8, [4096, 1500, 0, 513, 1, 256, 257, 3000])):
        k_cache, v_cache, tables, gen = make_paged(lens, 8, 128, 16, torch.bfloat16, seed=13)
        q = torch.randn(batch, 32, 128, generator=gen).to(torch.bfloat16)
        args = [t.cuda() for t in (q, k_cache, v_cache, tables,
                                   torch.tensor(lens, dtype=torch.int32))]
        for mode, max_seq_len in ((Mode.CORUN, 4096), (Mode.DEFAULT, max(lens))):
            # the ids tile by tile at 2 stages against the preload at 2 and 3 (the policy
            # itself preloads at some of these shapes)
            base = dataclasses.replace(
                decode_attention_config(batch, 32, 8, 128, max_seq_len, torch.bfloat16, mode),
                preload_pages=False, num_stages=2)
            for fused in (False, True):
                cfgs = [dataclasses.replace(base, fused_combine=fused)]
                cfgs += [dataclasses.replace(cfgs[0], preload_pages=True, num_stages=stages)
                         for stages in (2, 3)]
                assert decode_preloaded_pages(cfgs[1], 16) > 0
                outs = [decode_attention(*args, 0.1, max_seq_len=max_seq_len, config=cfg)
                        for cfg in cfgs]
                for out in outs[1:]:
                    assert_bitwise_equal(out, outs[0], f"B {batch} {mode.value} fused {fused}")


def test_prefill_attention_takes_a_chunk_bound_past_the_table_capacity():
    """A step shape's chunk bound may exceed the block tables (prefill_chunk_size above
    max_model_len): the grid covers the capacity and the rows are the reference's."""
    k_cache, v_cache, tables, gen = make_paged([20], 1, 16, 8, torch.float32, seed=4)
    q = torch.randn(20, 2, 16, generator=gen)
    cu, ctx = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    out = prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25, max_q_len=256,
                            config=SMALL_TILES)
    expected = prefill_attention_reference(*f64(q, k_cache, v_cache), tables, cu, ctx, 0.25)
    assert_close(out, expected, torch.float32, reduce_dim=20)
