"""Correctness of kernels/mla.py against fp64 references (kernels/reference.py and a local
expanded-attention reference for prefill), plus argument validation and the config policies."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kernels import mla as mla_module
from kernels.kv_store import store_mla_kv
from kernels.mla import (
    MLATile,
    MLATunedTable,
    load_mla_tuned,
    mla_decode,
    mla_decode_config,
    mla_prefill_attention,
    mla_prefill_config,
)
from kernels.mode import Mode
from kernels.reference import mla_decode_reference, store_mla_kv_reference
from kernels.utils import tma_addressable
from tests.utils import LaunchSpy, assert_bitwise_equal, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# Launchers check tensor *contents* (lengths, slots) only for CPU tensors: on a GPU that would
# sync with the host on every call and break CUDA-graph capture.
VALUE_CHECKS_CPU_ONLY = pytest.mark.interpreter_only(
    reason="value checks read tensor contents, which launchers do only for CPU tensors")


def mla_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per sequence: softmax(scale q k^T, bottom-right causal) v, in q's dtype (fp64 for fp64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].to(acc)
        kb, vb = k[cu_k[b] : cu_k[b + 1]].to(acc), v[cu_k[b] : cu_k[b + 1]].to(acc)
        q_len, k_len = qb.shape[0], kb.shape[0]
        q_pos = torch.arange(k_len - q_len, k_len).view(1, -1, 1)
        scores = torch.einsum("lhd,shd->hls", qb, kb) * scale
        scores = scores.masked_fill(torch.arange(k_len).view(1, 1, -1) > q_pos, float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hls,shd->lhd", scores.softmax(-1), vb).to(
            q.dtype
        )
    return out


def make_decode_inputs(
    seq_lens: list[int], num_heads: int, latent_dim: int, rope_dim: int, block_size: int,
    max_blocks: int, dtype: torch.dtype, seed: int = 0,
):  # fmt: skip
    """Random q and a random paged cache; every sequence's blocks are a disjoint random subset."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    num_blocks = batch * max_blocks + 1
    cache = torch.randn(num_blocks, block_size, latent_dim + rope_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    block_tables = perm.view(batch, max_blocks).to(torch.int32)
    q_latent = torch.randn(batch, num_heads, latent_dim, generator=gen).to(dtype)
    q_pe = torch.randn(batch, num_heads, rope_dim, generator=gen).to(dtype)
    return q_latent, q_pe, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_store_mla_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(7, 32, generator=gen).to(dtype)
    k_pe = torch.randn(7, 16, generator=gen).to(dtype)
    cache = torch.randn(5, 4, 48, generator=gen).to(dtype)
    expected = cache.clone()
    slots = torch.tensor([3, -1, 19, 0, 7, -1, 12], dtype=torch.int64)
    store_mla_kv(latent, k_pe, cache, slots)
    store_mla_kv_reference(latent, k_pe, expected, slots)
    assert_bitwise_equal(cache, expected, "store_mla_kv")


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------

DECODE_CASES = [
    # (seq_lens, heads, latent_dim, rope_dim, block_size, split_size)
    pytest.param([40, 0, 64, 17], 4, 32, 16, 16, 16, id="tiny-H4-L32-R16"),
    pytest.param([1, 33, 100], 20, 32, 16, 8, 32, id="H20-odd-lens-bs8"),
    pytest.param([300, 0], 2, 512, 64, 64, 256, id="v3-dims-H2"),
]


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seq_lens,heads,latent_dim,rope_dim,block_size,split_size", DECODE_CASES)
def test_mla_decode_matches_reference(
    seq_lens, heads, latent_dim, rope_dim, block_size, split_size, dtype, mode
) -> None:
    max_blocks = -(-max(seq_lens) // block_size) + 1
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, heads, latent_dim, rope_dim, block_size, max_blocks, dtype
    )
    scale = (latent_dim + rope_dim) ** -0.5
    max_seq_len = max(seq_lens) if mode == Mode.DEFAULT else max_blocks * block_size
    out = mla_decode(
        q_latent, q_pe, cache, tables, lens, scale,
        max_seq_len=max_seq_len, mode=mode, split_size=split_size,
    )  # fmt: skip
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, scale
    )
    assert_close(out, expected, dtype, reduce_dim=latent_dim + rope_dim)
    for b, length in enumerate(seq_lens):
        if length == 0:  # a padded dummy slot gives exact zeros
            assert torch.count_nonzero(out[b]) == 0


