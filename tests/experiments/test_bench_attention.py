"""bench_attention's decode rows on the CPU (interpreter, small heads, timing stubbed): which
variants sit beside the corun policy where it preloads a lane's block ids, that each is checked
for the policy's bits, and the launch floor each target row carries."""

from __future__ import annotations

import pytest
import torch

from experiments import bench_attention as bench


@pytest.fixture
def cpu_decode(monkeypatch):
    monkeypatch.setattr(bench, "NUM_Q_HEADS", 4)
    monkeypatch.setattr(bench, "NUM_KV_HEADS", 2)
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)  # the interpreter's bf16 dot is wrong
    monkeypatch.setattr(bench, "bench_us", lambda fn, **kwargs: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "copy_reference_us", lambda num_bytes, **kwargs: 1.0)
    # a launch's stand-in cost, so each row's floor says which grids it was given
    monkeypatch.setattr(bench, "launch_floor_us",
                        lambda grids, **kwargs: sum(1000.0 ** i * g[-1] for i, g in
                                                    enumerate(grids)))
    monkeypatch.setattr(bench, "memory_bound_us", lambda num_bytes: 4.0)
    monkeypatch.setattr(bench, "bandwidth_label", lambda: "a stub bandwidth")
    monkeypatch.setattr(bench, "DECODE_TARGET_MIN_BOUND_US", 0.0)  # every B <= 8 row targeted
    return lambda batch, context: {r["policy"]: r for r in bench._bench_decode(
        batch, context, torch.device("cpu"))}


def test_where_the_policy_preloads_the_tile_by_tile_loop_is_timed_beside_it(cpu_decode):
    rows = cpu_decode(1, 512)
    assert rows["corun"]["num_stages"] == 3 and rows["corun"]["lane_pages"] == 16
    deeper = {"corun_preload_s2", "corun_preload_s4", "corun_preload_s5"}
    assert {"corun_table_ids", *deeper} <= set(rows) and "corun_preload_s3" not in rows
    assert rows["corun_table_ids"]["num_stages"] == 2 and "lane_pages" not in rows[
        "corun_table_ids"]
    for name in ("corun_table_ids", *deeper):
        assert rows[name]["same_bits_as_policy"] is True, name
    for n in (2, 4, 5):  # the policy's preloaded ids at each other stage count
        row = rows[f"corun_preload_s{n}"]
        assert row["num_stages"] == n and row["lane_pages"] == 16
    # the older variants keep the loop they were named for
    assert "lane_pages" not in rows["corun_stages5"]


def test_past_batch_8_the_policy_preloads_where_the_ids_fit(cpu_decode):
    rows = cpu_decode(9, 512)
    assert rows["corun"]["lane_pages"] == 16  # 2 lanes of one 256-token split: 16 pages
    assert rows["corun_table_ids"]["same_bits_as_policy"] is True
    assert "corun_stages5" not in rows  # the small-batch variants stop at B 8
    assert "corun_preload_s4" not in rows and "corun_preload_s5" not in rows


def test_target_rows_carry_the_floor_of_their_own_launches(cpu_decode):
    """Each targeted row's launch floor is timed at its own grids: the split over its lanes,
    then the combine over (B, q heads), or the split alone where the combine is fused; past
    B 8 no row is targeted and none is timed."""
    rows = cpu_decode(1, 512)  # 2 splits of 256 over 2 lanes; the combine over 4 q heads
    assert rows["corun"]["launch_floor_us"] == 2 + 1000 * 4 and rows["corun"]["launches"] == 2
    assert rows["corun_fused"]["launch_floor_us"] == 2 and rows["corun_fused"]["launches"] == 1
    assert all("launch_floor_us" not in r for r in cpu_decode(9, 512).values())
