"""Batch and position invariance of sampling: a row's token (and log-probability) depends only on
its own logits, sampling parameters, seed, sample index and position, under every mode.

Hypothesis draws the structure (batch size, slot, mode, seed); tensors come from a torch.Generator
seeded by the drawn seed. Comparisons are exact (token ids, logprob bits).
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.mode import Mode
from kernels.sampling import SamplingConfig, _sample_launch, sample, token_logprobs
from tests.utils import assert_bitwise_equal

VOCAB = 67


def _batch(gen, rows):
    logits = 2 * torch.randn(rows, VOCAB, generator=gen)
    temperature = torch.rand(rows, generator=gen) + 0.3
    temperature[0] = 0.0  # one greedy row in every batch
    top_k = torch.randint(0, 20, (rows,), generator=gen)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.85)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    sample_indices = torch.randint(0, 3, (rows,), generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    return [logits, temperature, top_k, top_p, seeds, sample_indices, positions]


@given(
    rows=st.integers(2, 6),
    row=st.integers(0, 5),
    slot=st.integers(0, 6),
    mode=st.sampled_from(list(Mode)),
    seed=st.integers(0, 2**63 - 1),
)
def test_sampled_token_independent_of_batch(rows, row, slot, mode, seed):
    """A row's sampled token is the same alone, in a batch of other rows, and moved to another slot
    of a larger batch with different neighbours."""
    row = row % rows
    gen = torch.Generator().manual_seed(seed)
    args = _batch(gen, rows)
    full = sample(*args, mode=mode)
    alone = sample(*[a[row : row + 1] for a in args], mode=mode)
    assert alone[0] == full[row]
    # Move the row to `slot` of a batch of rows + 1 whose other rows are fresh.
    slot = slot % (rows + 1)
    others = _batch(gen, rows + 1)
    moved = [
        torch.cat([o[:slot], a[row : row + 1], o[slot + 1 :]])
        for o, a in zip(others, args, strict=True)
    ]
    assert sample(*moved, mode=mode)[slot] == full[row]
    # Logprobs of the drawn tokens: the same bits alone and in the batch.
    lp_full = token_logprobs(args[0], full, mode=mode)
    lp_alone = token_logprobs(args[0][row : row + 1], full[row : row + 1], mode=mode)
    assert_bitwise_equal(lp_alone[0], lp_full[row], "logprob alone vs in batch")


# Pieces of 8 columns with lists of 2: most top-k/top-p rows take the whole-row fallback; from 3
# rows on a program reads both pieces of a row (alone it reads one).
TINY = SamplingConfig(CHUNK=8, R=2, BLOCK_V=16, sweep_warps=1, num_warps=1, combine_warps=1,
                      pieces_per_program=2, group_from_batch=3)


@settings(max_examples=4)
@given(rows=st.integers(2, 3), row=st.integers(1, 2), slot=st.integers(0, 3),
       seed=st.integers(0, 2**63 - 1))
def test_fallback_rows_independent_of_batch(rows, row, slot, seed):
    """The same property for rows decided by the whole-row fallback and by the lists, mixed in
    one batch (small pieces), and the path a row takes is its own too."""
    row = 1 + (row - 1) % (rows - 1)  # row 0 of every batch is greedy (no path)
    gen = torch.Generator().manual_seed(seed)
    args = _batch(gen, rows)
    args[0] = args[0][:, :16].contiguous()
    args[2] = args[2] % 8
    full, full_path = _sample_launch(*args, TINY)
    alone, alone_path = _sample_launch(*[a[row : row + 1] for a in args], TINY)
    assert alone[0] == full[row]
    if (0 < args[2][row] < 16) or args[3][row] < 1:
        assert alone_path[0] == full_path[row]
    slot = slot % (rows + 1)
    others = _batch(gen, rows + 1)
    others[0] = others[0][:, :16].contiguous()
    moved = [
        torch.cat([o[:slot], a[row : row + 1], o[slot + 1 :]])
        for o, a in zip(others, args, strict=True)
    ]
    assert _sample_launch(*moved, TINY)[0][slot] == full[row]


@given(seed=st.integers(0, 2**63 - 1))
def test_negative_control_row_own_position_changes_draws(seed):
    """The check above can fail: changing a row's own position (its noise counter) changes the draw
    of some rows of a batch of flat-ish logits."""
    gen = torch.Generator().manual_seed(seed)
    rows = 8
    logits = 0.1 * torch.randn(rows, VOCAB, generator=gen)
    common = [
        torch.ones(rows),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows),
        torch.randint(0, 2**62, (rows,), generator=gen),
        torch.zeros(rows, dtype=torch.int64),
    ]
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    first = sample(logits, *common, positions)
    second = sample(logits, *common, positions + 1)
    assert not torch.equal(first, second)


@settings(max_examples=8)
@given(rows=st.integers(2, 6), row=st.integers(0, 5), k=st.integers(1, 8),
       extra_k=st.integers(0, 4), mode=st.sampled_from(list(Mode)),
       seed=st.integers(0, 2**63 - 1), ties=st.booleans())
def test_top_logprobs_independent_of_batch_and_of_k(rows, row, k, extra_k, mode, seed, ties):
    """A row's top-N ids and their logprobs (corun.sampler.top_token_ids + token_logprobs on
    [B, K] ids) are the same bits alone and in a batch, and a larger K (another row asking for
    more) only appends to the row's list."""
    from corun.sampler import top_token_ids

    row = row % rows
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(rows, VOCAB, generator=gen)
    if ties:  # rounded logits: many exact ties, broken by the lowest id
        logits = logits.round()
    ids = top_token_ids(logits, k + extra_k)
    lps = token_logprobs(logits, ids, mode=mode)
    alone_ids = top_token_ids(logits[row : row + 1], k)
    alone = token_logprobs(logits[row : row + 1], alone_ids, mode=mode)
    assert alone_ids[0].tolist() == ids[row, :k].tolist()
    assert_bitwise_equal(alone[0], lps[row, :k], "top-N logprobs alone vs in batch")
    values = logits[row, ids[row]].tolist()
    assert values == sorted(values, reverse=True)