def test_mla_decode_scale_of_deepseek_v3() -> None:
    """The V3 softmax scale 192^-0.5 * mscale^2 = 0.1352338 (notes C.4) at the real head dims."""
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        [70], 1, 512, 64, 64, 2, torch.float32, seed=3
    )
    out = mla_decode(q_latent, q_pe, cache, tables, lens, 0.1352338, max_seq_len=128)
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, 0.1352338
    )
    assert_close(out, expected, torch.float32, reduce_dim=576)


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
@pytest.mark.parametrize(
    "tile",
    [MLATile(32, 16, num_warps=4, num_stages=1), MLATile(64, 32, num_warps=8, num_stages=2),
     MLATile(64, 32, num_warps=8, num_stages=2, dv_parts=2),
     MLATile(16, 16, num_warps=4, num_stages=3, dv_parts=2)],
    ids=["H32-N16", "H64-N32", "H64-N32-dv2", "H16-N16-dv2"],
)
def test_mla_decode_tiles_match_reference(tile: MLATile, mode: Mode) -> None:
    """Every tunable BLOCK_H (more heads than a block, a partial head block) and value split
    stays correct, the padded dummy slot included."""
    seq_lens, heads = [50, 0, 23], 40
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, heads, 32, 16, 16, 5, torch.float32, seed=4
    )
    max_seq_len = max(seq_lens) if mode == Mode.DEFAULT else 80
    out = mla_decode(
        q_latent, q_pe, cache, tables, lens, 0.2,
        max_seq_len=max_seq_len, mode=mode, split_size=16, tile=tile,
    )  # fmt: skip
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, 0.2
    )
    assert_close(out, expected, torch.float32, reduce_dim=48)
    assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
@pytest.mark.parametrize("dv_parts", [2, 4])
def test_mla_decode_value_parts_match_reference(dv_parts: int, mode: Mode) -> None:
    """Output columns split over 2 or 4 programs, on the direct (one split) and the partial +
    combine paths: each part writes only its own columns, part 0 the log-sum-exp. (Their bits
    may differ from one part's: the interpreter's dot regroups with the tile width.)"""
    seq_lens, heads = [70, 9, 0, 33], 20
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, heads, 64, 16, 16, 6, torch.float32, seed=5
    )
    max_seq_len = max(seq_lens) if mode == Mode.DEFAULT else 96
    out = mla_decode(
        q_latent, q_pe, cache, tables, lens, 0.2, max_seq_len=max_seq_len, mode=mode,
        split_size=32, tile=MLATile(16, 16, num_warps=4, num_stages=2, dv_parts=dv_parts),
    )  # fmt: skip
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, 0.2
    )
    assert_close(out, expected, torch.float32, reduce_dim=80)
    assert torch.count_nonzero(out[2]) == 0


def test_mla_decode_config_policy() -> None:
    """corun / batch_invariant read neither the batch nor the contents; default fills the SMs."""
    args = (128, 512, 64, 16384, torch.bfloat16)
    for mode in (Mode.CORUN, Mode.BATCH_INVARIANT):
        configs = {mla_decode_config(b, *args, mode) for b in (1, 8, 64, 128)}
        assert len(configs) == 1
        (cfg,) = configs
        assert cfg.is_fixed_split and cfg.num_splits == 16384 // 256 and cfg.block_h >= 16
    small = mla_decode_config(1, *args, Mode.DEFAULT)
    large = mla_decode_config(128, *args, Mode.DEFAULT)
    assert not small.is_fixed_split and small.num_splits > large.num_splits >= 1


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # (q_lens, k_lens, heads, qk_dim, v_dim)
    pytest.param([5, 33, 1], [5, 70, 9], 4, 24, 16, id="Dqk24=16+8-Dv16-chunked"),
    pytest.param([40, 0, 17], [40, 3, 17], 3, 32, 16, id="Dqk32-pow2-empty-chunk"),
    pytest.param([65], [130], 2, 48, 32, id="Dqk48=32+16-Dv32"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("q_lens,k_lens,heads,qk_dim,v_dim", PREFILL_CASES)
def test_mla_prefill_attention_matches_reference(
    q_lens, k_lens, heads, qk_dim, v_dim, dtype
) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), heads, qk_dim, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), heads, qk_dim, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), heads, v_dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = qk_dim**-0.5
    out = mla_prefill_attention(q, k, v, cu_q, cu_k, scale, max_q_len=max(q_lens))
    expected = mla_prefill_reference(q.double(), k.double(), v.double(), cu_q, cu_k, scale)
    assert_close(out, expected, dtype, reduce_dim=qk_dim)


