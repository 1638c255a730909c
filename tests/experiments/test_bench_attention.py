"""bench_attention's decode rows on the CPU (interpreter, small heads, timing stubbed): which
variants sit beside the corun policy where it preloads a lane's block ids (B <= 8) and where it
could (past B 8), and that each is checked for the policy's bits."""

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
    monkeypatch.setattr(bench, "memory_bound_us", lambda num_bytes: 4.0)
    monkeypatch.setattr(bench, "bandwidth_label", lambda: "a stub bandwidth")
    return lambda batch, context: {r["policy"]: r for r in bench._bench_decode(
        batch, context, torch.device("cpu"))}


def test_where_the_policy_preloads_the_tile_by_tile_loop_is_timed_beside_it(cpu_decode):
    rows = cpu_decode(1, 512)
    assert rows["corun"]["num_stages"] == 3 and rows["corun"]["lane_pages"] == 16
    assert {"corun_table_ids", "corun_preload_s2"} <= set(rows)
    assert rows["corun_table_ids"]["num_stages"] == 2 and "lane_pages" not in rows[
        "corun_table_ids"]
    for name in ("corun_table_ids", "corun_preload_s2"):
        assert rows[name]["same_bits_as_policy"] is True, name
    # the older variants keep the loop they were named for
    assert "lane_pages" not in rows["corun_stages5"]


def test_past_batch_8_the_preload_is_timed_beside_the_policy(cpu_decode):
    rows = cpu_decode(9, 512)
    assert "lane_pages" not in rows["corun"]  # the policy loads the ids tile by tile here
    assert rows["corun_preload_s2"]["same_bits_as_policy"] is True
    assert rows["corun_preload_s2"]["lane_pages"] == 16
    assert "corun_table_ids" not in rows
