"""Bitwise invariance of the MLA kernels (kernels/mla.py), with negative controls.

Hypothesis draws structure (lengths, batch composition, slot, split size, chunk size, mode, seed);
tensors come from a torch.Generator seeded by the drawn seed. Runs under the Triton interpreter on
the CPU (fp32 and fp16; bf16 dot paths are checked on the H200 by experiments/bench_mla.py).
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kernels.mla import (
    MLAPrefillConfig,
    MLATile,
    mla_decode,
    mla_prefill_attention,
    mla_prefill_config,
)
from kernels.mode import Mode
from tests.utils import assert_bitwise_equal

HEADS, LATENT_DIM, ROPE_DIM, BLOCK_SIZE = 4, 32, 16, 16
MAX_MODEL_LEN = 128  # the corun / batch_invariant grid bound (max_model_len)
BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
SCALE = (LATENT_DIM + ROPE_DIM) ** -0.5
DTYPES = st.sampled_from([torch.float32, torch.float16])
# The policy's tile (None) and the BLOCK_H values experiments/tune_mla.py may put in the table.
TUNABLE_TILES = (None, MLATile(32, 16, num_warps=4, num_stages=1), MLATile(64, 32, num_warps=8))


def _decode_batch(
    target_q: tuple[torch.Tensor, torch.Tensor],
    target_rows: torch.Tensor,
    target_len: int,
    other_lens: list[int],
    slot: int,
    gen: torch.Generator,
    max_seq_len: int,
    mode: Mode,
    split_size: int = 32,
    tile: MLATile | None = None,
) -> torch.Tensor:
    """Run mla_decode on a batch holding the target at ``slot`` among random co-runners, with
    every sequence's cache blocks scattered at random; returns the target's output [H, Lkv]."""
    dtype = target_rows.dtype
    lens = other_lens[:slot] + [target_len] + other_lens[slot:]
    batch = len(lens)
    blocks_per_seq = -(-max_seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(num_blocks, BLOCK_SIZE, LATENT_DIM + ROPE_DIM, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    rows = target_rows[: blocks_per_seq * BLOCK_SIZE]
    cache[tables[slot].long()] = rows.view(blocks_per_seq, BLOCK_SIZE, -1)
    q_latent = torch.randn(batch, HEADS, LATENT_DIM, generator=gen).to(dtype)
    q_pe = torch.randn(batch, HEADS, ROPE_DIM, generator=gen).to(dtype)
    q_latent[slot], q_pe[slot] = target_q
    out = mla_decode(
        q_latent, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), SCALE,
        max_seq_len=max_seq_len, mode=mode, split_size=split_size, tile=tile,
    )  # fmt: skip
    return out[slot]


def _target(seed: int, dtype: torch.dtype, max_len: int):
    gen = torch.Generator().manual_seed(seed)
    q = (
        torch.randn(HEADS, LATENT_DIM, generator=gen).to(dtype),
        torch.randn(HEADS, ROPE_DIM, generator=gen).to(dtype),
    )
    rows = torch.randn(max_len, LATENT_DIM + ROPE_DIM, generator=gen).to(dtype)
    return q, rows, gen


@given(
    seed=st.integers(0, 2**32 - 1),
    target_len=st.integers(1, MAX_MODEL_LEN),
    other_lens=st.lists(st.integers(0, MAX_MODEL_LEN), min_size=0, max_size=4),
    slot_frac=st.floats(0.0, 1.0),
    split_size=st.sampled_from([16, 32, 48]),
    mode=st.sampled_from([Mode.CORUN, Mode.BATCH_INVARIANT]),
    dtype=DTYPES,
    tile=st.sampled_from(TUNABLE_TILES),
)
@example(seed=7, target_len=97, other_lens=[128, 0, 1], slot_frac=0.5, split_size=32,
         mode=Mode.CORUN, dtype=torch.float32, tile=None)  # fmt: skip
@example(seed=8, target_len=70, other_lens=[5, 128], slot_frac=1.0, split_size=48,
         mode=Mode.BATCH_INVARIANT, dtype=torch.float16, tile=TUNABLE_TILES[2])  # fmt: skip
def test_mla_decode_invariant_to_co_runners_and_slot(
    seed, target_len, other_lens, slot_frac, split_size, mode, dtype, tile
) -> None:
    """Under corun and batch_invariant, with any tunable tile, a sequence's mla_decode bits do
    not depend on the other sequences in the batch, on its batch slot, or on where its cache
    blocks sit."""
    q, rows, gen = _target(seed, dtype, MAX_MODEL_LEN)
    alone = _decode_batch(q, rows, target_len, [], 0, gen, MAX_MODEL_LEN, mode, split_size, tile)
    slot = round(slot_frac * len(other_lens))
    batched = _decode_batch(
        q, rows, target_len, other_lens, slot, gen, MAX_MODEL_LEN, mode, split_size, tile
    )
    assert_bitwise_equal(batched, alone, f"{mode} target len {target_len} at slot {slot}")


def test_mla_decode_default_mode_is_batch_variant() -> None:
    """Negative control: under default the split count follows the batch's longest sequence, so a
    long co-runner changes the target's bits; the same pair under corun stays bitwise equal."""
    q, rows, gen = _target(11, torch.float32, 1024)
    # Alone: max_seq_len 200 -> 4 splits of 64; beside a 1000-token sequence: 13 splits of 16.
    alone = _decode_batch(q, rows, 200, [], 0, gen, 200, Mode.DEFAULT)
    batched = _decode_batch(q, rows, 200, [1000], 0, gen, 1000, Mode.DEFAULT)
    assert not torch.equal(alone, batched), "default mode unexpectedly batch-invariant here"
    alone = _decode_batch(q, rows, 200, [], 0, gen, 1024, Mode.CORUN)
    batched = _decode_batch(q, rows, 200, [1000], 0, gen, 1024, Mode.CORUN)
    assert_bitwise_equal(batched, alone, "corun with the same co-runner")