def test_mla_prefill_config_is_shape_only() -> None:
    """192 = 128 + 64 parts, Dv 128; the same config in every mode (no batch or length input)."""
    configs = {mla_prefill_config(192, 128, torch.bfloat16, mode) for mode in Mode}
    assert len(configs) == 1
    (cfg,) = configs
    assert (cfg.block_d1, cfg.block_d2, cfg.block_dv) == (128, 64, 128)
    assert mla_prefill_config(128, 128, torch.bfloat16, Mode.CORUN).block_d2 == 0


# ----------------------------------------------------------------------------------------------
# tuned table (kernels/tuned/mla_h200.json, written by experiments/tune_mla.py)
# ----------------------------------------------------------------------------------------------

V3 = {"heads": 128, "latent": 512, "rope": 64}


def _tile(block_m: int, block_n: int, warps: int = 8, stages: int = 2) -> dict:
    return {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}


def _write_table(path, entries) -> None:
    path.write_text(json.dumps({"header": {"header": True}, "entries": entries}))


@pytest.fixture
def tuned_table(tmp_path) -> MLATunedTable:
    path = tmp_path / "mla_h200.json"
    _write_table(path, [
        {**V3, "kind": "decode_fixed", "split_size": 256, "ctx": 4096, "config": _tile(64, 32)},
        {**V3, "kind": "decode_fixed", "split_size": 256, "ctx": 16384, "config": _tile(32, 64)},
        {**V3, "kind": "decode_default", "batch": 8, "ctx": 4096, "config": _tile(16, 64, 4)},
        {**V3, "kind": "decode_default", "batch": 128, "ctx": 4096, "config": _tile(64, 16)},
        {"kind": "prefill", "qk_dim": 192, "v_dim": 128, "config": _tile(64, 128, 4, 3)},
    ])  # fmt: skip
    return load_mla_tuned(path)


