"""Invariances of the torch backend of ``models.ops`` that the CPU engine relies on, bitwise.

Hypothesis draws the batch size T (1..40, with 5..11 pinned: the row counts where this CPU's
fp32 matmul is position-variant), the target's row and the co-rows' seed. ``corun`` must keep a
row's bits at a fixed T whatever its row and the other rows; ``batch_invariant`` at every T too.
Each property has a negative control: the plain op (``default``, or the unfixed torch call) fails
the same check on this CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import reference as ref
from kernels.mode import Mode
from kernels.rope import build_rope_cache
from models import ops
from models.forward_batch import OpsConfig
from tests.utils import assert_bitwise_equal

OPS = {mode: OpsConfig(mode=mode, backend="torch") for mode in Mode}
DETERMINISTIC = [Mode.CORUN, Mode.BATCH_INVARIANT]
# tests/ does not load the invariance_tests profiles: few examples, no deadline (shared CPU).
FEW = settings(max_examples=15, deadline=None, derandomize=True)
MAX_T = 40


def _plain_matmul_keeps_row_bits(num_rows: int) -> bool:
    """Whether this CPU's plain fp32 matmul gives the last of ``num_rows`` rows the bits of row 0
    for the same input row (2 threads). The position variance the padded path exists for was
    measured on AVX-512 and on AVX2 hosts (M 5..11 in both); another host's BLAS may pick kernels
    that keep the bits, and a negative control has then nothing to show (it says so and skips
    rather than fail): the probe decides, not the CPU's name."""
    gen = torch.Generator().manual_seed(7)
    w, target = torch.randn(96, 64, generator=gen), torch.randn(64, generator=gen)
    x = torch.randn(num_rows, 64, generator=gen)
    first, last = x.clone(), x.clone()
    first[0], last[-1] = target, target
    with two_threads():
        return torch.equal(F.linear(first, w)[0], F.linear(last, w)[-1])


@contextlib.contextmanager
def two_threads():
    """The matmul measurements hold at >= 2 intra-op threads (at 1, M 5..11 are invariant)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rows_with_target(num_rows: int, width: int, row: int, seed: int, target: torch.Tensor,
                      scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, width, generator=gen) * scale
    x[row] = target
    return x


def _target(width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed ^ 0x7A59)) * scale


def _draw_t_and_row(data, max_t: int = MAX_T) -> tuple[int, int]:
    t = data.draw(st.one_of(st.integers(5, 11), st.integers(1, max_t)), label="T")
    return t, data.draw(st.integers(0, t - 1), label="row")


# ----------------------------------------------------------------------------------------------
# linear (and the LM head, routers' gates, expert GEMMs built on it)
# ----------------------------------------------------------------------------------------------

LINEAR_SHAPES = [(64, 96), (7, 33), (64, 8), (5, 8)]  # (K, N): model-like and odd ones


@FEW
@given(mode=st.sampled_from(DETERMINISTIC), shape=st.sampled_from(LINEAR_SHAPES),
       data=st.data(), seed=st.integers(0, 2**63 - 1))
@example(mode=Mode.CORUN, shape=(64, 96), data=None, seed=0)
def test_linear_row_bits_independent_of_row_and_co_rows(mode, shape, data, seed):
    """At a fixed T, a row's linear output bits do not depend on its row or the other rows."""
    t, row = _draw_t_and_row(data) if data is not None else (7, 6)
    k, n = shape
    target, w = _target(k, seed), torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    with two_threads():
        first = ops.linear(_rows_with_target(t, k, 0, seed + 1, target), w, OPS[mode])[0]
        there = ops.linear(_rows_with_target(t, k, row, seed + 2, target), w, OPS[mode])[row]
    assert_bitwise_equal(there, first, f"{mode} T={t} row {row} (K, N)={shape}")


