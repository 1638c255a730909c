"""Position and batch invariance of the MoE layer (router + fused_moe), bitwise.

The other tokens of a batch decide how many pairs each expert gets and where a token's pairs land
in the expert-sorted order; none of that may touch a token's bits. Tensors come from a
torch.Generator seeded by the drawn seed; hypothesis draws the structure.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import kernels.moe as moe_module
from kernels.mode import Mode
from kernels.moe import (
    MoEConfig,
    fused_moe,
    grouped_topk,
    moe_align_block_size,
    moe_config,
    softmax_topk,
)
from tests.utils import assert_bitwise_equal

NUM_EXPERTS, HIDDEN, INTER = 8, 32, 16
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    bias = torch.rand(NUM_EXPERTS, generator=gen) * 0.1
    return w13.to(dtype), w2.to(dtype), bias


def _moe_layer(x, logits, weights, router, top_k, mode, token_mask=None, config=None):
    w13, w2, bias = weights
    if router == "softmax":
        topk_weights, topk_ids = softmax_topk(logits, top_k, True, mode=mode)
    else:  # DeepSeek-V3 style: 4 groups of 2, keep 2
        topk_weights, topk_ids = grouped_topk(logits, bias, top_k, 4, 2, True, 2.5, mode=mode)
    return fused_moe(x, w13, w2, topk_weights, topk_ids, mode=mode, token_mask=token_mask,
                     config=config)


def _batch_with_token(token_x, token_logits, num_tokens, row, seed, dtype):
    """A batch of ``num_tokens`` fresh random tokens from ``seed`` with the given one at ``row``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    x[row], logits[row] = token_x, token_logits
    return x, logits


@given(
    num_tokens=st.integers(1, 12),
    row_a=st.integers(0, 11),
    row_b=st.integers(0, 11),
    seed=st.integers(0, 2**63 - 1),
    mode=st.sampled_from(list(Mode)),
    router=st.sampled_from(["softmax", "grouped"]),
    dtype_name=st.sampled_from(list(DTYPES)),
)
@example(num_tokens=9, row_a=0, row_b=8, seed=0, mode=Mode.CORUN, router="softmax",
         dtype_name="bf16")
def test_token_output_independent_of_other_tokens(
    num_tokens, row_a, row_b, seed, mode, router, dtype_name
):
    """At a fixed token count, a token's MoE output bits do not depend on its row or on the
    other tokens (hence not on the per-expert counts), in every mode, with padding masked."""
    dtype = DTYPES[dtype_name]
    top_k = 2 if router == "softmax" else 4
    row_a, row_b = row_a % num_tokens, row_b % num_tokens
    gen = torch.Generator().manual_seed(seed)
    token_x = torch.randn(HIDDEN, generator=gen).to(dtype)
    token_logits = torch.randn(NUM_EXPERTS, generator=gen)
    weights = _weights(dtype)

    x_a, logits_a = _batch_with_token(token_x, token_logits, num_tokens, row_a, seed + 1, dtype)
    x_b, logits_b = _batch_with_token(token_x, token_logits, num_tokens, row_b, seed + 2, dtype)
    # batch b also pads some of its other slots, which changes the expert counts further
    mask_b = torch.rand(num_tokens, generator=gen) < 0.7
    mask_b[row_b] = True
    out_a = _moe_layer(x_a, logits_a, weights, router, top_k, mode)
    out_b = _moe_layer(x_b, logits_b, weights, router, top_k, mode, token_mask=mask_b)
    assert_bitwise_equal(out_b[row_b], out_a[row_a], f"token at row {row_a} vs {row_b}, {mode}")


@given(
    num_tokens_a=st.integers(1, 12),
    num_tokens_b=st.sampled_from([1, 2, 15, 16, 17, 33]),
    seed=st.integers(0, 2**63 - 1),
    dtype_name=st.sampled_from(list(DTYPES)),
)
def test_token_output_independent_of_token_count_batch_invariant(
    num_tokens_a, num_tokens_b, seed, dtype_name
):
    """Under batch_invariant, a token's MoE output bits are the same at every token count."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    token_x = torch.randn(HIDDEN, generator=gen).to(dtype)
    token_logits = torch.randn(NUM_EXPERTS, generator=gen)
    weights = _weights(dtype)
    mode = Mode.BATCH_INVARIANT
    x_a, logits_a = _batch_with_token(token_x, token_logits, num_tokens_a, 0, seed + 1, dtype)
    x_b, logits_b = _batch_with_token(
        token_x, token_logits, num_tokens_b, num_tokens_b - 1, seed + 2, dtype)
    out_a = _moe_layer(x_a, logits_a, weights, "softmax", 2, mode)
    out_b = _moe_layer(x_b, logits_b, weights, "softmax", 2, mode)
    assert_bitwise_equal(out_b[-1], out_a[0], f"T={num_tokens_a} vs T={num_tokens_b}")


@pytest.mark.interpreter_only(
    reason="Hopper MMA accumulates a K tile in the same order whatever BLOCK_K (the GEMM's GPU "
    "check measured 0 differing elements)")
@pytest.mark.parametrize("seed", [0, 1])
def test_negative_control_block_k_changes_bits(seed):
    """Negative control: the same batch under two BLOCK_K values differs in some bits, so the
    bitwise checks above can fail (and a count-dependent BLOCK_K would break them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, HIDDEN, generator=gen)
    logits = torch.randn(6, NUM_EXPERTS, generator=gen)
    weights = _weights(torch.float32)
    base = moe_config(6, NUM_EXPERTS, 2, HIDDEN, INTER, torch.float32, Mode.CORUN)
    out_k16 = _moe_layer(x, logits, weights, "softmax", 2, Mode.CORUN,
                         config=MoEConfig(base.block_m, 16, 16))
    out_k32 = _moe_layer(x, logits, weights, "softmax", 2, Mode.CORUN,
                         config=MoEConfig(base.block_m, 16, 32))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(out_k16, out_k32, "BLOCK_K 16 vs 32")