def test_tuned_decode_lookup_fixed_split_ignores_batch(tuned_table: MLATunedTable) -> None:
    """corun / batch_invariant: the entry for (dims, split_size) at the smallest tuned context >=
    max_seq_len, the same tile for every batch; the split count stays ceil(len / split_size)."""
    for mode in (Mode.CORUN, Mode.BATCH_INVARIANT):
        for batch in (1, 7, 128, 1000):
            cfg = mla_decode_config(batch, 128, 512, 64, 3000, torch.bfloat16, mode, 256,
                                    table=tuned_table)  # fmt: skip
            assert (cfg.block_h, cfg.block_n, cfg.num_warps) == (64, 32, 8)
            assert cfg.is_fixed_split and cfg.num_splits == -(-3000 // 256)
        big = mla_decode_config(1, 128, 512, 64, 10000, torch.float16, mode, 256, table=tuned_table)
        assert (big.block_h, big.block_n, big.num_splits) == (32, 64, -(-10000 // 256))
        past = mla_decode_config(
            1, 128, 512, 64, 99999, torch.float16, mode, 256, table=tuned_table
        )
        assert (past.block_h, past.block_n) == (32, 64)  # past the end: the largest tuned context
    # An untuned split size, fp32, or other dims fall back to the literal tile.
    literal = mla_decode_config(1, 128, 512, 64, 3000, torch.bfloat16, Mode.CORUN, 256,
                                table=MLATunedTable({}, {}, {}))  # fmt: skip
    for args in ((128, 512, 64, 3000, torch.bfloat16, Mode.CORUN, 1024),
                 (128, 512, 64, 3000, torch.float32, Mode.CORUN, 256),
                 (16, 512, 64, 3000, torch.bfloat16, Mode.CORUN, 256)):  # fmt: skip
        cfg = mla_decode_config(1, *args, table=tuned_table)
        heads, dtype = args[0], args[4]  # the literal tile halves BLOCK_N for 4-byte elements
        block_h = 64 if heads >= 64 else 16
        assert (cfg.block_h, cfg.block_n) == (block_h, 32 if dtype.itemsize == 2 else 16)
    assert (literal.block_h, literal.block_n, literal.num_warps) == (64, 32, 8)


def test_tuned_decode_lookup_default_by_batch_bucket(tuned_table: MLATunedTable) -> None:
    """default: the entry at the smallest tuned batch >= B (the largest past the end)."""
    small = mla_decode_config(3, 128, 512, 64, 2000, torch.bfloat16, Mode.DEFAULT,
                              table=tuned_table)  # fmt: skip
    large = mla_decode_config(500, 128, 512, 64, 2000, torch.bfloat16, Mode.DEFAULT,
                              table=tuned_table)  # fmt: skip
    assert (small.block_h, small.block_n, small.num_warps) == (16, 64, 4)
    assert (large.block_h, large.block_n, large.num_warps) == (64, 16, 8)
    assert not small.is_fixed_split and small.num_splits >= large.num_splits


def test_tuned_prefill_lookup_same_in_every_mode(tuned_table: MLATunedTable) -> None:
    configs = {mla_prefill_config(192, 128, torch.bfloat16, m, table=tuned_table) for m in Mode}
    assert len(configs) == 1
    (cfg,) = configs
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 128, 4, 3)
    assert (cfg.block_d1, cfg.block_d2, cfg.block_dv) == (128, 64, 128)
    fp32 = mla_prefill_config(192, 128, torch.float32, Mode.CORUN, table=tuned_table)
    assert (fp32.block_m, fp32.block_n) == (64, 32)  # fp32 is not tuned: the literal tile


def test_tuned_decode_tile_with_value_parts_round_trips(tmp_path) -> None:
    """A tuned dv_parts reaches the launch config; one-part tiles keep the file's old format."""
    split = MLATile(64, 32, num_warps=8, num_stages=3, dv_parts=2)
    assert MLATile.from_dict(split.to_dict()) == split
    assert "dv_parts" not in MLATile(64, 32).to_dict()
    path = tmp_path / "mla_h200.json"
    _write_table(path, [{**V3, "kind": "decode_fixed", "split_size": 256, "ctx": 4096,
                         "config": split.to_dict()}])  # fmt: skip
    cfg = mla_decode_config(8, 128, 512, 64, 4096, torch.bfloat16, Mode.CORUN, 256,
                            table=load_mla_tuned(path))  # fmt: skip
    assert (cfg.block_h, cfg.dv_parts, cfg.num_stages) == (64, 2, 3)


def test_tuned_table_missing_file_is_empty(tmp_path) -> None:
    table = load_mla_tuned(tmp_path / "absent.json")
    assert table == MLATunedTable({}, {}, {})
    cfg = mla_decode_config(64, 128, 512, 64, 4096, torch.bfloat16, Mode.CORUN, table=table)
    assert (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 32, 8, 3)
    # 4-byte elements: half the step and 2 stages, so the q tile and the stages fit an SM.
    cfg = mla_decode_config(64, 128, 512, 64, 4096, torch.float32, Mode.CORUN, table=table)
    assert (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 16, 8, 2)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"entries": "nope"}),
        json.dumps({"entries": [{**V3, "kind": "decode_fixed", "ctx": 1,
                                 "config": _tile(64, 32)}]}),
        json.dumps({"entries": [{"kind": "prefill", "qk_dim": 192, "v_dim": 128,
                                 "config": _tile(64, 24)}]}),
        json.dumps({"entries": [{**V3, "kind": "decode_default", "batch": 1, "ctx": 1,
                                 "config": _tile(128, 32)}]}),
        json.dumps({"entries": [{"kind": "decode_other", "config": _tile(16, 32)}]}),
        json.dumps({"entries": [{"kind": "prefill", "qk_dim": 192, "v_dim": 128,
                                 "config": {**_tile(64, 32), "split_k": 2}}]}),
        json.dumps({"entries": [{"kind": "prefill", "qk_dim": 192, "v_dim": 128,
                                 "config": {**_tile(64, 32), "dv_parts": 2}}]}),
        json.dumps({"entries": [{**V3, "kind": "decode_fixed", "split_size": 256, "ctx": 1,
                                 "config": {**_tile(64, 32), "dv_parts": 3}}]}),
    ],
    ids=["bad-json", "entries-not-list", "missing-split", "block-n-24", "block-h-128",
         "unknown-kind", "unknown-field", "prefill-dv-parts", "dv-parts-3"],
)  # fmt: skip
def test_tuned_table_malformed_raises(tmp_path, content: str) -> None:
    path = tmp_path / "mla_h200.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="malformed MLA tuned table"):
        load_mla_tuned(path)


def test_mla_decode_rejects_bad_tile() -> None:
    args = _decode_args()
    with pytest.raises(ValueError, match="^tile:"):
        mla_decode(scale=0.1, max_seq_len=32, tile=(16, 32), **args)
    with pytest.raises(ValueError, match="^block_n:"):
        MLATile(16, 24)
    with pytest.raises(ValueError, match="^dv_parts:"):
        MLATile(16, 16, dv_parts=3)
    with pytest.raises(ValueError, match="^tile: dv_parts 8 leaves fewer than 16"):
        mla_decode(scale=0.1, max_seq_len=32, tile=MLATile(16, 16, dv_parts=8), **args)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def _decode_args(dtype=torch.float32):
    q_latent, q_pe, cache, tables, lens = make_decode_inputs([10, 20], 4, 32, 16, 16, 2, dtype)
    return dict(q_latent=q_latent, q_pe=q_pe, kv_cache=cache, block_tables=tables, seq_lens=lens)


