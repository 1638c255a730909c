"""bench_mla's reloaded-values row on the CPU (interpreter, small dims, timing stubbed): the
policy tile with MLATile.reload_values, its bits checked against the policy's."""

from __future__ import annotations

import torch

from experiments import bench_mla


def test_reload_record_checks_its_bits_against_the_policy(monkeypatch):
    monkeypatch.setattr(bench_mla, "DEVICE", "cpu")
    monkeypatch.setattr(bench_mla, "DTYPE", torch.float32)  # the interpreter's bf16 dot is wrong
    monkeypatch.setattr(bench_mla.harness, "bench_us", lambda fn: (fn(), 2.0)[1])
    dims = {"heads": 16, "latent": 32, "rope": 16, "scale": 0.2}
    ctx = 40
    x = bench_mla.decode_inputs(dims, [ctx, 17], ctx, seed=3)
    record = bench_mla._reload_record(x, dims, 2, ctx, peer_us=4.0, bound_us=1.0)
    assert record["policy"] == f"corun_split{bench_mla.ENGINE_SPLIT}_reload"
    assert record["same_bits_as_policy"] is True
    assert record["ratio"] == 2.0 and record["bw_fraction"] == 0.5
