"""bench_detokenize runs end to end on small sizes and records both decodes per length."""

from __future__ import annotations

import json

from experiments import bench_detokenize


def test_bench_detokenize_writes_its_records(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_detokenize.main(["--batch", "2", "--lengths", "8", "40", "--repeats", "2",
                           "--name", "detok"])
    head, *records = json.loads((tmp_path / "detok.json").read_text())
    assert head["header"] and head["machine"]
    assert [r["output_tokens"] for r in records] == [8, 40]
    assert all(r["full_us"] > 0 and r["incremental_us"] > 0 for r in records)