@FEW
@given(shape=st.sampled_from(LINEAR_SHAPES), data=st.data(), seed=st.integers(0, 2**63 - 1))
@example(shape=(64, 96), data=None, seed=0)
def test_linear_batch_invariant_row_bits_equal_for_every_t(shape, data, seed):
    """Under batch_invariant, a row's linear output bits are the same at every T and row."""
    t, row = _draw_t_and_row(data) if data is not None else (9, 8)
    k, n = shape
    target, w = _target(k, seed), torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    with two_threads():
        alone = ops.linear(target.view(1, -1), w, OPS[Mode.BATCH_INVARIANT])[0]
        among = ops.linear(_rows_with_target(t, k, row, seed + 1, target), w,
                           OPS[Mode.BATCH_INVARIANT])[row]
    assert_bitwise_equal(among, alone, f"T=1 vs T={t} row {row} (K, N)={shape}")


@pytest.mark.parametrize("num_rows", [5, 6, 7, 9, 10, 11])
def test_plain_linear_is_position_variant_negative_control(num_rows):
    """The check above fails for the plain matmul (default mode) at T 5..11: the last row gets
    other bits than row 0 for the same input row, while corun's padded product keeps them."""
    if _plain_matmul_keeps_row_bits(num_rows):
        pytest.skip(f"this CPU's plain matmul keeps row bits at M={num_rows}: no position "
                    "variance for the padded path to remove here")
    target, w = _target(64, 0), torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    last = num_rows - 1
    x_first = _rows_with_target(num_rows, 64, 0, 1, target)
    x_last = _rows_with_target(num_rows, 64, last, 2, target)
    with two_threads():
        assert not torch.equal(ops.linear(x_last, w, OPS[Mode.DEFAULT])[last],
                               ops.linear(x_first, w, OPS[Mode.DEFAULT])[0])
        assert torch.equal(ops.linear(x_last, w, OPS[Mode.CORUN])[last],
                           ops.linear(x_first, w, OPS[Mode.CORUN])[0])


