"""The capture-spread probe's summary of one series of per-capture times."""

from __future__ import annotations

import pytest

from experiments.probe_capture_spread import ROUNDS, spread
from experiments.report_gemm import probe_capture_spread_block


def test_spread_reads_median_extremes_and_their_ratio():
    summary = spread([11.07, 8.9, 9.0, 8.95])
    assert summary == {"median_us": 8.975, "min_us": 8.9, "max_us": 11.07,
                       "max_over_min": pytest.approx(11.07 / 8.9, abs=1e-4)}


def test_a_steady_series_has_ratio_one():
    assert spread([14.17] * ROUNDS)["max_over_min"] == 1.0



PICK = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4,
        "tma": True}
HEAD = {"machine": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6",
        "date": "2026-12-07", "command": "python -m experiments.probe_capture_spread"}


def _series(ours: list[float], cublas: list[float] = (8.0, 8.1)) -> dict:
    return {"ours": spread(ours), "cublas": spread(list(cublas)), "ratio_median": 0.85}


def test_the_readme_view_shows_each_condition_with_its_spread():
    record = {"layer": "deepseek-v3.shared.down", "M": 128, "rounds": 2, "pick": PICK,
              "same_operands": _series([8.9, 8.9]), "fresh_operands": _series([8.9, 11.5])}
    text = probe_capture_spread_block(HEAD, [record], name="probe-capture-spread-h100")
    rows = [line for line in text.splitlines() if line.startswith("| deepseek")]
    assert [row.split(" | ")[3] for row in rows] == ["same operands", "fresh operands"]
    assert "8.90 (8.90-8.90), 1.000" in rows[0]
    assert "10.20 (8.90-11.50), 1.292" in rows[1]
    assert "2 graph captures per condition" in text
    assert "points past" not in text  # three points or fewer: no survey summary


def test_the_survey_counts_the_points_whose_placements_spread_on_each_side():
    spreads = {("qwen3-8b.qkv", 128): [10.0, 10.2], ("qwen3-8b.o", 128): [5.0, 6.0],
               ("qwen3-8b.o", 256): [6.0, 6.3], ("deepseek-v3.q_a", 256): [14.0, 17.5]}
    records = [{"layer": layer, "M": m, "rounds": 2, "pick": PICK,
                "fresh_operands": _series(ours, (8.0, 9.0) if layer == "qwen3-8b.o" else (8.0,))}
               for (layer, m), ours in spreads.items()]
    text = probe_capture_spread_block(HEAD, records, name="probe-capture-spread-survey-h100")
    assert ("the pick's time spreads 2 of 4 points past 1.1x (median 1.125x, most 1.250x at "
            "deepseek-v3.q_a M 256)") in text
    assert ("cuBLAS's 2 of 4 points past 1.1x (median 1.062x, most 1.125x at qwen3-8b.o "
            "M 128)") in text
    assert text.count("| fresh operands |") == 4 and "same operands" not in text


def test_a_survey_cut_by_its_budget_says_so():
    records = [{"layer": "qwen3-8b.qkv", "M": 128, "rounds": 6, "pick": PICK,
                "fresh_operands": _series([10.0, 10.2])}]
    head = {**HEAD, "complete": False, "budget_s": 240.0, "expected_points": 38}
    text = probe_capture_spread_block(head, records, name="probe-capture-spread-survey-h100")
    assert "Cut by its 240 s budget after 1 of 38 points." in text
    assert "Cut by" not in probe_capture_spread_block({**head, "complete": True}, records,
                                                      name="probe-capture-spread-survey-h100")


def test_the_survey_stops_at_its_budget_and_says_whether_it_finished(monkeypatch):
    from experiments import probe_capture_spread as probe

    shapes = [("a.qkv", 64, 32), ("a.o", 32, 64)]
    monkeypatch.setattr(probe, "gemm_shapes", lambda models: shapes)
    points = []
    monkeypatch.setattr(probe, "_point", lambda label, n, k, m, **kwargs:
                        points.append((label, m, kwargs)) or {"layer": label, "M": m})
    state = {}
    assert probe.collect_survey(-1.0, state) == [] and state == {"complete": False}
    records = probe.collect_survey(3600.0, state)
    assert state == {"complete": True}
    assert [(r["layer"], r["M"]) for r in records] == [
        (label, m) for label, _, _ in shapes for m in probe.SURVEY_M]
    assert all(kw == {"conditions": ("fresh_operands",), "rep_ms": 20} for *_, kw in points)
