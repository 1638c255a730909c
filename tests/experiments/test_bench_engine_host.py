"""bench_engine_host runs end to end on a small batch and times each stage it names."""

from __future__ import annotations

import json

from experiments import bench_engine_host


def test_bench_engine_host_writes_its_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_engine_host.main(["--batch", "2", "--output-tokens", "6", "--name", "eh"])
    head, *records = json.loads((tmp_path / "eh.json").read_text())
    assert "timing" in head
    assert [(r["final_only"], r["stop_strings"]) for r in records] == [
        (False, False), (True, False), (False, True), (True, True)]
    for r in records:
        assert r["decode_steps"] >= 4 and r["forward_ms"] > 0 and r["host_ms"] > 0
        # A final-only request builds no output on a step where nothing finishes.
        assert (r["outputs_ms"] == 0.0) == r["final_only"]
