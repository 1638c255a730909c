"""The launch-cost bench runs every op's launcher on the CPU with the kernels stubbed out, and the
README view puts each op's host cost beside its GPU time."""

from __future__ import annotations

from experiments import bench_launch_cost
from tests.experiments.rendering import render_block


def test_stub_mode_times_every_op_launcher():
    records = bench_launch_cost.measure(["stub"], calls=2, repeats=1)
    errors = [r for r in records if "error" in r]
    assert not errors, errors
    ops = {(r["op"], r["shape"]) for r in records if "shape" in r}
    assert {("gemm qkv", "decode"), ("sample", "decode"), ("fused_moe", "decode"),
            ("mla_decode", "decode")} <= ops
    assert all(r["host_us"] > 0 for r in records if "shape" in r)
    assert records[-1]["op"].startswith("qwen3-8b eager decode forward")


def test_view_pairs_host_and_gpu_time(tmp_path, monkeypatch):
    head = {"header": True, "machine": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
            "date": "d", "command": "c", "timing": "graph replay"}
    records = [{"op": "sample", "shape": "decode", "mode": "stub", "host_us": 40.0},
               {"op": "sample", "shape": "decode", "mode": "native", "host_us": 55.5,
                "gpu_us": 37.0, "host_over_gpu": 1.5},
               {"op": "gemm qkv", "shape": "decode", "mode": "native", "host_us": 30.0,
                "gpu_error": "RuntimeError()"}]
    text = render_block(tmp_path, monkeypatch, "launch-cost-h200", head, records)
    assert "| sample | decode | 40.0 | 55.5 | 37.0 | 1.50 |" in text
    assert "| gemm qkv | decode | — | 30.0 | — | — |" in text
    assert "graph replay" in text
