"""Invariance of paged attention: decode under corun / batch_invariant, and chunked prefill.

Hypothesis draws structure (lengths, batch composition, slot, chunk size, seed); tensors come
from torch.Generators seeded by the drawn seed. Every check is bitwise (torch.equal through
assert_bitwise_equal), and each property has a negative control showing the check can fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kernels.attention import (
    PrefillAttentionConfig,
    decode_attention,
    decode_attention_config,
    prefill_attention,
)
from kernels.kv_store import store_kv
from kernels.mode import Mode
from tests.utils import assert_bitwise_equal

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 2, 16, 8
NUM_Q_HEADS = NUM_KV_HEADS * GROUP
MAX_MODEL_LEN = 96  # the corun grid bound; every drawn length stays below it
SPLIT_SIZE = 32
SCALE = HEAD_DIM**-0.5


def _seq_data(seed: int, length: int, dtype: torch.dtype):
    """One sequence's query and its K/V rows, a function of (seed, length) only."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v


def _decode_batch(seqs, dtype, block_seed, max_seq_len, mode, split_size=SPLIT_SIZE):
    """Store each sequence's K/V into shuffled cache blocks and run decode over the batch.

    ``seqs`` is a list of (seed, length). Block placement is shuffled by ``block_seed``.
    """
    max_blocks = -(-max_seq_len // BLOCK_SIZE)
    num_blocks = len(seqs) * max_blocks + 1
    gen = torch.Generator().manual_seed(block_seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    # Junk in unused slots: the kernels must never read past a sequence's length.
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = perm[: len(seqs) * max_blocks].view(len(seqs), max_blocks).contiguous()
    queries = []
    for b, (seed, length) in enumerate(seqs):
        q, k, v = _seq_data(seed, length, dtype)
        token = torch.arange(length)
        slots = tables[b, token // BLOCK_SIZE].long() * BLOCK_SIZE + token % BLOCK_SIZE
        # Plain indexing, not store_kv: the interpreter runs one program per token and head.
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
        queries.append(q)
    seq_lens = torch.tensor([length for _, length in seqs], dtype=torch.int32)
    return decode_attention(torch.stack(queries), k_cache, v_cache, tables, seq_lens, SCALE,
                            max_seq_len=max_seq_len, mode=mode, split_size=split_size)


@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.sampled_from([1, SPLIT_SIZE - 1, SPLIT_SIZE, SPLIT_SIZE + 1, 2 * SPLIT_SIZE + 7, 90]),
    other_lens=st.lists(st.integers(0, MAX_MODEL_LEN), min_size=1, max_size=3),
    slot=st.integers(0, 3),
    mode=st.sampled_from([Mode.CORUN, Mode.BATCH_INVARIANT]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_decode_row_independent_of_co_runners(seed, length, other_lens, slot, mode, dtype):
    """Under corun and batch_invariant, a sequence's decode output bits do not change with the
    other sequences' lengths, contents or count, nor with its own slot and cache blocks."""
    alone = _decode_batch([(seed, length)], dtype, block_seed=seed, max_seq_len=MAX_MODEL_LEN,
                          mode=mode)[0]
    others = [(seed + 1 + i, n) for i, n in enumerate(other_lens)]
    slot = min(slot, len(others))
    batch = others[:slot] + [(seed, length)] + others[slot:]
    together = _decode_batch(batch, dtype, block_seed=seed + 7, max_seq_len=MAX_MODEL_LEN,
                             mode=mode)[slot]
    assert_bitwise_equal(together, alone, f"{mode} decode row, slot {slot}")


# The fixed-split policies size the grid's lanes per (sequence, kv head) from B: about
# DECODE_TARGET_PROGRAMS stage-1 programs in all. At the drawn batches above (B <= 4) every split
# gets its own lane on both sides, so the property there never sees the lanes change. With 16-token
# splits a sequence alone gets 6 lanes for its 6 splits; beside 44 other slots (mostly dummies,
# cheap under the interpreter) 3 lanes walk them two by two.
_LANES_SPLIT, _LANES_BATCH = 16, 45


@settings(max_examples=2)  # each example runs ~300 interpreter programs
@example(seed=0, length=90, slot=1, mode=Mode.BATCH_INVARIANT)
@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.sampled_from([49, 64, 90]),  # >= 4 splits: some lane walks two
    slot=st.integers(0, _LANES_BATCH - 1),
    mode=st.sampled_from([Mode.CORUN, Mode.BATCH_INVARIANT]),
)
def test_decode_row_independent_of_the_lanes_its_batch_gets(seed, length, slot, mode):
    """Under corun and batch_invariant, a sequence's decode bits are the same alone (a lane per
    split) and in a batch whose size gives it fewer lanes than splits."""
    lanes = [decode_attention_config(b, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_MODEL_LEN,
                                     torch.float32, mode, _LANES_SPLIT).num_split_programs
             for b in (1, _LANES_BATCH)]
    assert lanes == [6, 3], lanes  # the precondition: the batch changes the lanes
    alone = _decode_batch([(seed, length)], torch.float32, seed, MAX_MODEL_LEN, mode,
                          split_size=_LANES_SPLIT)[0]
    others = [(seed + 1, 40), (seed + 2, MAX_MODEL_LEN - 1)]
    others += [(seed + 3 + i, 0) for i in range(_LANES_BATCH - 1 - len(others))]
    batch = others[:slot] + [(seed, length)] + others[slot:]
    together = _decode_batch(batch, torch.float32, seed + 7, MAX_MODEL_LEN, mode,
                             split_size=_LANES_SPLIT)[slot]
    assert_bitwise_equal(together, alone, f"{mode} decode row, {lanes[1]} lanes vs {lanes[0]}")


# A batch large enough that default mode makes few splits, so its split size follows the max:
# 64 slots x 2 kv heads -> 3 splits; longest 150 -> 64-token splits, longest 400 -> 192.
_CONTROL_BATCH = 64


@settings(max_examples=1)  # each example runs ~800 interpreter programs
@example(seed=0)
@given(seed=st.integers(0, 2**32 - 1))
def test_decode_default_mode_depends_on_co_runners(seed):
    """Negative control: under default, the same sequence's bits change when only the other
    sequences' lengths change (its split size follows the batch's longest sequence)."""
    length = 150
    # One other sequence sets the batch's max; the rest are dummy slots (length 0), which count
    # towards the batch size but cost nothing to run.
    dummies = [(seed + 2 + i, 0) for i in range(_CONTROL_BATCH - 2)]
    cfg_short = decode_attention_config(_CONTROL_BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                        length, torch.float32, Mode.DEFAULT)
    cfg_long = decode_attention_config(_CONTROL_BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                       400, torch.float32, Mode.DEFAULT)
    assert cfg_short.split_size != cfg_long.split_size  # the precondition of this control
    a = _decode_batch([(seed, length), (seed + 1, 40), *dummies], torch.float32, seed, length,
                      Mode.DEFAULT)
    b = _decode_batch([(seed, length), (seed + 1, 400), *dummies], torch.float32, seed, 400,
                      Mode.DEFAULT)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(b[0], a[0], "default decode row 0")


# ----------------------------------------------------------------------------------------------
# prefill: whole vs chunked
# ----------------------------------------------------------------------------------------------

TILES_16 = PrefillAttentionConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def _prefill_chunks(seed, length, chunk, dtype, config, chunk_config=None):
    """Prefill one prompt in chunks of ``chunk`` tokens (chunk >= length: whole). Returns the
    concatenated outputs and the caches. Cache blocks are scattered; unused slots hold junk."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    num_blocks = -(-length // BLOCK_SIZE)
    junk = torch.Generator().manual_seed(seed + chunk)  # differs between whole and chunked
    shape = (num_blocks + 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=junk).to(dtype)
    v_cache = torch.randn(shape, generator=junk).to(dtype)
    placement = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks + 2, generator=placement)[:num_blocks]
    table = table.to(torch.int32).view(1, -1)
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        token = torch.arange(start, end)
        slots = table[0, token // BLOCK_SIZE].long() * BLOCK_SIZE + token % BLOCK_SIZE
        store_kv(k[start:end], v[start:end], k_cache, v_cache, slots)
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        ctx = torch.tensor([end], dtype=torch.int32)
        cfg = chunk_config if (chunk_config is not None and chunk < length) else config
        outs.append(prefill_attention(q[start:end], k_cache, v_cache, table, cu, ctx, SCALE,
                                      max_q_len=end - start, config=cfg))
    return torch.cat(outs), k_cache[table[0].long()], v_cache[table[0].long()]


@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 80),
    chunk=st.sampled_from([16, 32, 48, 64]),  # multiples of BLOCK_M = 16
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
@example(seed=5, length=80, chunk=16, dtype=torch.float16)
@example(seed=6, length=79, chunk=32, dtype=torch.float32)
def test_prefill_whole_equals_chunked(seed, length, chunk, dtype):
    """A prompt prefilled whole or in chunks of C (aligned at multiples of C, C a multiple of
    BLOCK_M) gives bitwise the same output rows and the same KV in the cache."""
    assume(chunk < length)  # else "chunked" is one chunk: the whole prefill's very computation
    whole, k_whole, v_whole = _prefill_chunks(seed, length, length, dtype, TILES_16)
    chunked, k_chunked, v_chunked = _prefill_chunks(seed, length, chunk, dtype, TILES_16)
    # Compare only the written slots' blocks: the tail of the last block holds junk.
    valid = torch.arange(k_whole.shape[0] * BLOCK_SIZE).view(-1, BLOCK_SIZE) < length
    assert_bitwise_equal(chunked, whole, f"prefill rows, chunk {chunk}")
    assert_bitwise_equal(k_chunked[valid], k_whole[valid], "k cache")
    assert_bitwise_equal(v_chunked[valid], v_whole[valid], "v cache")


@settings(max_examples=1)  # a control: one pinned and one drawn example suffice
@example(seed=1)
@given(seed=st.integers(0, 2**32 - 1))
def test_prefill_chunked_with_other_kv_tiles_differs(seed):
    """Negative control: when the chunked run walks KV tiles of another width (BLOCK_N 32 vs 16),
    the output bits differ from the whole prefill: the check sees tile boundaries."""
    tiles_32 = PrefillAttentionConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    whole, _, _ = _prefill_chunks(seed, 80, 80, torch.float32, TILES_16)
    chunked, _, _ = _prefill_chunks(seed, 80, 32, torch.float32, TILES_16, chunk_config=tiles_32)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(chunked, whole, "prefill rows with other tiles")


@given(
    seed=st.integers(0, 2**32 - 1),
    other_len=st.integers(1, 40),
    first=st.booleans(),
)
def test_prefill_rows_independent_of_batch(seed, other_len, first):
    """A prompt's prefill rows are bitwise the same alone or batched with another prompt."""
    length = 45
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    q_other = torch.randn(other_len, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    shape = (16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = torch.randperm(16, generator=gen).to(torch.int32)
    own, other = table[:6].view(1, -1), table[6:12].view(1, -1)
    alone = prefill_attention(
        q, k_cache, v_cache, own, torch.tensor([0, length], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32), SCALE, max_q_len=length, config=TILES_16,
    )
    pair = [(q, own, length), (q_other, other, other_len)]
    if not first:
        pair.reverse()
    lens = [n for _, _, n in pair]
    out = prefill_attention(
        torch.cat([p[0] for p in pair]), k_cache, v_cache, torch.cat([p[1] for p in pair]),
        torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), SCALE, max_q_len=max(lens), config=TILES_16,
    )
    rows = out[:length] if first else out[other_len:]
    assert_bitwise_equal(rows, alone, "prefill rows in a batch")


# ----------------------------------------------------------------------------------------------
# decode: one launch or two
# ----------------------------------------------------------------------------------------------


@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.sampled_from([1, 17, SPLIT_SIZE - 1, SPLIT_SIZE]),
    other_lens=st.lists(st.integers(SPLIT_SIZE + 1, MAX_MODEL_LEN), min_size=1, max_size=3),
    mode=st.sampled_from([Mode.CORUN, Mode.BATCH_INVARIANT]),
)
@example(seed=3, length=SPLIT_SIZE, other_lens=[MAX_MODEL_LEN], mode=Mode.CORUN)
def test_decode_one_split_sequence_same_bits_with_one_or_two_launches(seed, length, other_lens,
                                                                      mode):
    """A sequence that fits in one split has the same bits when its grid bound makes the whole
    launch one split (stage 1 only) and when long co-runners make it two launches (stage 1 +
    combine): stage 1 writes a one-split sequence directly in both, a choice made from the
    sequence's own length."""
    assert decode_attention_config(1, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, SPLIT_SIZE,
                                   torch.float32, mode, SPLIT_SIZE).max_num_splits == 1
    one_launch = _decode_batch([(seed, length)], torch.float32, seed, SPLIT_SIZE, mode)[0]
    others = [(seed + 1 + i, n) for i, n in enumerate(other_lens)]
    two_launches = _decode_batch([*others, (seed, length)], torch.float32, seed + 5,
                                 MAX_MODEL_LEN, mode)[len(others)]
    assert_bitwise_equal(two_launches, one_launch, f"{mode} one-split row, one vs two launches")


@settings(max_examples=1)
@example(seed=2)
@given(seed=st.integers(0, 2**32 - 1))
def test_decode_one_launch_check_detects_another_tile(seed):
    """Negative control: when the one-launch run walks its split in other KV tiles (BLOCK_N 16
    instead of 32), the bits differ from the two-launch run, so the check above can fail."""
    cfg = decode_attention_config(1, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, SPLIT_SIZE,
                                  torch.float32, Mode.CORUN, SPLIT_SIZE)
    assert cfg.BLOCK_N == 32
    other = dataclasses.replace(cfg, BLOCK_N=16)
    length = SPLIT_SIZE - 3
    q, k, v = _seq_data(seed, length, torch.float32)
    shape = (8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[:length] = k
    v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[:length] = v
    table = torch.arange(8, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([length], dtype=torch.int32)
    a = decode_attention(q[None], k_cache, v_cache, table, lens, SCALE, max_seq_len=SPLIT_SIZE,
                         config=other)
    b = _decode_batch([(seed, length), (seed + 1, MAX_MODEL_LEN)], torch.float32, seed,
                      MAX_MODEL_LEN, Mode.CORUN)[0]
    with pytest.raises(AssertionError):
        assert_bitwise_equal(a[0], b, "one-split row with other KV tiles")


# ----------------------------------------------------------------------------------------------
# prefill: packed steps (several requests' chunks in one fixed-shape step)
# ----------------------------------------------------------------------------------------------


def _packed_prefill(pieces, pad_tokens: int, config, seed: int):
    """One prefill launch over ``pieces``: (q, k, v, context_len) per sequence, or None for a
    zero-length padding row (q_len 0, context 0, all-zero table row), then ``pad_tokens`` rows of
    q that belong to no sequence. Each sequence's K/V go to shuffled cache blocks. Returns the
    output and each piece's row offset."""
    width = max([-(-p[3] // BLOCK_SIZE) for p in pieces if p is not None] + [1])
    num_blocks = len(pieces) * width + 1
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros((len(pieces), width), dtype=torch.int32)
    qs, cu, ctx, offsets = [], [0], [], []
    for b, piece in enumerate(pieces):
        offsets.append(cu[-1])
        if piece is None:
            cu.append(cu[-1])
            ctx.append(0)
            continue
        q, k, v, context = piece
        tables[b] = perm[b * width : (b + 1) * width]
        token = torch.arange(context)
        slots = tables[b, token // BLOCK_SIZE].long() * BLOCK_SIZE + token % BLOCK_SIZE
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
        qs.append(q)
        cu.append(cu[-1] + q.shape[0])
        ctx.append(context)
    qs.append(torch.randn(pad_tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen))
    q_lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    cu_t, ctx_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
    out = prefill_attention(torch.cat(qs), k_cache, v_cache, tables, cu_t, ctx_t, SCALE,
                            max_q_len=max(q_lens), config=config)
    return out, offsets, cu[-1]


def _chunk(seed: int, q_len: int, context: int):
    """A chunk of q_len queries at the end of a context of ``context`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(context, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(context, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, context


@given(
    seed=st.integers(0, 2**32 - 1),
    q_len=st.integers(1, 40),
    extra_context=st.sampled_from([0, 16, 23]),
    before=st.lists(st.one_of(st.none(), st.integers(1, 30)), min_size=1, max_size=3),
    pad_tokens=st.integers(0, 20),
)
@example(seed=1, q_len=32, extra_context=16, before=[None, 17, None], pad_tokens=13)
def test_prefill_packed_rows_equal_alone(seed, q_len, extra_context, before, pad_tokens):
    """A sequence's prefill rows have the same bits alone and packed after other sequences at any
    row offset, with zero-length padding rows and trailing padding tokens in the step; the
    padding rows come out as exact zeros."""
    mine = _chunk(seed, q_len, q_len + extra_context)
    (alone, _, _) = _packed_prefill([mine], 0, TILES_16, seed)
    others = [None if n is None else _chunk(seed + 1 + i, n, n + 5) for i, n in enumerate(before)]
    packed, offsets, real = _packed_prefill([*others, mine, None], pad_tokens, TILES_16, seed + 9)
    rows = packed[offsets[len(others)] : offsets[len(others)] + q_len]
    assert_bitwise_equal(rows, alone, f"packed at row {offsets[len(others)]}")
    assert torch.equal(packed[real:], torch.zeros_like(packed[real:])), "padding rows not zero"


@settings(max_examples=1)
@example(seed=4)
@given(seed=st.integers(0, 2**32 - 1))
def test_prefill_packed_check_detects_another_tile(seed):
    """Negative control: the packed run with another KV tile width (BLOCK_N 32) gives other bits
    than the sequence alone, so the packed-vs-alone check above can fail."""
    tiles_32 = PrefillAttentionConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    mine = _chunk(seed, 30, 60)
    (alone, _, _) = _packed_prefill([mine], 0, TILES_16, seed)
    packed, offsets, _ = _packed_prefill([_chunk(seed + 1, 9, 12), None, mine], 5, tiles_32, seed)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(packed[offsets[2] : offsets[2] + 30], alone, "other tiles")