# ----------------------------------------------------------------------------------------------
# with a tuned table: per-T entries for corun/default, one entry for batch_invariant
# ----------------------------------------------------------------------------------------------

# corun's tuned entries change BLOCK_K between the T <= 4 and T > 4 buckets, as a real tuned
# table may; batch_invariant's single entry must keep every T on one reduction order regardless.
_TUNED_SMALL_T = MoEConfig(16, 16, 16, block_h=32)
_TUNED_LARGE_T = MoEConfig(32, 16, 32, block_h=32, down_block_k=16)
_TUNED_FIXED = MoEConfig(16, 32, 32, block_h=32, down_block_n=16, down_block_k=16)


@pytest.fixture(scope="module")
def tuned_table_path(tmp_path_factory):
    shape = {"num_experts": NUM_EXPERTS, "top_k": 2, "hidden": HIDDEN, "intermediate": INTER}
    path = tmp_path_factory.mktemp("tuned") / "moe_h200.json"
    path.write_text(json.dumps({
        "header": {"header": True},
        "entries": [{**shape, "num_tokens": 4, "config": _TUNED_SMALL_T.to_dict()},
                    {**shape, "num_tokens": 64, "config": _TUNED_LARGE_T.to_dict()}],
        "batch_invariant": [{**shape, "config": _TUNED_FIXED.to_dict()}],
    }))
    return path


def _token_at_two_counts(seed, num_tokens_a, num_tokens_b, mode, dtype):
    gen = torch.Generator().manual_seed(seed)
    token_x = torch.randn(HIDDEN, generator=gen).to(dtype)
    token_logits = torch.randn(NUM_EXPERTS, generator=gen)
    weights = _weights(dtype)
    x_a, logits_a = _batch_with_token(token_x, token_logits, num_tokens_a, 0, seed + 1, dtype)
    x_b, logits_b = _batch_with_token(token_x, token_logits, num_tokens_b, num_tokens_b - 1,
                                      seed + 2, dtype)
    out_a = _moe_layer(x_a, logits_a, weights, "softmax", 2, mode)
    out_b = _moe_layer(x_b, logits_b, weights, "softmax", 2, mode)
    return out_a[0], out_b[-1]


@given(
    num_tokens_a=st.integers(1, 4),
    num_tokens_b=st.sampled_from([5, 16, 17, 65]),
    seed=st.integers(0, 2**63 - 1),
    dtype_name=st.sampled_from(["fp16", "bf16"]),
)
def test_tuned_table_keeps_batch_invariant_on_one_config(
    tuned_table_path, num_tokens_a, num_tokens_b, seed, dtype_name
):
    """With a tuned table whose corun buckets differ in BLOCK_K, batch_invariant still gives a
    token the same output bits at every token count.

    At these interpreter shapes fp16/bf16 rounding hides a BLOCK_K change (see the negative
    control below), so the bitwise check alone would pass a policy that took the per-T entries
    at one of the two counts: the config both counts run is checked too."""
    with mock.patch.object(moe_module, "TUNED_PATH", tuned_table_path):
        for num_tokens in (num_tokens_a, num_tokens_b):  # the table is in force, one entry
            for dtype in (torch.float16, torch.bfloat16):
                assert moe_config(num_tokens, NUM_EXPERTS, 2, HIDDEN, INTER, dtype,
                                  Mode.BATCH_INVARIANT) == _TUNED_FIXED, (num_tokens, dtype)
        out_a, out_b = _token_at_two_counts(seed, num_tokens_a, num_tokens_b,
                                            Mode.BATCH_INVARIANT, DTYPES[dtype_name])
    assert_bitwise_equal(out_b, out_a, f"T={num_tokens_a} vs T={num_tokens_b}")


