"""Position and batch invariance of the row ops (rmsnorm, rope, silu_mul) under every mode.

Hypothesis draws the structure (rows, width, row index, permutation, mode, seed); tensors come from
a torch.Generator seeded by the drawn seed. Every comparison is bitwise.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.activation import silu_mul
from kernels.mode import Mode
from kernels.norm import RmsNormConfig, rmsnorm, rmsnorm_config
from kernels.reference import silu_mul_reference
from kernels.rope import build_rope_cache, rope
from tests.utils import assert_bitwise_equal

MODES = st.sampled_from(list(Mode))
SEEDS = st.integers(0, 2**63 - 1)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def batches(draw, max_rows=9):
    """(rows, row index, permutation) for a batch of 2..max_rows rows."""
    rows = draw(st.integers(2, max_rows))
    row = draw(st.integers(0, rows - 1))
    perm = draw(st.permutations(range(rows)))
    return rows, row, torch.tensor(perm)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@given(
    batch=batches(),
    hidden=st.sampled_from([16, 63, 64, 65, 145]),
    fused=st.booleans(),
    mode=MODES,
    dtype=DTYPES,
    seed=SEEDS,
)
def test_rmsnorm_row_invariant(batch, hidden, fused, mode, dtype, seed):
    """A row's rmsnorm output bits are the same alone, inside any batch, in any slot, whatever the
    other rows hold."""
    rows, row, perm = batch
    gen = torch.Generator().manual_seed(seed)
    x, residual = _randn(gen, rows, hidden, dtype=dtype), _randn(gen, rows, hidden, dtype=dtype)
    weight = _randn(gen, hidden, dtype=dtype)

    def run(xs, rs):
        return rmsnorm(xs, weight, 1e-6, rs if fused else None, mode=mode)

    full = run(x, residual)
    full = full if fused else (full,)
    alone = run(x[row : row + 1], residual[row : row + 1])
    alone = alone if fused else (alone,)
    permuted = run(x[perm], residual[perm])
    permuted = permuted if fused else (permuted,)
    others = torch.randn(x.shape, generator=gen).to(dtype)
    others[row] = x[row]
    replaced = run(others, residual)
    replaced = replaced if fused else (replaced,)
    for i in range(len(full)):
        assert_bitwise_equal(alone[i][0], full[i][row], "alone vs in batch")
        assert_bitwise_equal(permuted[i], full[i][perm], "permuted rows")
        assert_bitwise_equal(replaced[i][row], full[i][row], "other rows replaced")


@given(rows=st.integers(16, 24), hidden=st.sampled_from([96, 145, 200]), seed=SEEDS)
def test_rmsnorm_negative_control_tiling_changes_bits(rows, hidden, seed):
    """A policy that switched tiling with the number of rows (Liger's n_rows switch) would break
    batch invariance: a tiled sweep sums squares in another order and changes bits.

    Which sweep width reorders the sum depends on the one-tile layout. On the H200 a one-warp
    32-wide sweep summed in exactly the order of the fp32 multi-row tile when a row could not be
    vectorised (hidden 145: each lane adds its columns l, l + 32, ... in turn, as the sweep's
    accumulator does), so the control tries widths either side of a warp."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = _randn(gen, rows, hidden), _randn(gen, hidden)
    default = rmsnorm(x, weight, 1e-6)
    assert rmsnorm_config(hidden, x.dtype).BLOCK_SIZE >= hidden  # the policy uses one tile
    tiled = [rmsnorm(x, weight, 1e-6, config=RmsNormConfig(BLOCK_SIZE=width, num_warps=1))
             for width in (16, 32, 64)]
    assert any(not torch.equal(default, t) for t in tiled)


@given(
    batch=batches(),
    heads=st.sampled_from([(4, 2), (3, 1), (8, 8)]),
    rotary_dim=st.sampled_from([16, 34, 64]),
    is_neox=st.booleans(),
    mode=MODES,
    dtype=DTYPES,
    seed=SEEDS,
)
def test_rope_row_invariant(batch, heads, rotary_dim, is_neox, mode, dtype, seed):
    """A token's rotated q/k bits are the same alone, inside any batch, in any slot, whatever the
    other tokens hold."""
    tokens, row, perm = batch
    q_heads, k_heads = heads
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, tokens, q_heads, rotary_dim, dtype=dtype)
    k = _randn(gen, tokens, k_heads, rotary_dim, dtype=dtype)
    positions = torch.randperm(128, generator=gen)[:tokens]  # distinct: see the control below
    cache = build_rope_cache(rotary_dim, 128, 10000.0)
    full_q, full_k = rope(q, k, positions, cache, is_neox, mode=mode)
    alone_q, alone_k = rope(
        q[row : row + 1], k[row : row + 1], positions[row : row + 1], cache, is_neox, mode=mode
    )
    perm_q, perm_k = rope(q[perm], k[perm], positions[perm], cache, is_neox, mode=mode)
    assert_bitwise_equal(alone_q[0], full_q[row], "q alone vs in batch")
    assert_bitwise_equal(alone_k[0], full_k[row], "k alone vs in batch")
    assert_bitwise_equal(perm_q, full_q[perm], "q permuted")
    assert_bitwise_equal(perm_k, full_k[perm], "k permuted")
    # Negative control: a kernel that read a neighbour slot's position would be caught. The
    # positions are distinct, so every token's neighbour has another one (a filter on equal
    # positions could leave nothing to check).
    shifted = positions.roll(1)
    assert not (shifted == positions).any()
    wrong_q, _ = rope(q, k, shifted, cache, is_neox, mode=mode)
    for i in range(tokens):
        assert not torch.equal(wrong_q[i], full_q[i]), f"token {i}: a neighbour's position kept q"


@given(batch=batches(), inter=st.sampled_from([16, 123, 145]), mode=MODES, dtype=DTYPES, seed=SEEDS)
def test_silu_mul_row_invariant(batch, inter, mode, dtype, seed):
    """A row's silu_mul bits are the same alone, inside any batch, in any slot."""
    rows, row, perm = batch
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, rows, 2 * inter, dtype=dtype)
    full = silu_mul(x, mode=mode)
    assert_bitwise_equal(silu_mul(x[row : row + 1], mode=mode)[0], full[row], "alone vs in batch")
    assert_bitwise_equal(silu_mul(x[perm], mode=mode), full[perm], "permuted rows")


@given(rows=st.integers(4, 8), inter=st.sampled_from([123, 145]), seed=SEEDS)
def test_silu_mul_negative_control_other_formula_changes_bits(rows, inter, seed):
    """The bitwise check sees a last-bit change: torch's F.silu (another exp/division sequence)
    disagrees with the kernel somewhere, so a kernel that switched formula by shape would fail."""
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, rows, 2 * inter)
    assert not torch.equal(silu_mul(x), silu_mul_reference(x))
