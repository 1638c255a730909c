"""The research views render only what a results file holds: a claim row needs corun and that
peer for some model, failed runs say so, the atlas marks changed cells."""

from __future__ import annotations

from tests.experiments.rendering import render_block

HEAD = {"header": True, "machine": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
        "date": "d", "command": "c",
        "paper_claims": {"throughput_gain_over_batch_invariant_pct": [15, 324],
                         "ttft_change_pct_mean": -51.8, "tpot_change_pct_mean": -48.6},
        "truncation": {"hy3": {"config": "hy3-l14", "layers": 14, "full_layers": 80,
                               "bf16_weight_gb": 99.2}}}


def _render(tmp_path, monkeypatch, name, records, block):
    return render_block(tmp_path, monkeypatch, name, HEAD, records, block)


def test_paper_claims_rows_only_where_measured(tmp_path, monkeypatch):
    records = [
        {"model": "hy3", "mode": "batch_invariant", "output_tok_s": 100.0},
        {"model": "hy3", "mode": "corun", "output_tok_s": 150.0,
         "throughput_change_pct_vs_batch_invariant": 50.0,
         "ttft_change_pct_vs_batch_invariant": -40.0},
        {"model": "deepseek-v3", "mode": "corun", "error": "OutOfMemoryError: x"},
    ]
    text = _render(tmp_path, monkeypatch, "paper-h200", records, "paper-h200-claims")
    assert "| output throughput vs batch-invariant (portable) | +15% to +324% | hy3 +50.0%" in text
    assert "inside the range" in text and "+11.8 points" in text  # -40 vs -51.8
    assert "TPOT" not in text and "tuned" not in text  # neither measured
    table = _render(tmp_path, monkeypatch, "paper-h200", records, "paper-h200")
    assert "failed: OutOfMemoryError" in table and "`hy3-l14`, 14 of 80 layers" in table


def test_paper_table_groups_models_and_shows_provenance(tmp_path, monkeypatch):
    """A merged file holds its families in device-call order; the table groups them by model
    and names when each row ran and how many of its runs were discarded for compiling."""
    records = [
        {"model": "hy3", "mode": "default", "output_tok_s": 1.0,
         "measured_at": "2026-12-04T20:23:45+00:00"},
        {"model": "deepseek-v3", "mode": "default", "output_tok_s": 2.0,
         "measured_at": "2026-12-05T05:34:32+00:00", "jit_compiles_timed": 0,
         "discarded_runs": [{"jit_compiles": 10, "wall_s": 27.7}]},
        {"model": "deepseek-v3", "mode": "corun", "output_tok_s": 3.0,
         "throughput_change_pct_vs_default": 50.0},
    ]
    table = _render(tmp_path, monkeypatch, "paper-h200", records, "paper-h200")
    assert table.index("| deepseek-v3 | — | corun |") < table.index("| hy3 |")
    assert "| deepseek-v3 | — | default | 2026-12-05 05:34 | 2.00 |" in table
    assert "| 0 | 1 |" in table  # no compile in the timed run, one run discarded before it
    claims = _render(tmp_path, monkeypatch, "paper-h200", records, "paper-h200-claims")
    assert ("| output throughput vs default (not deterministic) | — (not the paper's peer) "
            "| deepseek-v3 +50.0% | +50.0% | — |") in claims


def test_paper_claims_without_pairs(tmp_path, monkeypatch):
    text = _render(tmp_path, monkeypatch, "paper-h200",
                   [{"model": "hy3", "mode": "default", "output_tok_s": 1.0}],
                   "paper-h200-claims")
    assert "no model has both" in text


def test_atlas_marks_changes_and_skips(tmp_path, monkeypatch):
    row = {"op": "gemm", "impl": "cuBLAS", "policy": "vendor", "shape": "s", "other_rows": 0,
           "row_index": 0, "batch_size": 6, "batch_sizes_changed": [64, 128],
           "run_to_run": 0, "row_elements": 4096, "run_to_run_elements": 10,
           "position_invariant": True, "batch_invariant": False, "deterministic": True}
    skipped = {"op": "all_reduce", "impl": "NCCL", "policy": "vendor", "skipped": "1 GPU"}
    text = _render(tmp_path, monkeypatch, "invariance-atlas-h200", [skipped, row],
                   "invariance-atlas-h200")
    assert ("| gemm | cuBLAS | vendor | s | 0 | 0 | **6** of 4096 | 64, 128 "
            "| 0 · position-invariant |") in text
    assert "not measured: 1 GPU" in text and "Of 1 cases measured, 1 are position" in text


def test_ablate_view_links_its_png(tmp_path, monkeypatch):
    records = [{"series": "corun", "value": 256, "output_tok_s": 10.0, "mismatches": 0},
               {"series": "corun", "value": 512, "error": "ValueError: bad"}]
    text = _render(tmp_path, monkeypatch, "ablate-overlap-h200", records, "ablate-overlap-h200")
    assert "![ablate-overlap-h200](results/ablate-overlap-h200.png)" in text
    assert "| corun | 512 | failed: ValueError: bad |" in text


def test_ablate_view_lists_every_run_of_a_repeated_point(tmp_path, monkeypatch):
    records = [{"series": "corun", "value": 256, "output_tok_s": 20.0,
                "output_tok_s_runs": [30.0, 10.0, 20.0], "mismatches": 0}]
    text = render_block(tmp_path, monkeypatch, "ablate-overlap-h200", {**HEAD, "repeats": 3},
                        records)
    assert "| series | value | output tok/s | runs (median of 3) |" in text
    assert "| corun | 256 | 20.00 | 30, 10, 20 |" in text



def test_paper_claims_are_computed_from_the_raw_figures(tmp_path, monkeypatch):
    """The per-record change fields are rounded to 0.1, so the claims (and their means) come
    from the records' own throughput, TTFT and TPOT where the peer's record is in the file."""
    records = [
        {"model": "hy3", "mode": "batch_invariant", "output_tok_s": 100.0, "ttft_ms_mean": 30.0},
        {"model": "hy3", "mode": "corun", "output_tok_s": 100.04, "ttft_ms_mean": 29.99,
         "throughput_change_pct_vs_batch_invariant": 0.0,
         "ttft_change_pct_vs_batch_invariant": -0.0},
        {"model": "qwen3", "mode": "batch_invariant", "output_tok_s": 100.0},
        {"model": "qwen3", "mode": "corun", "output_tok_s": 100.08,
         "throughput_change_pct_vs_batch_invariant": 0.0},  # stale on purpose: raw is 0.08
    ]
    text = _render(tmp_path, monkeypatch, "paper-h200", records, "paper-h200-claims")
    # 0.04% and 0.08%, a mean of 0.06: the recorded fields would give +0.0% for both.
    assert "| hy3 +0.0%, qwen3 +0.1% | +0.1% |" in text
    from experiments.report_research import _change_pct

    assert abs(_change_pct(records[1], records[0], "throughput", 0.0) - 0.04) < 1e-9
    assert _change_pct(records[1], None, "throughput", 7.0) == 7.0
