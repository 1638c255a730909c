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

