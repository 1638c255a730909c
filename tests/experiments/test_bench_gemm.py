"""bench_gemm's records on the CPU (interpreter, timings stubbed): each row names its layer and
policy, and the other row-load variant sits beside the picks it applies to with its bits checked."""

from __future__ import annotations

import torch

from experiments import bench_gemm

TINY_SHAPES = [("tiny.a", 48, 64), ("tiny.b", 32, 96)]


def test_records_keep_their_layer_and_time_the_other_row_load_where_the_tile_is_part_empty(
        monkeypatch):
    monkeypatch.setattr(bench_gemm, "_require_cuda", lambda: None)
    monkeypatch.setattr(bench_gemm, "DEVICE", "cpu")
    monkeypatch.setattr(bench_gemm, "DTYPE", torch.float32)  # the interpreter's bf16 dot is wrong
    monkeypatch.setattr(bench_gemm, "gemm_shapes", lambda models: TINY_SHAPES)
    # M 100 runs the literal 64-row tile: the pick re-reads its last tile's rows, and the
    # masked load is the variant.
    monkeypatch.setattr(bench_gemm, "DECODE_M", (1, 5, 16, 100))
    monkeypatch.setattr(bench_gemm, "PREFILL_M", ())
    monkeypatch.setattr(bench_gemm, "bench_us", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[1])
    records = bench_gemm.collect()
    assert {r["policy"] for r in records} >= {"corun_reread_rows", "corun_mask_rows"}
    assert {r["layer"] for r in records} == {label for label, _, _ in TINY_SHAPES}
    for label, n, k in TINY_SHAPES:
        for m in (1, 5, 16, 100):
            rows = {r["policy"]: r for r in records if r["layer"] == label and r["M"] == m}
            pick = bench_gemm.gemm_config(m, n, k, torch.float32, bench_gemm.Mode.CORUN)
            part_empty = m % pick.block_m != 0
            assert set(rows) == {"corun", "batch_invariant"} | (
                {"corun_reread_rows" if pick.mask_rows else "corun_mask_rows"}
                if part_empty else set()), (label, m, pick)
            for policy, row in rows.items():
                assert ("same_bits_as_pick" in row) == policy.startswith("corun_")
                assert row.get("same_bits_as_pick", True) is True
                assert row["N"] == n and row["K"] == k


def test_a_tail_row_sits_beside_the_pick_where_n_takes_tail_tiles(monkeypatch):
    """N 96 is one 64 + 32 tile (gemm_candidates.tail_tiles): each M gets a corun_tail row, the pick
    with its columns as 64 + 32, and its bits equal the pick's (the same K walk)."""
    monkeypatch.setattr(bench_gemm, "_require_cuda", lambda: None)
    monkeypatch.setattr(bench_gemm, "DEVICE", "cpu")
    monkeypatch.setattr(bench_gemm, "DTYPE", torch.float32)
    monkeypatch.setattr(bench_gemm, "gemm_shapes", lambda models: [("tiny.tail", 96, 64)])
    monkeypatch.setattr(bench_gemm, "DECODE_M", (1, 5))
    monkeypatch.setattr(bench_gemm, "PREFILL_M", ())
    monkeypatch.setattr(bench_gemm, "bench_us", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[1])
    records = bench_gemm.collect()
    tails = [r for r in records if r["policy"] == "corun_tail"]
    assert [r["M"] for r in tails] == [1, 5]
    for row in tails:
        assert (row["config"]["block_n"], row["config"]["block_n_tail"]) == (64, 32)
        assert row["same_bits_as_pick"] is True