@pytest.mark.parametrize(
    "change,name",
    [
        (lambda a: a.update(q_latent=a["q_latent"][..., :24].contiguous()), "kv_cache"),
        (lambda a: a.update(q_pe=a["q_pe"].half()), "q_pe"),
        (lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache"),
        (lambda a: a.update(q_latent=a["q_latent"].int()), "q_latent"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
        (lambda a: a.update(q_pe=a["q_pe"][:, :3]), "q_pe"),
        pytest.param(lambda a: a.update(seq_lens=torch.tensor([10, 33], dtype=torch.int32)),
                     "seq_lens", marks=VALUE_CHECKS_CPU_ONLY),
        (lambda a: a.update(max_seq_len=64), "max_seq_len"),
        (lambda a: a.update(split_size=8), "split_size"),
    ],
    ids=["latent-dim-mismatch", "q_pe-dtype", "cache-dtype", "int-q", "tables-int64",
         "lens-int64", "lens-batch", "q_pe-heads", "len-beyond-max", "beyond-block-table",
         "split-too-small"],
)  # fmt: skip
def test_mla_decode_rejects_bad_input(change, name) -> None:
    args = _decode_args()
    args.update(max_seq_len=32)
    change(args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        mla_decode(scale=0.1, **args)


@VALUE_CHECKS_CPU_ONLY
def test_store_and_prefill_reject_bad_input() -> None:
    latent, k_pe, cache = torch.randn(3, 32), torch.randn(3, 16), torch.zeros(2, 4, 48)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="^kv_cache:"):
        store_mla_kv(latent, k_pe, torch.zeros(2, 4, 40), slots)
    with pytest.raises(ValueError, match="^k_pe:"):
        store_mla_kv(latent, k_pe.half(), cache, slots)
    with pytest.raises(ValueError, match="^slot_mapping:"):
        store_mla_kv(latent, k_pe, cache, torch.tensor([0, 1, 8]))
    q, k, v = torch.randn(4, 2, 24), torch.randn(6, 2, 24), torch.randn(6, 2, 16)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="^k:"):
        mla_prefill_attention(q, torch.randn(6, 3, 24), v, cu_q, cu_k, 0.1, max_q_len=4)
    with pytest.raises(ValueError, match="^v:"):
        mla_prefill_attention(q, k, v.half(), cu_q, cu_k, 0.1, max_q_len=4)
    with pytest.raises(ValueError, match="^cu_seqlens_k:"):
        mla_prefill_attention(
            q, k[:3], v[:3], cu_q, torch.tensor([0, 3], dtype=torch.int32), 0.1, max_q_len=4
        )
    with pytest.raises(ValueError, match="^max_q_len:"):
        mla_prefill_attention(q, k, v, cu_q, cu_k, 0.1, max_q_len=2)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Launchers' torch.empty / empty_like return NaN-filled tensors, so an output row the kernel
    never writes shows up as NaN instead of whatever the allocator handed back."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_prefill_packed_step_matches_reference(dtype, poisoned_outputs) -> None:
    """Zero-length rows and trailing padding rows of q (and k, v): the real rows match the
    reference and the padding rows of the output are exactly zero."""
    q_lens, k_lens, pad_q, pad_k = [0, 13, 0, 40, 0], [0, 30, 0, 40, 0], 7, 3
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(q_lens) + pad_q, 2, 24, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens) + pad_k, 2, 24, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens) + pad_k, 2, 16, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = mla_prefill_attention(q, k, v, cu_q, cu_k, 0.2, max_q_len=40)
    expected = mla_prefill_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 0.2)
    real = sum(q_lens)
    assert_close(out[:real], expected[:real], dtype, reduce_dim=24)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


def test_mla_decode_writes_every_row(poisoned_outputs) -> None:
    """One-split, multi-split and dummy (length 0) sequences are all written (no NaN from the
    poisoned allocation), in the default and corun policies."""
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        [5, 0, 70, 32], 4, 32, 16, 16, 6, torch.float32
    )
    for mode in (Mode.CORUN, Mode.DEFAULT):
        out = mla_decode(q_latent, q_pe, cache, tables, lens, 0.3, max_seq_len=96, mode=mode,
                         split_size=32)  # fmt: skip
        assert not out.isnan().any()
        assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("qk_dim,v_dim", [(24, 16), (48, 32), (32, 16)],
                         ids=["Dqk24=16+8", "Dqk48=32+16", "Dqk32-pow2"])