def test_mla_decode_check_detects_a_block_n_change() -> None:
    """Negative control: another BLOCK_N (a tunable of the table) changes a sequence's bits, so
    the bitwise co-runner check above would catch a tile that followed the batch."""
    q, rows, gen = _target(13, torch.float32, MAX_MODEL_LEN)
    state = gen.get_state()
    a = _decode_batch(q, rows, 100, [], 0, gen, MAX_MODEL_LEN, Mode.CORUN, 64, MLATile(16, 16))
    gen.set_state(state)
    b = _decode_batch(q, rows, 100, [], 0, gen, MAX_MODEL_LEN, Mode.CORUN, 64, MLATile(16, 32))
    assert not torch.equal(a, b), "BLOCK_N change left every bit unchanged"


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------

QK_DIM, V_DIM, PREFILL_HEADS = 24, 16, 2  # 24 = 16 + 8: the two-part qk path, like 192 = 128 + 64
PREFILL_DTYPE = torch.float32
# Chunks aligned at multiples of the policy's BLOCK_M keep every query row at the same row index of
# its tile. Required under the interpreter: it runs tl.dot through numpy's BLAS, whose edge kernels
# give a row different bits at a different row index (measured, fp32 and fp16->fp32 alike); GPU
# MMA rows do not depend on their index, and the engine's chunk sizes are multiples of BLOCK_M.
PREFILL_BLOCK_M = mla_prefill_config(QK_DIM, V_DIM, PREFILL_DTYPE, Mode.CORUN).block_m


def _prompt(seed: int, length: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, PREFILL_HEADS, QK_DIM, generator=gen).to(dtype)
    k = torch.randn(length, PREFILL_HEADS, QK_DIM, generator=gen).to(dtype)
    v = torch.randn(length, PREFILL_HEADS, V_DIM, generator=gen).to(dtype)
    return q, k, v, gen