def test_negative_control_tuned_corun_buckets_differ(tuned_table_path):
    """Negative control: with the same table, corun runs different reduction orders (BLOCK_K 16
    vs 32) at T=4 and T=17, so batch_invariant holding one config is not vacuous. That a BLOCK_K
    change flips bits is shown in fp32 by test_negative_control_block_k_changes_bits: at these
    interpreter shapes fp16/bf16 rounding hides it (measured: 0 of 544 elements differ)."""
    with mock.patch.object(moe_module, "TUNED_PATH", tuned_table_path):
        small, large = (moe_config(t, NUM_EXPERTS, 2, HIDDEN, INTER, torch.float16, Mode.CORUN)
                        for t in (4, 17))
        fixed = {moe_config(t, NUM_EXPERTS, 2, HIDDEN, INTER, torch.float16,
                            Mode.BATCH_INVARIANT) for t in (4, 17)}
    assert (small, large) == (_TUNED_SMALL_T, _TUNED_LARGE_T)
    assert small.gate_up_meta()["BLOCK_K"] != large.gate_up_meta()["BLOCK_K"]
    assert fixed == {_TUNED_FIXED}


# ----------------------------------------------------------------------------------------------
# shapes where the literal policies differ across T (the tiny shapes above clamp every mode to one
# config): E=4, k=2, H=I=128. corun/default take BLOCK_K 128 at <= 16 rows per expert (T <= 32) and
# BLOCK_K 64 (BLOCK_M 32) above; batch_invariant keeps (32, 64, 64) at every T.
# ----------------------------------------------------------------------------------------------

WIDE_EXPERTS, WIDE_DIM = 4, 128
CROWD_BIAS = 8.0  # added to expert 0's logit: every token's top-1 expert is 0


def _wide_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4321)
    w13 = torch.randn(WIDE_EXPERTS, 2 * WIDE_DIM, WIDE_DIM, generator=gen) / WIDE_DIM**0.5
    w2 = torch.randn(WIDE_EXPERTS, WIDE_DIM, WIDE_DIM, generator=gen) / WIDE_DIM**0.5
    return w13.to(dtype), w2.to(dtype)


