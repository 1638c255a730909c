"""The capture-spread probe's summary of one series of per-capture times."""

from __future__ import annotations

import pytest

from experiments.probe_capture_spread import ROUNDS, spread


def test_spread_reads_median_extremes_and_their_ratio():
    summary = spread([11.07, 8.9, 9.0, 8.95])
    assert summary == {"median_us": 8.975, "min_us": 8.9, "max_us": 11.07,
                       "max_over_min": pytest.approx(11.07 / 8.9, abs=1e-4)}


def test_a_steady_series_has_ratio_one():
    assert spread([14.17] * ROUNDS)["max_over_min"] == 1.0



def test_the_readme_view_shows_each_condition_with_its_spread():
    from experiments.report_gemm import probe_capture_spread_block

    def series(times: list[float]) -> dict:
        return {"ours": spread(times), "cublas": spread([8.0, 8.1]), "ratio_median": 0.85}

    record = {"layer": "deepseek-v3.shared.down", "M": 128, "rounds": 2,
              "pick": {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4,
                       "num_stages": 4, "tma": True},
              "same_operands": series([8.9, 8.9]), "fresh_operands": series([8.9, 11.5])}
    head = {"machine": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6",
            "date": "2026-12-07", "command": "python -m experiments.probe_capture_spread"}
    text = probe_capture_spread_block(head, [record], name="probe-capture-spread-h100")
    rows = [line for line in text.splitlines() if line.startswith("| deepseek")]
    assert [row.split(" | ")[3] for row in rows] == ["same operands", "fresh operands"]
    assert "8.90 (8.90-8.90), 1.000" in rows[0]
    assert "10.20 (8.90-11.50), 1.292" in rows[1]
    assert "2 graph captures per condition" in text