def test_mla_prefill_tma_same_bits_as_pointer_loads(dtype, qk_dim, v_dim, monkeypatch) -> None:
    """Key and value tiles through descriptors over [S, H, D] give the pointer path's bits: the
    second qk part past the head dim is zero-filled, and rows past a sequence (the next
    sequence's, or unwritten NaN rows after the last) never reach a score or the accumulator."""
    q_lens, k_lens = [5, 33, 1], [5, 70, 9]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(q_lens), 3, qk_dim, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens) + 5, 3, qk_dim, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens) + 5, 3, v_dim, generator=gen).to(dtype)
    k[sum(k_lens):], v[sum(k_lens):] = float("nan"), float("nan")
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    base = mla_prefill_config(qk_dim, v_dim, dtype, Mode.CORUN)
    plain = mla_prefill_attention(q, k, v, cu_q, cu_k, 0.2, max_q_len=33, config=base)
    built = []
    real = mla_module.TensorDescriptor
    monkeypatch.setattr(mla_module, "TensorDescriptor",
                        lambda *a: built.append(tuple(a[3])) or real(*a))
    tma = mla_prefill_attention(q, k, v, cu_q, cu_k, 0.2, max_q_len=33,
                                config=dataclasses.replace(base, tma=True))
    second = [(base.block_n, 1, base.block_d2)] if base.block_d2 else []  # a pow-2 dim: none
    assert built == [(base.block_n, 1, base.block_d1), *second, (base.block_n, 1, base.block_dv)]
    assert_bitwise_equal(tma, plain)
    expected = mla_prefill_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 0.2)
    assert_close(tma, expected, dtype, reduce_dim=qk_dim)


def test_mla_prefill_tma_falls_back_where_a_descriptor_cannot_address() -> None:
    """A head dim whose stride is not 16-byte aligned (fp32 qk 18: 72 bytes) runs pointer loads."""
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(20, 2, 18, generator=gen), torch.randn(20, 2, 18, generator=gen)
    v = torch.randn(20, 2, 16, generator=gen)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    assert not tma_addressable(k)
    cfg = dataclasses.replace(mla_prefill_config(18, 16, torch.float32, Mode.CORUN), tma=True)
    out = mla_prefill_attention(q, k, v, cu, cu, 0.3, max_q_len=20, config=cfg)
    expected = mla_prefill_reference(q.double(), k.double(), v.double(), cu, cu, 0.3)
    assert_close(out, expected, torch.float32, reduce_dim=18)


def test_mla_tile_tma_is_prefill_only(tmp_path) -> None:
    tile = MLATile(128, 64, num_warps=8, num_stages=3, tma=True)
    assert MLATile.from_dict(tile.to_dict()) == tile
    assert "tma" not in MLATile(128, 64).to_dict()
    path = tmp_path / "mla_h200.json"
    _write_table(path, [{"kind": "prefill", "qk_dim": 192, "v_dim": 128, "config": tile.to_dict()}])
    assert mla_prefill_config(192, 128, torch.bfloat16, Mode.CORUN,
                              table=load_mla_tuned(path)).tma
    _write_table(path, [{**V3, "kind": "decode_fixed", "split_size": 256, "ctx": 1,
                         "config": tile.to_dict()}])
    with pytest.raises(ValueError, match="malformed MLA tuned table"):
        load_mla_tuned(path)
    with pytest.raises(ValueError, match="^tile:"):
        mla_decode(scale=0.1, max_seq_len=32, tile=MLATile(16, 16, tma=True), **_decode_args())


def test_mla_prefill_config_tile_override() -> None:
    """A tile passed in replaces the lookup (tuning); the head-dim split stays the shape's."""
    tile = MLATile(64, 32, num_warps=4, num_stages=1, tma=True)
    cfg = mla_prefill_config(192, 128, torch.bfloat16, Mode.CORUN, tile=tile)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 32, 4, 1) and cfg.tma
    assert (cfg.block_d1, cfg.block_d2, cfg.block_dv) == (128, 64, 128)
    with pytest.raises(ValueError, match="^tile:"):
        mla_prefill_config(192, 128, torch.bfloat16, Mode.CORUN, tile=MLATile(64, 32, dv_parts=2))