def _prefill(seqs, mode: Mode, config: MLAPrefillConfig | None = None) -> list[torch.Tensor]:
    """One launch over sequences given as (q, k, v) each; returns each sequence's output."""
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1] for s in seqs])
    v = torch.cat([s[2] for s in seqs])
    q_lens = [s[0].shape[0] for s in seqs]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    k_lens = torch.tensor([s[1].shape[0] for s in seqs])
    cu_k = torch.tensor([0, *k_lens.cumsum(0).tolist()], dtype=torch.int32)
    out = mla_prefill_attention(
        q, k, v, cu_q, cu_k, QK_DIM**-0.5, max_q_len=max(q_lens), mode=mode, config=config
    )
    return list(out.split(q_lens))


@given(
    seed=st.integers(0, 2**32 - 1),
    length=st.integers(1, 3 * PREFILL_BLOCK_M),
    chunk_blocks=st.integers(1, 2),
    other_len=st.integers(0, 40),
    other_first=st.booleans(),
    mode=st.sampled_from(list(Mode)),
)
@example(seed=3, length=2 * PREFILL_BLOCK_M + 1, chunk_blocks=1, other_len=17, other_first=True,
         mode=Mode.CORUN)  # fmt: skip
def test_mla_prefill_invariant_to_chunking_and_co_runners(
    seed, length, chunk_blocks, other_len, other_first, mode
) -> None:
    """A prompt's mla_prefill_attention rows have the same bits whether it is prefilled whole and
    alone or in BLOCK_M-aligned chunks (each over the whole context so far) beside another one."""
    chunk = chunk_blocks * PREFILL_BLOCK_M
    q, k, v, gen = _prompt(seed, length, PREFILL_DTYPE)
    (whole,) = _prefill([(q, k, v)], mode)
    other_seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    other = _prompt(other_seed, other_len, PREFILL_DTYPE)[:3]
    pieces = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        mine = (q[start:end], k[:end], v[:end])
        seqs = [other, mine] if other_first else [mine, other]
        pieces.append(_prefill(seqs, mode)[1 if other_first else 0])
    assert_bitwise_equal(torch.cat(pieces), whole, f"{mode} length {length} chunk {chunk}")


def test_mla_prefill_chunk_check_detects_a_reduction_order_change() -> None:
    """Negative control: another key tile size (BLOCK_N) changes the rows' bits, so the bitwise
    chunk check above would catch a chunk-dependent key walk."""
    q, k, v, _ = _prompt(5, 100, PREFILL_DTYPE)
    policy = mla_prefill_config(QK_DIM, V_DIM, PREFILL_DTYPE, Mode.CORUN)
    other = MLAPrefillConfig(**{**policy.__dict__, "block_n": policy.block_n // 2})
    (a,) = _prefill([(q, k, v)], Mode.CORUN)
    (b,) = _prefill([(q, k, v)], Mode.CORUN, config=other)
    assert not torch.equal(a, b), "BLOCK_N change left every bit unchanged"


@given(
    seed=st.integers(0, 2**32 - 1),
    target_len=st.sampled_from([1, 20, 32]),
    grid_len=st.sampled_from([32, 64, MAX_MODEL_LEN]),
    other_len=st.integers(33, MAX_MODEL_LEN),
    mode=st.sampled_from([Mode.CORUN, Mode.BATCH_INVARIANT]),
)
@example(seed=5, target_len=32, grid_len=32, other_len=MAX_MODEL_LEN, mode=Mode.CORUN)
def test_mla_decode_one_split_sequence_independent_of_grid_and_launches(
    seed, target_len, grid_len, other_len, mode
) -> None:
    """A sequence of one split (len <= split_size 32) has the same bits under any grid bound:
    alone with max_seq_len = the split size (one split in the grid: no partial buffers, no
    combine launch) and beside a long co-runner with a larger bound (combine launched)."""
    q, rows, gen = _target(seed, torch.float32, MAX_MODEL_LEN)
    one = _decode_batch(q, rows, target_len, [], 0, gen, 32, mode, split_size=32)
    other = _decode_batch(q, rows, target_len, [other_len], 1, gen, max(grid_len, other_len),
                          mode, split_size=32)  # fmt: skip
    assert_bitwise_equal(other, one, f"{mode} one-split len {target_len}")


# ----------------------------------------------------------------------------------------------
# prefill: packed steps
# ----------------------------------------------------------------------------------------------


def _packed(pieces, pad_q: int, pad_k: int, gen: torch.Generator, config=None):
    """One launch over pieces given as (q, k, v), or None for a zero-length padding row, then
    pad_q (pad_k) rows of q (k, v) after the last sequence. Returns the output and row offsets."""
    qs, ks, vs, cu_q, cu_k, offsets = [], [], [], [0], [0], []
    for piece in pieces:
        offsets.append(cu_q[-1])
        q, k, v = piece if piece is not None else (torch.empty(0, PREFILL_HEADS, QK_DIM),
                                                   torch.empty(0, PREFILL_HEADS, QK_DIM),
                                                   torch.empty(0, PREFILL_HEADS, V_DIM))
        qs.append(q), ks.append(k), vs.append(v)
        cu_q.append(cu_q[-1] + q.shape[0])
        cu_k.append(cu_k[-1] + k.shape[0])
    qs.append(torch.randn(pad_q, PREFILL_HEADS, QK_DIM, generator=gen))
    ks.append(torch.randn(pad_k, PREFILL_HEADS, QK_DIM, generator=gen))
    vs.append(torch.randn(pad_k, PREFILL_HEADS, V_DIM, generator=gen))
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    out = mla_prefill_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32), QK_DIM**-0.5, max_q_len=max(q_lens),
        config=config,
    )  # fmt: skip
    return out, offsets, cu_q[-1]