def _crowded_run(token_x, token_logits, num_tokens, row, seed, dtype, mode):
    """The token at ``row`` of a batch whose every token sends its rank-0 pair to expert 0, so
    the token's pair sits at index ``row`` of expert 0's rows (token-major within an expert).
    Returns (the token's output row, its pair's offset inside expert 0's padded rows, block_m)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, WIDE_DIM, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, WIDE_EXPERTS, generator=gen)
    logits[:, 0] += CROWD_BIAS
    x[row], logits[row] = token_x, token_logits
    weights, ids = softmax_topk(logits, 2, True, mode=mode)
    w13, w2 = _wide_weights(dtype)
    out = fused_moe(x, w13, w2, weights, ids, mode=mode)
    config = moe_config(num_tokens, WIDE_EXPERTS, 2, WIDE_DIM, WIDE_DIM, dtype, mode)
    sorted_pairs, _ = moe_align_block_size(ids, WIDE_EXPERTS, config.block_m)
    offset = int((sorted_pairs == row * 2).nonzero())  # expert 0's rows start at 0
    return out[row], offset, config.block_m


def _wide_token(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    token_logits = torch.randn(WIDE_EXPERTS, generator=gen)
    token_logits[0] += CROWD_BIAS
    return torch.randn(WIDE_DIM, generator=gen).to(dtype), token_logits


def _wide_block_k(num_tokens: int, mode: Mode) -> tuple[int, int]:
    config = moe_config(num_tokens, WIDE_EXPERTS, 2, WIDE_DIM, WIDE_DIM, torch.float32, mode)
    return config.gate_up_meta()["BLOCK_K"], config.down_meta()["BLOCK_K"]


# Two token counts across the point where corun/default change BLOCK_K at the wide shape, a row
# of each, a seed and a dtype: what both batch-invariant policies' properties below draw.
_two_token_counts = given(
    num_tokens_a=st.integers(1, 32),
    num_tokens_b=st.integers(34, 72),
    data=st.data(),
    seed=st.integers(0, 2**63 - 1),
    dtype_name=st.sampled_from(list(DTYPES)),
)
_pinned_example = example(num_tokens_a=1, num_tokens_b=40, data=None, seed=0, dtype_name="fp32")


@_two_token_counts
@_pinned_example
def test_batch_invariant_token_bits_equal_where_policies_differ(
    num_tokens_a, num_tokens_b, data, seed, dtype_name
):
    """Under batch_invariant, a token's MoE output bits are the same at a T where corun/default
    would run BLOCK_K 128 and at a T where they run BLOCK_K 64, with its pair in expert 0's first
    BLOCK_M block in one batch and in the second block in the other."""
    dtype = DTYPES[dtype_name]
    assert _wide_block_k(num_tokens_a, Mode.CORUN) != _wide_block_k(num_tokens_b, Mode.CORUN)
    row_a = data.draw(st.integers(0, num_tokens_a - 1)) if data is not None else 0
    row_b = data.draw(st.integers(32, num_tokens_b - 1)) if data is not None else num_tokens_b - 1
    token_x, token_logits = _wide_token(seed, dtype)
    out_a, offset_a, block_m = _crowded_run(token_x, token_logits, num_tokens_a, row_a, seed + 1,
                                            dtype, Mode.BATCH_INVARIANT)
    out_b, offset_b, _ = _crowded_run(token_x, token_logits, num_tokens_b, row_b, seed + 2,
                                      dtype, Mode.BATCH_INVARIANT)
    assert offset_a < block_m <= offset_b  # first block vs second block of expert 0
    assert_bitwise_equal(out_b, out_a, f"T={num_tokens_a} row {row_a} vs T={num_tokens_b} "
                                       f"row {row_b}")


@_two_token_counts
@_pinned_example
def test_batch_invariant_tuned_token_bits_equal_where_its_tiles_differ(
    num_tokens_a, num_tokens_b, data, seed, dtype_name
):
    """batch_invariant_tuned (the literal tiles here: no tuned entry for this shape) takes its
    BLOCK_M by T with BLOCK_K pinned: a token's MoE output bits are the same at two T whose tiles
    differ (and where corun/default would change BLOCK_K)."""
    dtype, mode = DTYPES[dtype_name], Mode.BATCH_INVARIANT_TUNED
    configs = [moe_config(t, WIDE_EXPERTS, 2, WIDE_DIM, WIDE_DIM, dtype, mode)
               for t in (num_tokens_a, num_tokens_b)]
    assert configs[0].block_m != configs[1].block_m, configs  # the tiles follow T
    assert _wide_block_k(num_tokens_a, Mode.CORUN) != _wide_block_k(num_tokens_b, Mode.CORUN)
    row_a = data.draw(st.integers(0, num_tokens_a - 1)) if data is not None else 0
    row_b = data.draw(st.integers(0, num_tokens_b - 1)) if data is not None else num_tokens_b - 1
    token_x, token_logits = _wide_token(seed, dtype)
    out_a, _, _ = _crowded_run(token_x, token_logits, num_tokens_a, row_a, seed + 1, dtype, mode)
    out_b, _, _ = _crowded_run(token_x, token_logits, num_tokens_b, row_b, seed + 2, dtype, mode)
    assert_bitwise_equal(out_b, out_a, f"{mode}: T={num_tokens_a} row {row_a} vs "
                                       f"T={num_tokens_b} row {row_b}")


@pytest.mark.interpreter_only(
    reason="Hopper MMA accumulates a K tile in the same order whatever BLOCK_K (the GEMM's GPU "
    "check measured 0 differing elements), so BLOCK_K 128 vs 64 keeps the bits there")
@pytest.mark.parametrize("mode", [Mode.CORUN, Mode.DEFAULT], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_negative_control_fast_policies_change_token_bits_across_t(mode, seed):
    """Negative control: the same check under corun/default fails at these shapes, since their
    policy runs BLOCK_K 128 at T=8 and 64 at T=48 (corun is deterministic because the engine
    fixes T, not because its kernels ignore it)."""
    assert _wide_block_k(8, mode) == (128, 128) and _wide_block_k(48, mode) == (64, 64)
    token_x, token_logits = _wide_token(seed, torch.float32)
    out_a, _, _ = _crowded_run(token_x, token_logits, 8, 3, seed + 1, torch.float32, mode)
    out_b, _, _ = _crowded_run(token_x, token_logits, 48, 40, seed + 2, torch.float32, mode)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(out_b, out_a, f"{mode}: T=8 vs T=48")


@pytest.mark.parametrize("mode", list(Mode), ids=str)
def test_second_block_pair_keeps_its_bits_at_fixed_t(mode):
    """At a fixed T, a pair deep in expert 0's second BLOCK_M block has the bits it has at the
    block's first row (every mode: the CoRun guarantee at a fixed shape)."""
    token_x, token_logits = _wide_token(7, torch.float32)
    num_tokens = 72
    out_first, first, block_m = _crowded_run(token_x, token_logits, num_tokens, 0, 11,
                                             torch.float32, mode)
    out_deep, deep, _ = _crowded_run(token_x, token_logits, num_tokens, num_tokens - 1, 12,
                                     torch.float32, mode)
    assert first < block_m <= deep
    assert_bitwise_equal(out_deep, out_first, f"{mode}: row 0 vs row {num_tokens - 1}")
