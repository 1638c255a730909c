"""bench_logits_processing runs end to end on small sizes and records both forms per case."""

from __future__ import annotations

import json

from experiments import bench_logits_processing


def test_bench_logits_processing_writes_its_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_logits_processing.main(["--batches", "1", "3", "--vocab", "300", "--output-tokens", "5",
                                  "--repeats", "2", "--name", "lp"])
    head, *records = json.loads((tmp_path / "lp.json").read_text())
    assert head["device"] == "cpu" and "ops" in head
    assert [(r["workload"], r["batch"]) for r in records] == [
        ("repetition", 1), ("repetition", 3), ("mixed", 1), ("mixed", 3)]
    repetition_3 = records[1]
    # One processor a shared value: the batch's op count is one row's, row by row it is three.
    assert repetition_3["one_block_ops"] == records[0]["one_block_ops"]
    assert repetition_3["row_at_a_time_ops"] > 2 * repetition_3["one_block_ops"]