@given(
    seed=st.integers(0, 2**32 - 1),
    q_len=st.integers(1, 2 * PREFILL_BLOCK_M),
    extra_keys=st.sampled_from([0, 7, 40]),
    before=st.lists(st.one_of(st.none(), st.integers(1, 30)), min_size=1, max_size=3),
    pad_q=st.integers(0, 20),
    pad_k=st.integers(0, 5),
)
@example(seed=2, q_len=PREFILL_BLOCK_M + 3, extra_keys=40, before=[None, 17], pad_q=9, pad_k=3)
def test_mla_prefill_packed_rows_equal_alone(seed, q_len, extra_keys, before, pad_q, pad_k):
    """A sequence's mla_prefill_attention rows have the same bits alone and packed after other
    sequences at any row offset, with zero-length padding rows and trailing padding rows of q and
    k; the padding rows of the output are exact zeros."""
    q, k, v, gen = _prompt(seed, q_len + extra_keys, PREFILL_DTYPE)
    mine = (q[extra_keys:], k, v)
    (alone, _, _) = _packed([mine], 0, 0, gen)
    others = [None if n is None else _prompt(seed + 1 + i, n, PREFILL_DTYPE)[:3]
              for i, n in enumerate(before)]  # fmt: skip
    packed, offsets, real = _packed([*others, mine, None], pad_q, pad_k, gen)
    at = offsets[len(others)]
    assert_bitwise_equal(packed[at : at + q_len], alone, f"packed at row {at}")
    assert torch.equal(packed[real:], torch.zeros_like(packed[real:])), "padding rows not zero"


def test_mla_prefill_packed_check_detects_another_tile() -> None:
    """Negative control: the packed run with another key tile (BLOCK_N halved) gives other bits
    than the sequence alone, so the packed-vs-alone check above can fail."""
    q, k, v, gen = _prompt(6, 90, PREFILL_DTYPE)
    policy = mla_prefill_config(QK_DIM, V_DIM, PREFILL_DTYPE, Mode.CORUN)
    other = MLAPrefillConfig(**{**policy.__dict__, "block_n": policy.block_n // 2})
    (alone, _, _) = _packed([(q, k, v)], 0, 0, gen)
    packed, offsets, _ = _packed([_prompt(7, 11, PREFILL_DTYPE)[:3], None, (q, k, v)], 4, 2, gen,
                                 config=other)  # fmt: skip
    assert not torch.equal(packed[offsets[2] : offsets[2] + 90], alone)