def test_plain_linear_is_batch_variant_negative_control():
    """The batch-invariance check fails for a plain matmul: row 0 differs between T=1 and 40."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(MAX_T, 64, generator=gen), torch.randn(96, 64, generator=gen)
    assert not torch.equal(ops.linear(x[:1], w, OPS[Mode.DEFAULT])[0],
                           ops.linear(x, w, OPS[Mode.DEFAULT])[0])


@FEW
@given(data=st.data(), seed=st.integers(0, 2**63 - 1), mode=st.sampled_from(DETERMINISTIC))
def test_bmm_row_bits(data, seed, mode):
    """MLA's per-head products: at a fixed T a row's bits do not depend on its row; under
    batch_invariant not on T either."""
    t, row = _draw_t_and_row(data)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(4, 32, 16, generator=gen)
    target = torch.randn(4, 16, generator=gen)
    x = torch.randn(4, t, 16, generator=gen)
    x[:, row] = target
    among = ops.bmm(x, weight, OPS[mode])[:, row]
    if mode is Mode.BATCH_INVARIANT:
        base = ops.bmm(target.unsqueeze(1), weight, OPS[mode])[:, 0]
    else:
        x0 = torch.randn(4, t, 16, generator=gen)
        x0[:, 0] = target
        base = ops.bmm(x0, weight, OPS[mode])[:, 0]
    assert_bitwise_equal(among, base, f"{mode} T={t} row {row}")


def test_plain_bmm_is_batch_variant_negative_control():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(4, 12, 16, generator=gen), torch.randn(4, 32, 16, generator=gen)
    assert not torch.equal(ops.bmm(x[:, :1], weight, OPS[Mode.DEFAULT])[:, 0],
                           ops.bmm(x, weight, OPS[Mode.DEFAULT])[:, 0])


# ----------------------------------------------------------------------------------------------
# routers and row-wise ops
# ----------------------------------------------------------------------------------------------

EXPERTS = 8  # tiny-deepseek-v3's: [T, 8] is all SIMD tail at T = 1 and mostly body at T >= 4
ROUTER_TARGETS = 16  # sigmoid's body and tail disagree on ~3.5% of fp32 inputs: try several


def _routing(router: str, logits: torch.Tensor, mode: Mode) -> torch.Tensor:
    if router == "grouped":
        bias = torch.linspace(0.0, 0.1, EXPERTS)
        weights, ids = ops.grouped_topk(logits, bias, 2, 4, 2, True, 2.5, OPS[mode])
    else:
        weights, ids = ops.softmax_topk(logits, 2, True, OPS[mode])
    return torch.cat([weights, ids.to(torch.float32)], dim=-1)


@FEW
@given(num_tokens=st.one_of(st.integers(5, 11), st.integers(1, MAX_T)),
       seed=st.integers(0, 2**63 - 1), mode=st.sampled_from(list(Mode)),
       router=st.sampled_from(["grouped", "softmax"]))
# a token whose DeepSeek routing weight changed between T=5 and alone with a plain sigmoid
@example(num_tokens=5, seed=15, mode=Mode.BATCH_INVARIANT, router="grouped")
def test_routing_bits_independent_of_t_and_row(num_tokens, seed, mode, router):
    """Every token's routing weights and ids have the same bits alone as in a batch of T, at its
    row, in every mode (routing is per token; DeepSeek's sigmoid through elementwise_fixed_path).
    """
    logits = torch.randn(num_tokens, EXPERTS, generator=torch.Generator().manual_seed(seed)) * 2
    together = _routing(router, logits, mode)
    for row in range(num_tokens):
        alone = _routing(router, logits[row : row + 1], mode)[0]
        assert_bitwise_equal(together[row], alone, f"{router} {mode} T={num_tokens} row {row}")


def test_plain_sigmoid_is_batch_variant_negative_control():
    """The check above fails for the unfixed router math: torch.sigmoid over [T, 8] gives some
    token other bits alone (8 values: all scalar tail) than at row 0 of T=5 (the SIMD body),
    while elementwise_fixed_path gives the same bits both ways."""
    changed = 0
    for target_seed in range(4 * ROUTER_TARGETS):
        target = _target(EXPERTS, target_seed, scale=2.0)
        batch = _rows_with_target(5, EXPERTS, 0, 0, target, 2.0)
        changed += not torch.equal(torch.sigmoid(batch)[0], torch.sigmoid(target.view(1, -1))[0])
        assert torch.equal(ref.elementwise_fixed_path(torch.sigmoid, batch)[0],
                           ref.elementwise_fixed_path(torch.sigmoid, target.view(1, -1))[0])
    assert changed > 0


@FEW
@given(data=st.data(), seed=st.integers(0, 2**63 - 1), mode=st.sampled_from(list(Mode)),
       width=st.sampled_from([40, 64, 145]))
def test_row_ops_bits_independent_of_t_and_row(data, seed, mode, width):
    """rmsnorm (with and without residual), silu_mul and rope: a row's bits are the same alone
    and at any row of any T (they are per row; silu through elementwise_fixed_path)."""
    t, row = _draw_t_and_row(data)
    o = OPS[mode]
    weight = 1 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(3))
    target, target_res = _target(2 * width, seed, 3.0), _target(width, seed + 1)
    x = _rows_with_target(t, 2 * width, row, seed + 2, target, 3.0)
    res = _rows_with_target(t, width, row, seed + 3, target_res)
    one, one_res = target.view(1, -1), target_res.view(1, -1)
    pairs = [
        (ops.silu_mul(x, o)[row], ops.silu_mul(one, o)[0]),
        (ops.rmsnorm(x[:, :width], weight, 1e-6, o)[row],
         ops.rmsnorm(one[:, :width], weight, 1e-6, o)[0]),
        (torch.cat(ops.rmsnorm(x[:, :width], weight, 1e-6, o, res), -1)[row],
         torch.cat(ops.rmsnorm(one[:, :width], weight, 1e-6, o, one_res), -1)[0]),
    ]
    cache = build_rope_cache(16, 64, 10000.0)
    positions = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(seed % 2**32))
    positions[row] = 17
    q, k = x[:, :64].reshape(t, 4, 16), x[:, 64:80].reshape(t, 1, 16)
    for is_neox in (True, False):
        q_out, k_out = ops.rope(q, k, positions, cache, is_neox, o)
        q_one, k_one = ops.rope(q[row : row + 1], k[row : row + 1], positions[row : row + 1],
                                cache, is_neox, o)
        pairs.append((torch.cat([q_out[row], k_out[row]]), torch.cat([q_one[0], k_one[0]])))
    for i, (among, alone) in enumerate(pairs):
        assert_bitwise_equal(among, alone, f"op {i}, {mode} T={t} row {row} width {width}")


def test_plain_silu_is_batch_variant_negative_control():
    """The silu part of the check above fails for a plain F.silu over the [T, I] buffer."""
    changed = 0
    for target_seed in range(8):
        target = _target(40, target_seed, 3.0)
        changed += not torch.equal(F.silu(_rows_with_target(7, 40, 0, 0, target, 3.0))[0],
                                   F.silu(target.view(1, -1))[0])
    assert changed > 0


# ----------------------------------------------------------------------------------------------
# fused_moe
# ----------------------------------------------------------------------------------------------


def _moe_inputs(seed: int, num_tokens: int):
    gen = torch.Generator().manual_seed(seed)
    experts, hidden, inter = 4, 32, 16
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, experts, generator=gen)
    return x, w13, w2, logits


@FEW
@given(data=st.data(), seed=st.integers(0, 2**63 - 1), mode=st.sampled_from(DETERMINISTIC))
def test_fused_moe_token_independent_of_co_tokens(data, seed, mode):
    """A token's MoE output is the same alone as at any row among T other tokens, under corun
    and batch_invariant (the expert GEMMs run 16-row tiles: an expert's row count depends on the
    other tokens' routing)."""
    t, row = _draw_t_and_row(data)
    x, w13, w2, logits = _moe_inputs(seed, t)
    weights, ids = ops.softmax_topk(logits, 2, True, OPS[mode])
    together = ops.fused_moe(x, w13, w2, weights, ids, OPS[mode])
    alone = ops.fused_moe(x[row : row + 1], w13, w2, weights[row : row + 1],
                          ids[row : row + 1], OPS[mode])
    assert_bitwise_equal(together[row], alone[0], f"{mode} T={t} row {row}")


def test_fused_moe_default_depends_on_co_tokens_negative_control():
    """The check above can fail: under default the expert GEMM's M is the expert's token count."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen)
    w13, w2 = torch.randn(1, 64, 64, generator=gen), torch.randn(1, 64, 32, generator=gen)
    weights, ids = torch.ones(16, 1), torch.zeros(16, 1, dtype=torch.int32)
    together = ops.fused_moe(x, w13, w2, weights, ids, OPS[Mode.DEFAULT])
    alone = ops.fused_moe(x[:1], w13, w2, weights[:1], ids[:1], OPS[Mode.DEFAULT])
    assert not torch.equal(together[0], alone[0])


# ----------------------------------------------------------------------------------------------
# one decode step of a tiny model: B and the target's slot drawn
# ----------------------------------------------------------------------------------------------

BLOCK_SIZE, BLOCKS_PER_SEQ = 4, 4
MAX_SEQ_LEN = BLOCK_SIZE * BLOCKS_PER_SEQ
TARGET_LEN = 11  # the target's context length (new token included)
_MODELS: dict[str, tuple] = {}


def _model(name: str):
    if name not in _MODELS:
        from models import build_model

        _MODELS[name] = build_model(name, dtype=torch.float32, device="cpu", seed=7)
    return _MODELS[name]


def _decode_logits(name: str, mode: Mode, batch_size: int, slot: int, seed: int,
                   target: int = 0) -> torch.Tensor:
    """Logits of target sequence ``target`` decoding in ``slot`` of a step of ``batch_size``
    sequences; the co-runners' caches, lengths and tokens come from ``seed``. Each sequence owns
    BLOCKS_PER_SEQ blocks (the target's hold the same values in every call)."""
    from models.forward_batch import ForwardBatch, KVCache

    model, config = _model(name)
    cache = KVCache(model.kv_cache_spec(), batch_size * BLOCKS_PER_SEQ, BLOCK_SIZE,
                    torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen) * 0.5)
    block_dim = 2 if model.kv_cache_spec().kind == "mha" else 1
    target_blocks = torch.arange(slot * BLOCKS_PER_SEQ, (slot + 1) * BLOCKS_PER_SEQ)
    view = cache.storage.movedim(block_dim, 0)
    target_gen = torch.Generator().manual_seed(1000 + target)
    view[target_blocks] = torch.randn(view[target_blocks].shape, generator=target_gen) * 0.5
    tables = torch.arange(batch_size * BLOCKS_PER_SEQ, dtype=torch.int32).view(batch_size, -1)
    lens = torch.randint(1, MAX_SEQ_LEN + 1, (batch_size,), generator=gen, dtype=torch.int32)
    tokens = torch.randint(0, config.vocab_size, (batch_size,), generator=gen)
    lens[slot] = TARGET_LEN
    tokens[slot] = int(torch.randint(0, config.vocab_size, (1,), generator=target_gen))
    positions = lens.long() - 1
    slots = tables[torch.arange(batch_size), positions // BLOCK_SIZE].long() * BLOCK_SIZE
    batch = ForwardBatch(
        is_prefill=False, positions=positions, slot_mapping=slots + positions % BLOCK_SIZE,
        block_tables=tables, kv_cache=cache, ops=OPS[mode], seq_lens=lens,
        max_seq_len=MAX_SEQ_LEN, token_mask=torch.ones(batch_size, dtype=torch.bool))
    with torch.no_grad():
        return model.compute_logits(model(tokens, batch), OPS[mode])[slot]


MODEL_NAMES = ["tiny-qwen3", "tiny-deepseek-v3"]


DECODE_CASES = dict(
    name=st.sampled_from(MODEL_NAMES), batch_size=st.one_of(st.integers(5, 11), st.integers(1, 12)),
    slot=st.integers(0, 11), seed=st.integers(0, 2**32 - 1), target=st.integers(0, 2**16))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(**DECODE_CASES)
@example(name="tiny-deepseek-v3", batch_size=7, slot=6, seed=0, target=0)
def test_corun_decode_logits_independent_of_slot_and_co_runners(name, batch_size, slot, seed,
                                                                target):
    """corun decodes at a fixed B: the target's logits have the same bits in slot 0 and in any
    other slot, beside any co-runners (the B = 5..11 slots >= 4 where a plain matmul fails)."""
    slot %= batch_size
    with two_threads():
        first = _decode_logits(name, Mode.CORUN, batch_size, 0, seed, target)
        there = _decode_logits(name, Mode.CORUN, batch_size, slot, seed + 1, target)
    assert_bitwise_equal(there, first, f"{name} B={batch_size} slot {slot}")


@settings(max_examples=8, deadline=None, derandomize=True)
@given(**DECODE_CASES)
# a target whose DeepSeek routing weight changed beside 5 co-runners with a plain sigmoid
@example(name="tiny-deepseek-v3", batch_size=6, slot=2, seed=0, target=33)
def test_batch_invariant_decode_logits_independent_of_batch_size(name, batch_size, slot, seed,
                                                                 target):
    """batch_invariant: the target's logits have the same bits alone and in any slot of a step
    of B sequences (the co-runner count drawn)."""
    slot %= batch_size
    with two_threads():
        alone = _decode_logits(name, Mode.BATCH_INVARIANT, 1, 0, seed, target)
        among = _decode_logits(name, Mode.BATCH_INVARIANT, batch_size, slot, seed + 1, target)
    assert_bitwise_equal(among, alone, f"{name} B=1 vs B={batch_size} slot {slot}")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_default_decode_logits_depend_on_slot_negative_control(name):
    """The checks above can fail: under default (plain matmuls) the target's logits at B=7 in
    slot 6 differ from slot 0 (on a CPU whose plain matmul is position-variant at M=7), and
    alone from B=7 (gemv vs gemm, on every CPU measured)."""
    with two_threads():
        first = _decode_logits(name, Mode.DEFAULT, 7, 0, 0)
        last = _decode_logits(name, Mode.DEFAULT, 7, 6, 1)
        alone = _decode_logits(name, Mode.DEFAULT, 1, 0, 0)
    if not _plain_matmul_keeps_row_bits(7):
        assert not torch.equal(last, first)
    assert not torch.equal(alone, first)
