"""Correctness of kernels.gemm against the fp64 reference, its policy, and its argument checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kernels import gemm as gemm_module
from kernels import gemm_tuned
from kernels.gemm import (
    GemmConfig,
    auto_split_k,
    gemm,
    gemm_config,
    load_tuned_table,
    reduce_partials,
    stream_k_pieces,
    stream_k_programs,
    with_row_mask,
)
from kernels.mode import Mode
from kernels.reference import gemm_reference
from kernels.utils import device_card, tma_addressable
from tests.utils import LaunchSpy, assert_bitwise_equal, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
MODES = list(Mode)


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(x, w, b, **kwargs) -> None:
    out = gemm(x, w, b, **kwargs)
    expected = gemm_reference(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    assert_close(out, expected, x.dtype, reduce_dim=x.shape[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 64, 256), (33, 81, 145), (70, 123, 128)],  # split-K decode; 2^k+17 / odd; 123
    ids=["decode-splitk", "odd", "n123"],
)
def test_gemm_matches_reference(m, n, k, mode, dtype):
    _check(*_inputs(m, n, k, dtype, bias=(m == 33)), mode=mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(16, 32, 32, split_k=3),  # uneven split: 5 K blocks -> splits of 2, 2, 1
        GemmConfig(32, 16, 64, split_k=8),  # more splits than K blocks: clamped, none empty
        GemmConfig(16, 16, 32, group_m=2, persistent=True),  # persistent loop over 4 programs
        GemmConfig(64, 64, 16, split_k=2, persistent=True),
    ],
    ids=["split3", "split-clamped", "persistent", "persistent-split"],
)
def test_gemm_explicit_configs(config, dtype):
    _check(*_inputs(37, 48, 145, dtype, seed=1, bias=True), config=config)


# TMA configs: K = 160 keeps every row stride 16-byte aligned in each dtype (the descriptor's
# requirement), and is not a multiple of BLOCK_K 64, so the zero fill past K is exercised.
TMA_CONFIGS = [
    GemmConfig(16, 32, 64, tma=True),
    GemmConfig(32, 16, 32, split_k=3, tma=True),
    GemmConfig(16, 16, 64, group_m=2, persistent=True, tma=True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", TMA_CONFIGS, ids=["plain", "split3", "persistent"])
def test_gemm_tma_configs_match_reference(config, dtype, monkeypatch):
    """Tiles through tensor descriptors (zero-filled past M, N and K) give the reference's result;
    the descriptors are really built, one for x and one for w."""
    built = []
    real = gemm_module.TensorDescriptor.from_tensor
    monkeypatch.setattr(gemm_module.TensorDescriptor, "from_tensor",
                        lambda t, block: built.append(tuple(block)) or real(t, block))
    _check(*_inputs(37, 48, 160, dtype, seed=2, bias=True), config=config)
    assert built == [(config.block_m, config.block_k), (config.block_n, config.block_k)]


# Tail configs: tiles of 32 + 16 columns, N 100 (two whole tiles and a third whose tail lies past
# N); through split-K, persistence, TMA (K 160: 16-byte aligned rows) and masked rows too.
TAIL_CONFIGS = [
    GemmConfig(16, 32, 32, block_n_tail=16),
    GemmConfig(16, 32, 32, split_k=3, block_n_tail=16),
    GemmConfig(16, 32, 32, group_m=2, persistent=True, block_n_tail=16),
    GemmConfig(16, 32, 64, tma=True, block_n_tail=16),
    GemmConfig(16, 32, 32, mask_rows=True, block_n_tail=16),  # M 37: the last row tile masked
]
TAIL_IDS = ["plain", "split3", "persistent", "tma", "mask-rows"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", TAIL_CONFIGS, ids=TAIL_IDS)
def test_gemm_tail_configs_match_reference(config, dtype, monkeypatch):
    """Each program's second, narrower product (block_n_tail) covers the columns after its
    first, bias included; with TMA its tiles come through a descriptor of their own width."""
    built = []
    real = gemm_module.TensorDescriptor.from_tensor
    monkeypatch.setattr(gemm_module.TensorDescriptor, "from_tensor",
                        lambda t, block: built.append(tuple(block)) or real(t, block))
    _check(*_inputs(37, 100, 160, dtype, seed=7, bias=True), config=config)
    assert built == ([(16, 64), (32, 64), (16, 64)] if config.tma else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", TAIL_CONFIGS, ids=TAIL_IDS)
def test_a_tail_keeps_the_bits_of_its_k_walk(config, dtype):
    """A column's bits depend on the K walk (block_k, the splits), not on whether the column
    sits in a tile's first product or its tail: the config without the tail gives the same bits,
    and at the tail config a row keeps its bits from a 5-row batch to a 64-row one."""
    x, w, b = _inputs(64, 100, 160, dtype, seed=8, bias=True)
    plain = dataclasses.replace(config, block_n_tail=0)
    whole = gemm(x, w, b, config=config)
    assert_bitwise_equal(whole, gemm(x, w, b, config=plain))
    assert_bitwise_equal(gemm(x[:5], w, b, config=config), whole[:5])


def test_gemm_config_tail_checks_and_format():
    with pytest.raises(ValueError, match="block_n_tail: expected 0 or below block_n 32"):
        GemmConfig(16, 32, 32, block_n_tail=32)
    with pytest.raises(ValueError, match="block_n_tail: expected a power of two"):
        GemmConfig(16, 32, 32, block_n_tail=24)
    with pytest.raises(ValueError, match="stream-K walks column tiles of block_n"):
        GemmConfig(16, 32, 32, stream_k_programs=4, block_n_tail=16)
    config = GemmConfig(128, 128, 64, num_warps=8, block_n_tail=64)
    assert config.tile_n == 192
    assert config.label == "128 x (128 + 64) x 64, split 1, 8 warps, 3 stages"
    assert config.smem_bytes(2) == (128 + 192) * 64 * 2 * 3
    assert config.to_dict()["block_n_tail"] == 64
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert "block_n_tail" not in GemmConfig(16, 32, 32).to_dict()  # the tables' format


def test_gemm_tma_falls_back_where_a_descriptor_cannot_address():
    """A row stride TMA cannot take (K = 145 fp32: 580 bytes) runs the per-thread loads."""
    x, w, b = _inputs(37, 48, 145, torch.float32, seed=3)
    assert not tma_addressable(x)
    _check(x, w, b, config=GemmConfig(16, 32, 64, tma=True))


@pytest.mark.parametrize("config", TMA_CONFIGS, ids=["plain", "split3", "persistent"])
def test_gemm_tma_rows_keep_their_bits(config):
    """At a fixed config a row's bits depend on its own data only, through descriptors too: the
    rows of a 5-row batch equal those rows of a 64-row batch that holds them at other slots."""
    x, w, _ = _inputs(64, 48, 160, torch.float32, seed=4)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    whole = gemm(x[perm], w, config=config)
    slots = [int((perm == r).nonzero()) for r in range(5)]
    assert_bitwise_equal(gemm(x[:5], w, config=config), whole[slots])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", TMA_CONFIGS, ids=["plain", "split3", "persistent"])
def test_gemm_tma_same_bits_as_pointer_loads(config, dtype):
    """A config gives the same bits whether its tiles come through descriptors or per-thread
    loads, and whether the inputs could be addressed by TMA at all (a view whose base is not
    16-byte aligned falls back): the bits must not depend on where a tensor sits in memory."""
    x, w, _ = _inputs(37, 48, 160, dtype, seed=6)
    plain = gemm(x, w, config=dataclasses.replace(config, tma=False))
    assert_bitwise_equal(gemm(x, w, config=config), plain, "TMA-fed")
    flat = torch.zeros(37 * 160 + 1, dtype=dtype)
    shifted = flat[1:].view(37, 160)  # one element in: the base is 2 or 4 bytes off alignment
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and not tma_addressable(shifted)
    assert_bitwise_equal(gemm(shifted, w, config=config), plain, "fallback")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real bf16 shapes need a GPU")
def test_gemm_tma_same_bits_as_pointer_loads_at_real_shapes_on_gpu():
    for m, n, k in ((128, 4096, 4096), (37, 576, 7168)):
        x, w, _ = _inputs(m, n, k, torch.bfloat16, seed=6)
        for config in (GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
                       GemmConfig(128, 64, 64, split_k=2, num_warps=4, num_stages=4),
                       GemmConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=True)):
            plain = gemm(x.cuda(), w.cuda(), config=config)
            tma = gemm(x.cuda(), w.cuda(), config=dataclasses.replace(config, tma=True))
            assert_bitwise_equal(tma, plain, f"{config} at ({m}, {n}, {k})")


def test_gemm_tma_with_k_zero_gives_zeros():
    """K = 0 (a view with a real row stride) cannot build a descriptor: the pointer path's zeros."""
    x = torch.randn(5, 16)[:, :0]
    out = gemm(x, torch.randn(8, 16)[:, :0], config=GemmConfig(16, 16, 32, tma=True))
    assert out.shape == (5, 8) and torch.count_nonzero(out) == 0