# ----------------------------------------------------------------------------------------------
# decode: a split's block ids preloaded (MLATile.preload_pages)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode,split_size,block_n,page_size,pages",
    [(Mode.CORUN, 32, 16, 16, 2),  # page-aligned splits of 2 pages
     (Mode.CORUN, 24, 16, 16, 4),  # splits starting inside a page: 1.5 pages + 1 -> 4
     (Mode.BATCH_INVARIANT, 64, 16, 16, 4),
     # tiles longer than the split: their tokens past it reach past the loaded pages (clamped)
     (Mode.CORUN, 16, 32, 16, 1),
     (Mode.CORUN, 32, 64, 16, 2),
     # default: 70 tokens in 2 splits of 48, page-aligned (16-token tiles on 16-token pages)
     (Mode.DEFAULT, 16, 16, 16, 4),
     # default, 16-token tiles on 32-token pages: 70 tokens' second split starts mid-page
     (Mode.DEFAULT, 16, 16, 32, 4)],
    ids=["corun-aligned", "corun-mid-page", "batch-invariant", "tile-past-split",
         "tile-past-split-2", "default", "default-mid-page"],
)
def test_mla_decode_preloaded_block_ids_keep_the_bits(mode, split_size, block_n, page_size,
                                                      pages, dtype, monkeypatch) -> None:
    """The split's block ids loaded before the token loop and gathered per tile give the same bits
    as loading them tile by tile: on the direct and the partial + combine paths, with splits that
    start inside a page, a sequence shorter than a page, the padded dummy slot, and tiles running
    past a split's end."""
    seq_lens, heads = [70, 9, 0, 33, 1], 20
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, heads, 32, 16, page_size, 96 // page_size, dtype, seed=9
    )
    max_seq_len = max(seq_lens) if mode == Mode.DEFAULT else 96
    spy = LaunchSpy(mla_module._mla_decode_kernel, "SPLIT_PAGES")
    monkeypatch.setattr(mla_module, "_mla_decode_kernel", spy)
    tile = MLATile(16, block_n, num_warps=4, num_stages=2)
    outs = [mla_decode(q_latent, q_pe, cache, tables, lens, 0.2, max_seq_len=max_seq_len,
                       mode=mode, split_size=split_size,
                       tile=dataclasses.replace(tile, preload_pages=preload))
            for preload in (False, True)]
    assert spy.values == [0, pages]
    assert_bitwise_equal(outs[1], outs[0])
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, 0.2
    )
    assert_close(outs[1], expected, dtype, reduce_dim=48)


def test_preloaded_pages_cover_a_split_and_fall_back_past_the_cap() -> None:
    def pages(mode, split_size, max_seq_len, page_size, preload=True, tile_n=32):
        tile = MLATile(64, tile_n, num_warps=8, num_stages=3, preload_pages=preload)
        cfg = mla_decode_config(8, 128, 512, 64, max_seq_len, torch.bfloat16, mode, split_size,
                                tile=tile)
        return mla_module.preloaded_pages(cfg, max_seq_len, page_size)

    assert pages(Mode.CORUN, 512, 4096, 16) == 32  # the engine's split: 32 whole pages
    assert pages(Mode.CORUN, 512, 4096, 16, preload=False) == 0
    assert pages(Mode.CORUN, 520, 4096, 16) == 64  # 32.5 pages, starting mid-page: 34 -> 64
    assert pages(Mode.CORUN, 1024, 4096, 16) == 64
    assert pages(Mode.CORUN, 2048, 4096, 16) == 0  # 128 pages: past MAX_PRELOAD_PAGES
    assert pages(Mode.CORUN, 2048, 4096, 64) == 32
    # default: 8 sequences x 2 head blocks fill 16 programs -> 8 splits of 512 tokens at 4096,
    # each starting on a page boundary (32-token tiles, 16-token pages): 32 pages
    assert pages(Mode.DEFAULT, 512, 4096, 16) == 32
    # 64-token pages wider than the 32-token tiles: a shorter sequence's split may start inside
    # one, so 8 pages + 1, rounded up
    assert pages(Mode.DEFAULT, 512, 4096, 64) == 16
    assert pages(Mode.DEFAULT, 512, 4096, 16, preload=False) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode,split_size,block_n,dv_parts,preload",
    [(Mode.CORUN, 32, 16, 1, False),
     (Mode.CORUN, 24, 16, 2, False),  # splits starting inside a tile's page, two value parts
     (Mode.BATCH_INVARIANT, 64, 16, 1, True),  # with the block ids preloaded too
     (Mode.CORUN, 16, 32, 1, False),  # tiles longer than the split
     (Mode.DEFAULT, 16, 16, 2, False)],
    ids=["corun", "corun-2-parts", "batch-invariant-preload", "tile-past-split", "default-2-parts"],
)
def test_mla_decode_reloaded_values_keep_the_bits(mode, split_size, block_n, dv_parts, preload,
                                                  dtype, monkeypatch) -> None:
    """P.V's latent rows loaded again a step late instead of carried give the same bits: on the
    direct and the partial + combine paths, one and several value parts, a sequence shorter than
    a tile, the padded dummy slot, and a split of a single tile (whose reload reads the zeros
    before the first tile and the rows of the only one)."""
    seq_lens, heads = [70, 9, 0, 33, 1], 20
    q_latent, q_pe, cache, tables, lens = make_decode_inputs(
        seq_lens, heads, 32, 16, 16, 6, dtype, seed=10
    )
    max_seq_len = max(seq_lens) if mode == Mode.DEFAULT else 96
    tile = MLATile(16, block_n, num_warps=4, num_stages=2, dv_parts=dv_parts,
                   preload_pages=preload)
    spy = LaunchSpy(mla_module._mla_decode_kernel, "RELOAD_VALUES")
    monkeypatch.setattr(mla_module, "_mla_decode_kernel", spy)
    outs = [mla_decode(q_latent, q_pe, cache, tables, lens, 0.2, max_seq_len=max_seq_len,
                       mode=mode, split_size=split_size,
                       tile=dataclasses.replace(tile, reload_values=reload))
            for reload in (False, True)]
    assert spy.values == [False, True]
    assert_bitwise_equal(outs[1], outs[0])
    expected = mla_decode_reference(
        q_latent.double(), q_pe.double(), cache.double(), tables, lens, 0.2
    )
    assert_close(outs[1], expected, dtype, reduce_dim=48)


def test_mla_tile_preload_pages_and_reload_values_are_decode_only(tmp_path) -> None:
    tile = MLATile(64, 32, num_warps=8, num_stages=3, preload_pages=True)
    assert MLATile.from_dict(tile.to_dict()) == tile
    assert "preload_pages" not in MLATile(64, 32).to_dict()
    with pytest.raises(ValueError, match="^preload_pages:"):
        MLATile(64, 32, preload_pages=1)
    path = tmp_path / "mla_h200.json"
    _write_table(path, [{"kind": "prefill", "qk_dim": 192, "v_dim": 128,
                         "config": MLATile(128, 64, preload_pages=True).to_dict()}])
    with pytest.raises(ValueError, match="malformed MLA tuned table"):
        load_mla_tuned(path)
    with pytest.raises(ValueError, match="^tile:"):
        mla_prefill_config(192, 128, torch.bfloat16, Mode.CORUN,
                           tile=MLATile(128, 64, preload_pages=True))
    reload = MLATile(64, 32, num_warps=8, num_stages=3, reload_values=True)
    assert MLATile.from_dict(reload.to_dict()) == reload
    assert "reload_values" not in MLATile(64, 32).to_dict()
    with pytest.raises(ValueError, match="^reload_values:"):
        MLATile(64, 32, reload_values=1)
    with pytest.raises(ValueError, match="^tile:"):
        mla_prefill_config(192, 128, torch.bfloat16, Mode.CORUN,
                           tile=MLATile(128, 64, reload_values=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSeek-V3's bf16 shapes need a GPU")
def test_mla_decode_preloaded_ids_and_reloaded_values_keep_the_bits_at_real_shapes_on_gpu() -> None:
    """The sm_90a loops the preload and the reload change (two latent buffers in flight; the
    values copied to shared memory rather than carried): DeepSeek-V3's 128 heads,
    latent 512 + rope 64, the engine's 512-token splits and default's, over scattered blocks."""
    seq_lens = [4096, 1500, 0, 513, 1]
    inputs = [t.cuda() for t in make_decode_inputs(seq_lens, 128, 512, 64, 16, 256,
                                                   torch.bfloat16, seed=11)]
    for mode, max_seq_len in ((Mode.CORUN, 4096), (Mode.DEFAULT, max(seq_lens))):
        cfg = mla_decode_config(len(seq_lens), 128, 512, 64, max_seq_len, torch.bfloat16, mode,
                                512)
        tile = MLATile(cfg.block_h, cfg.block_n, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, dv_parts=cfg.dv_parts)
        outs = [mla_decode(*inputs, 0.1, max_seq_len=max_seq_len, mode=mode, split_size=512,
                           tile=dataclasses.replace(tile, **change))
                for change in ({}, {"preload_pages": True}, {"reload_values": True})]
        assert_bitwise_equal(outs[1], outs[0], f"{mode.value} preloaded ids")
        assert_bitwise_equal(outs[2], outs[0], f"{mode.value} reloaded values")