def test_gemm_config_tma_field_round_trips():
    """A TMA config survives the tuned file's dict form; configs without it keep the old form."""
    config = GemmConfig(64, 128, 64, split_k=2, tma=True)
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert "tma" not in GemmConfig(64, 128, 64).to_dict()
    with pytest.raises(ValueError, match="^tma:"):
        GemmConfig(64, 128, 64, tma=1)


MASK_ROWS_CONFIGS = [
    GemmConfig(16, 32, 64),
    GemmConfig(16, 16, 32, split_k=3),
    GemmConfig(32, 16, 64, group_m=2, persistent=True),
    GemmConfig(16, 16, 32, stream_k_programs=4),  # one row tile: M <= 16 only
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", MASK_ROWS_CONFIGS,
                         ids=["plain", "split3", "persistent", "stream-k"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_gemm_masked_rows_keep_the_bits_of_re_read_rows(config, dtype, m, monkeypatch):
    """``mask_rows`` reaches the kernel and only changes what the rows past M load (zeros, not
    row r % M): every real row keeps its bits, at K 128 and at K 150 (zero padding past K). The
    interpreter runs the serial-dot loads; the GPU's loads are the test below's."""
    if config.stream_k_programs and m > config.block_m:
        pytest.skip("stream-K runs one row tile: M <= block_m (kernels.gemm checks it)")
    spy = LaunchSpy(gemm_module._gemm_kernel, "MASK_ROWS")
    monkeypatch.setattr(gemm_module, "_gemm_kernel", spy)
    for k in (128, 150):
        x, w, b = _inputs(m, 48, k, dtype, seed=7, bias=True)
        plain = gemm(x, w, b, config=config)
        masked = gemm(x, w, b, config=dataclasses.replace(config, mask_rows=True))
        assert_bitwise_equal(masked, plain, f"K {k}")
    assert spy.values == [False, True, False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real bf16 shapes need a GPU")
def test_gemm_masked_rows_keep_the_bits_at_real_shapes_on_gpu():
    """The GPU's loads: even K (plain loads) and K 7232 (masked past K), split-K, stream-K."""
    for m, n, k in ((1, 32768, 512), (8, 7168, 2048), (37, 576, 7232)):
        x, w, _ = _inputs(m, n, k, torch.bfloat16, seed=8)
        configs = [GemmConfig(16, 64, 256, num_warps=4, num_stages=3),
                   GemmConfig(16, 64, 128, split_k=4, num_warps=4, num_stages=4),
                   GemmConfig(64, 64, 128, num_warps=4, num_stages=4)]
        if m <= 64:
            configs.append(GemmConfig(64, 64, 128, num_warps=4, num_stages=4,
                                      stream_k_programs=132))
        for config in configs:
            plain = gemm(x.cuda(), w.cuda(), config=config)
            masked = gemm(x.cuda(), w.cuda(), config=dataclasses.replace(config, mask_rows=True))
            assert_bitwise_equal(masked, plain, f"{config} at ({m}, {n}, {k})")


def test_gemm_config_mask_rows_field_round_trips():
    config = GemmConfig(16, 64, 256, mask_rows=True)
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert "mask_rows" not in GemmConfig(16, 64, 256).to_dict()
    with pytest.raises(ValueError, match="^mask_rows:"):
        GemmConfig(16, 64, 256, mask_rows=1)


# Stream-K configs whose column tiles are cut into several pieces at these shapes (asserted).
STREAM_K_CASES = [
    (7, 48, 160, GemmConfig(16, 16, 32, stream_k_programs=4)),  # 3 tiles x 5 K blocks / 4
    (16, 33, 50, GemmConfig(16, 16, 16, stream_k_programs=7)),  # K and N off the tiles
    (3, 64, 256, GemmConfig(16, 32, 64, stream_k_programs=3, tma=True)),
    # More programs than iterations (2 tiles x 3 K blocks, 9 programs): on the H200 the router
    # (N 128) had 32-64 iterations for 132 programs, and the empty programs' unwritten slots
    # were summed (rel err 0.3-12 against cuBLAS) until the launch ran one program an iteration.
    (5, 32, 48, GemmConfig(16, 16, 16, stream_k_programs=9)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m, n, k, config", STREAM_K_CASES,
                         ids=["split-tiles", "ragged", "tma", "programs-past-iterations"])
def test_gemm_stream_k_matches_reference(m, n, k, config, dtype):
    """Stream-K (equal shares of the column-tile x K-block iterations; tiles cut where a share
    ends, their pieces summed in order by the reduce launch) against the fp64 reference, with
    and without bias."""
    assert stream_k_pieces(n, k, config) > 1  # the pieces and the reduce are exercised
    for bias in (False, True):
        inputs = _inputs(m, n, k, dtype, seed=4, bias=bias)
        # A NaN workspace: a slot the reduce sums but no program wrote shows up in the result.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gemm_module.torch, "empty", _nan_empty)
            _check(*inputs, config=config)


_TORCH_EMPTY = torch.empty


def _nan_empty(*args, **kwargs) -> torch.Tensor:
    return _TORCH_EMPTY(*args, **kwargs).fill_(float("nan"))


def test_gemm_stream_k_single_piece_tiles_skip_the_reduce():
    """Shares that end on tile boundaries (6 K blocks x 4 tiles over 4 programs) write the output
    directly: one slot, no workspace, the reference's values."""
    config = GemmConfig(16, 16, 16, stream_k_programs=4)
    assert stream_k_pieces(64, 96, config) == 1
    _check(*_inputs(5, 64, 96, torch.float32, seed=5, bias=True), config=config)


def test_gemm_stream_k_rows_keep_their_bits_at_every_m():
    """A stream-K row's K walk is cut by (N, K, the tiles, the program count) only: a row's bits
    are the same alone, in any batch up to block_m, and in any slot."""
    m, n, k, config = STREAM_K_CASES[0]
    x, w, b = _inputs(16, n, k, torch.float32, seed=6, bias=True)
    full = gemm(x, w, b, config=config)
    assert_bitwise_equal(gemm(x[3:4], w, b, config=config)[0], full[3], "row 3 alone")
    assert_bitwise_equal(gemm(x[:m], w, b, config=config), full[:m], f"first {m} rows")
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    assert_bitwise_equal(gemm(x[perm], w, b, config=config), full[perm], "permuted rows")


@pytest.mark.parametrize("config", [GemmConfig(16, 16, 16, split_k=3),
                                    GemmConfig(16, 16, 32, stream_k_programs=4),
                                    GemmConfig(16, 32, 16, stream_k_programs=7),
                                    GemmConfig(16, 16, 16, stream_k_programs=2)],
                         ids=["split3", "stream4", "stream7", "stream2"])
def test_reduce_partials_sums_each_tiles_pieces_in_slot_order(config):
    """The reduce adds a tile's partials left to right ((p0 + p1) + p2, then the bias) and leaves
    a stream-K tile of one piece (already written by the GEMM) alone: exact, not close."""
    m, n, k = 5, 48, 160
    if config.stream_k_programs:
        slots, programs = stream_k_pieces(n, k, config), stream_k_programs(n, k, config)
        total = -(-n // config.block_n) * -(-k // config.block_k)
        k_blocks = -(-k // config.block_k)

        def pieces(tile: int) -> int:
            first = ((tile * k_blocks + 1) * programs - 1) // total
            return ((tile + 1) * k_blocks * programs - 1) // total - first + 1
    else:
        slots, programs = config.split_k, 0

        def pieces(tile: int) -> int:
            return slots
    assert slots > 1
    gen = torch.Generator().manual_seed(11)
    workspace = torch.randn(slots, m, n, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = torch.full((m, n), 7.0)
    reduce_partials(workspace, bias, out, k, slots, programs, config)
    tile_pieces = [pieces(col // config.block_n) for col in range(n)]
    if config.stream_k_programs == 2:  # 3 tiles x 10 K blocks cut at 15: tiles 0 and 2 whole
        assert tile_pieces[::16] == [1, 2, 1]
    for col in range(n):
        if tile_pieces[col] == 1:
            assert torch.equal(out[:, col], torch.full((m,), 7.0)), f"column {col} rewritten"
            continue
        expected = workspace[0, :, col].clone()
        for slot in range(1, tile_pieces[col]):
            expected = expected + workspace[slot, :, col]
        assert_bitwise_equal(out[:, col], expected + bias[col], f"column {col}")


def test_gemm_stream_k_config_checks():
    config = GemmConfig(64, 128, 64, stream_k_programs=132, tma=True)
    assert GemmConfig.from_dict(config.to_dict()) == config
    assert "stream_k_programs" not in GemmConfig(64, 128, 64).to_dict()
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="^stream_k_programs: expected an int"):
            GemmConfig(64, 128, 64, stream_k_programs=bad)
    for other in ({"split_k": 2}, {"persistent": True}):
        with pytest.raises(ValueError, match="^stream_k_programs: stream-K"):
            GemmConfig(64, 128, 64, stream_k_programs=4, **other)
    x, w, _ = _inputs(17, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="^config: stream-K runs one row tile"):
        gemm(x, w, config=GemmConfig(16, 16, 16, stream_k_programs=2))


def test_gemm_strided_inputs_and_fp32_bias():
    x, w, _ = _inputs(21, 40, 96, torch.float16, seed=2)
    x_t = x.t().contiguous().t()  # column-major view of the same values
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3))
    out = gemm(x_t, w[:, :], bias, config=GemmConfig(16, 32, 32, split_k=2))
    assert_close(out, gemm_reference(x.double(), w.double(), bias.double()), torch.float16, 96)


def test_gemm_empty_and_k_zero():
    x, w, _ = _inputs(0, 8, 16, torch.float32)
    assert gemm(x, w).shape == (0, 8)
    bias = torch.arange(8, dtype=torch.float32)
    out = gemm(torch.empty(3, 0), torch.empty(8, 0), bias)
    assert torch.equal(out, bias.expand(3, 8))


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda x, w, b: (x.to(torch.int32), w, b), "x"),
        (lambda x, w, b: (x, w.to(torch.float16), b), "w"),
        (lambda x, w, b: (x, w[:, :-1], b), "w"),
        (lambda x, w, b: (x[0], w, b), "x"),
        (lambda x, w, b: (x, w.unsqueeze(0), b), "w"),
        (lambda x, w, b: (x, w.to("meta"), b), "w"),
        (lambda x, w, b: (x, w, b[:-1]), "bias"),
        (lambda x, w, b: (x, w, b.view(2, -1)), "bias"),
    ],
    ids=["x-int", "dtype-mismatch", "k-mismatch", "x-1d", "w-3d", "device", "bias-len", "bias-2d"],
)
def test_gemm_rejects_bad_inputs(make, name):
    x, w, b = make(*_inputs(4, 8, 16, torch.float32, bias=True))
    with pytest.raises(ValueError, match=rf"^{name}:"):
        gemm(x, w, b)


def test_gemm_rejects_bad_mode_and_config():
    x, w, _ = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="^mode:"):
        gemm(x, w, mode="fastest")
    with pytest.raises(ValueError, match="^config:"):
        gemm(x, w, config={"block_m": 16})
    with pytest.raises(ValueError, match="^block_m:"):
        GemmConfig(24, 16, 16)
    with pytest.raises(ValueError, match="^num_warps:"):
        GemmConfig(16, 16, 16, num_warps=3)


# ---------------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_batch_invariant_policy_ignores_m(dtype):
    configs = {gemm_config(m, n, k, dtype, Mode.BATCH_INVARIANT)
               for m in (1, 7, 64, 65, 1000, 8192) for n, k in ((64, 256), (4096, 4096))}
    assert len(configs) == 1
    assert next(iter(configs)).split_k == 1


def test_fast_policies_split_k_only_at_small_m(monkeypatch):
    # The CPU-reachable case the default-mode negative control relies on.
    for mode in (Mode.DEFAULT, Mode.CORUN):
        assert gemm_config(1, 64, 256, torch.float32, mode).split_k > 1
        assert gemm_config(64, 64, 256, torch.float32, mode).split_k == 1
    # The literal fallback (no tuned entry) at an H200 decode shape: 4096 outputs in 64-wide
    # tiles = 64 CTAs, split to fill 132 SMs. (The checked-in tuned table may pick otherwise.)
    import kernels.gemm as gemm_module

    monkeypatch.setattr(gemm_module, "_tuned_table",
                        lambda card=None: gemm_module.TunedTable(entries={}))
    assert gemm_config(1, 4096, 4096, torch.bfloat16, Mode.CORUN).split_k >= 2
    assert gemm_config(8192, 4096, 4096, torch.bfloat16, Mode.CORUN).split_k == 1


@pytest.mark.parametrize("table", ["tuned", "fallback"])
def test_m_dependent_policies_mask_the_rows_of_a_part_empty_tile_and_only_there(table,
                                                                              monkeypatch):
    """Rows past M are masked where M < block_m (one part-empty row tile), in the modes whose
    config already follows M; a full tile re-reads nothing, and batch_invariant's config never
    follows M, so it never masks. Both the tuned table's picks and the literal fallback."""
    if table == "fallback":
        monkeypatch.setattr(gemm_module, "_tuned_table",
                            lambda card=None: gemm_module.TunedTable(entries={}))
    gemm_module._gemm_config.cache_clear()
    shapes = ((4096, 4096), (32768, 512), (7168, 2048), (64, 256))
    for mode in (Mode.CORUN, Mode.DEFAULT, Mode.BATCH_INVARIANT_TUNED):
        for m in (1, 5, 8, 16, 32, 64, 128, 8192):
            for n, k in shapes:
                config = gemm_config(m, n, k, torch.bfloat16, mode)
                expected = m < config.block_m and not config.tma
                assert config.mask_rows == expected, (mode, m, n, k, config)
        assert any(gemm_config(1, n, k, torch.bfloat16, mode).mask_rows for n, k in shapes)
    assert not any(gemm_config(m, n, k, torch.bfloat16, Mode.BATCH_INVARIANT).mask_rows
                   for m in (1, 5, 8192) for n, k in shapes)
    gemm_module._gemm_config.cache_clear()


def test_with_row_mask_leaves_tma_tiles_and_full_tiles_alone():
    assert with_row_mask(GemmConfig(16, 64, 256), 1).mask_rows
    assert not with_row_mask(GemmConfig(16, 64, 256), 16).mask_rows
    assert not with_row_mask(GemmConfig(64, 64, 128, tma=True), 8).mask_rows
    assert not with_row_mask(GemmConfig(16, 64, 256, mask_rows=True), 32).mask_rows


def test_auto_split_k_limits():
    assert auto_split_k(1, 64, 256, 16, 64, 64) == 2  # 4 K blocks, 2 per split
    assert auto_split_k(1, 64, 64, 16, 64, 64) == 1  # one K block
    assert auto_split_k(64, 64, 256, 64, 64, 64) == 1  # workspace would rival the weights
    # capped at MAX_SPLIT_K = 16; 56 K blocks in splits of 4 -> 14 splits, none empty
    assert auto_split_k(1, 576, 7168, 16, 64, 128) == 14
    assert auto_split_k(1, 64, 9 * 64, 16, 64, 64) == 3  # 4 requested, 9 blocks -> 3+3+3


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_policy_fits_shared_memory(mode, dtype):
    for m in (1, 8, 32, 64, 128, 256, 512, 2048, 8192):
        for n, k in ((6144, 4096), (576, 7168), (36864, 7168)):
            config = gemm_config(m, n, k, dtype, mode)
            assert config.smem_bytes(dtype.itemsize) <= 200 * 1024, (m, n, k, config)


def test_tuned_table_lookup(tmp_path):
    big = GemmConfig(128, 256, 64, num_warps=8)
    small = GemmConfig(16, 32, 256, split_k=4)
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({
        "header": {"machine": "test"},
        "batch_invariant": GemmConfig(64, 64, 64).to_dict(),
        "entries": [{"m": 2048, "n": 96, "k": 80, "config": big.to_dict()},
                    {"m": 8, "n": 96, "k": 80, "config": small.to_dict()}],
    }))
    table = load_tuned_table(path)
    assert table.batch_invariant == GemmConfig(64, 64, 64)
    assert table.lookup(1, 96, 80, torch.bfloat16) == small
    assert table.lookup(8, 96, 80, torch.float16) == small
    assert table.lookup(9, 96, 80, torch.bfloat16) == big
    assert table.lookup(100000, 96, 80, torch.bfloat16) == big
    assert table.lookup(1, 96, 81, torch.bfloat16) is None  # other shape -> fallback
    assert table.lookup(1, 96, 80, torch.float32) is None  # tuned for 16-bit only
    assert load_tuned_table(tmp_path / "missing.json").entries == {}
    path.write_text('{"entries": [{"m": 1}]}')
    with pytest.raises(ValueError, match="malformed"):
        load_tuned_table(path)


def test_tuned_table_refuses_stream_k_where_it_cannot_run(tmp_path):
    """A stream-K entry must cover every M it serves in one row tile, and never stands as the
    no-split entry (it cuts K where the programs' shares end)."""
    path = tmp_path / "gemm.json"
    stream = GemmConfig(64, 64, 64, stream_k_programs=132)
    for entry, message in (
        ({"m": 128, "n": 96, "k": 80, "config": stream.to_dict()}, "block_m must be >= 128"),
        ({"m": 64, "n": 96, "k": 80, "config": stream.to_dict(),
          "no_split_config": stream.to_dict()}, "cuts K"),
    ):
        path.write_text(json.dumps({"header": {}, "entries": [entry]}))
        with pytest.raises(ValueError, match=message):
            load_tuned_table(path)
    path.write_text(json.dumps({"header": {}, "entries": [
        {"m": 64, "n": 96, "k": 80, "config": stream.to_dict()}]}))
    table = load_tuned_table(path)  # no no-split entry: batch_invariant_tuned falls back
    assert table.lookup(64, 96, 80, torch.bfloat16) == stream
    assert table.lookup(64, 96, 80, torch.bfloat16, no_split=True) is None


def _write_table(path, entries, batch_invariant=None):
    path.write_text(json.dumps({
        "header": {"machine": "test"},
        "batch_invariant": batch_invariant.to_dict() if batch_invariant else None,
        "entries": [{"m": m, "n": n, "k": k, "config": c.to_dict(),
                     **({"no_split_config": ns.to_dict()} if ns else {})}
                    for m, n, k, c, ns in entries]}))
    return path


def test_a_cards_table_replaces_the_base_at_its_points_and_keeps_the_rest(tmp_path):
    """The overlay works point by point: the card's entry at (N, K, M) wins, both the fastest and
    the no-split one; the base's other M of that shape and its other shapes stay; the card's
    portable config only where it has one."""
    base_small, base_mid, base_big = (GemmConfig(16, 64, 128), GemmConfig(64, 128, 64),
                                      GemmConfig(128, 128, 64, num_warps=8))
    card_mid = GemmConfig(128, 64, 64, num_stages=6, tma=True)
    card_split, card_no_split = GemmConfig(64, 64, 64, split_k=4), GemmConfig(64, 64, 128)
    portable = GemmConfig(64, 128, 64, persistent=True)
    base = load_tuned_table(_write_table(tmp_path / "base.json", [
        (8, 96, 80, base_small, None), (128, 96, 80, base_mid, None),
        (2048, 96, 80, base_big, None), (128, 32, 48, base_mid, None)], portable))
    card = load_tuned_table(_write_table(tmp_path / "card.json", [
        (128, 96, 80, card_mid, None), (512, 96, 80, card_split, card_no_split),
        (64, 16, 16, card_mid, None)]))
    table = gemm_module.overlay(base, card)
    bf16 = torch.bfloat16
    assert [table.lookup(m, 96, 80, bf16) for m in (1, 8, 100, 128, 200, 512, 4096)] == [
        base_small, base_small, card_mid, card_mid, card_split, card_split, base_big]
    assert table.lookup(300, 96, 80, bf16, no_split=True) == card_no_split
    assert table.lookup(128, 96, 80, bf16, no_split=True) == card_mid
    assert table.lookup(128, 32, 48, bf16) == base_mid  # a shape the card did not tune
    assert table.lookup(64, 16, 16, bf16) == card_mid  # a shape the base lacks
    assert table.batch_invariant == portable
    own = GemmConfig(128, 128, 64, num_warps=8, persistent=True)
    card_own = dataclasses.replace(card, batch_invariant=own)
    assert gemm_module.overlay(base, card_own).batch_invariant == own


def test_the_policy_reads_the_tensors_cards_table(tmp_path, monkeypatch):
    """``gemm`` asks the policy for its tensors' card (kernels.utils.device_card); the H200's
    table serves a card without a file of its own, and the interpreter (card None)."""
    shape_m, n, k = 4, 32, 48
    base_pick, card_pick = GemmConfig(16, 32, 16), GemmConfig(16, 16, 16, num_stages=2)
    monkeypatch.setattr(gemm_tuned, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(gemm_tuned, "TUNED_PATH", tmp_path / "gemm_h200.json")
    _write_table(tmp_path / "gemm_h200.json", [(8, n, k, base_pick, None)])
    _write_table(tmp_path / "gemm_h100.json", [(8, n, k, card_pick, None)])
    gemm_module._tuned_table.cache_clear()
    try:
        picks = {card: gemm_config(shape_m, n, k, torch.float16, Mode.CORUN, card=card)
                 for card in (None, "h200", "h100", "another-gpu")}
        assert gemm_module.table_files("h100") == [tmp_path / "gemm_h200.json",
                                                   tmp_path / "gemm_h100.json"]
        assert gemm_module.table_files("another-gpu") == gemm_module.table_files(None) == [
            tmp_path / "gemm_h200.json"]
        base, card = (with_row_mask(c, shape_m) for c in (base_pick, card_pick))
        assert picks == {None: base, "h200": base, "h100": card, "another-gpu": base}
        asked = []
        shipped = gemm_module.gemm_config

        def spy(*args, card=None):
            asked.append(card)
            return shipped(*args, card=card)

        monkeypatch.setattr(gemm_module, "gemm_config", spy)
        x, w, _ = _inputs(shape_m, n, k, torch.float32)
        gemm(x, w)
        assert asked == [device_card(x.device)]  # None on the CPU: the interpreter's
    finally:
        gemm_module._tuned_table.cache_clear()


def test_the_committed_h100_table_is_what_the_policy_runs_on_an_h100():
    """Every point of kernels/tuned/gemm_h100.json is the config the corun policy returns there
    on an H100, and the H200's pick where the H100 table has no point (rows past M masked by the
    same rule)."""
    h100 = json.loads(gemm_module.tuned_path("h100").read_text())
    assert h100["entries"] and h100["header"]["machine"].startswith("NVIDIA H100")
    for e in h100["entries"]:
        picked = gemm_config(e["m"], e["n"], e["k"], torch.bfloat16, Mode.CORUN, card="h100")
        assert picked == with_row_mask(GemmConfig.from_dict(e["config"]), e["m"]), e["layer"]
    tuned = {(e["m"], e["n"], e["k"]) for e in h100["entries"]}
    h200 = json.loads(gemm_tuned.TUNED_PATH.read_text())
    for e in h200["entries"]:
        if (e["m"], e["n"], e["k"]) not in tuned:
            assert (gemm_config(e["m"], e["n"], e["k"], torch.bfloat16, Mode.CORUN, card="h100")
                    == gemm_config(e["m"], e["n"], e["k"], torch.bfloat16, Mode.CORUN))


def test_config_label_names_the_tile_cut_depth_and_feed():
    assert GemmConfig(128, 64, 128, num_warps=8, num_stages=3).label == (
        "128 x 64 x 128, split 1, 8 warps, 3 stages")
    assert GemmConfig(128, 128, 64, num_warps=8, num_stages=4, persistent=True, tma=True).label \
        == "128 x 128 x 64, split 1, 8 warps, 4 stages, TMA-fed, persistent"
    assert GemmConfig(128, 64, 64, split_k=1, stream_k_programs=132, tma=True).label.endswith(
        ", TMA-fed, stream-K 132")
