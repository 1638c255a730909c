"""Issue 13's targets table and the decode step before/after view, rendered from records."""

from __future__ import annotations

import json

from tests.experiments.rendering import render_block

HEAD = {"header": True, "machine": "NVIDIA H200", "date": "2026-12-04", "command": "bench"}


def _gemm(m: int, ratio: float, layer: str = "qwen3-8b.qkv") -> dict:
    return {"op": "gemm", "policy": "corun", "M": m, "us": 1.0, "ratio": ratio, "layer": layer}


def _records(gemm_ratio: float) -> list[dict]:
    mla = {"op": "mla_decode", "policy": "corun_split512", "batch": 32, "context": 1024,
           "us": 100.0, "bound_us": 20.0, "compute_floor_us": 25.0, "bw_fraction": 0.2}
    return [
        *(_gemm(m, gemm_ratio) for m in (128, 256)), _gemm(1, 0.5, "deepseek-v3.kv_b"),
        _gemm(512, 0.9, "deepseek-v3.q_a"),
        {"op": "gemm", "policy": "corun", "M": 128, "us": 1.0, "ratio": 0.1, "superseded": True,
         "layer": "qwen3-8b.o"},  # a superseded row counts for nothing
        {"op": "sample", "policy": "corun", "us": 1.0, "ratio": 1.2, "target": True},
        {"op": "sample", "policy": "corun", "us": 1.0, "ratio": 0.1, "target": False},
        mla, {**mla, "policy": "default"}, {**mla, "batch": 8, "bw_fraction": 0.01},
        {"op": "mla_prefill", "policy": "corun", "us": 1.0, "ratio": 0.8},
        {"op": "rope", "policy": "corun", "shape": "deepseek-v3", "M": 1, "us": 1.0,
         "bound_us": 0.1, "bw_fraction": 0.1},
        {"op": "rope", "policy": "corun", "shape": "deepseek-v3", "M": 64, "us": 1.0,
         "bound_us": 0.7, "bw_fraction": 0.7},
        {"op": "rope", "policy": "corun", "shape": "deepseek-v3", "M": 512, "us": 4.0,
         "bound_us": 3.6, "bw_fraction": 0.9},
        {"op": "decode_attention", "policy": "corun", "us": 1.0, "bw_fraction": 0.5,
         "target": "bw_fraction >= 0.6"},
        {"op": "decode_attention", "policy": "corun_fused", "us": 1.0, "bw_fraction": 0.7,
         "target": "bw_fraction >= 0.6"},
        {"op": "moe_align", "policy": "corun", "us": 1.0, "ratio": 3.0},
        {"op": "moe_align_variant", "us": 1.0, "launches_us": {"count": 1.0, "scatter": 2.0}},
    ]


def _row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {start}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_targets_are_computed_from_the_rows_they_name(tmp_path, monkeypatch):
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, _records(0.96),
                        block="kernels-h200-targets")
    assert _row(text, "corun GEMM at M = 128")[2:] == [
        "M 128: median 0.96, min 0.96; M 256: median 0.96, min 0.96", "yes"]
    deepseek = _row(text, "corun GEMM, DeepSeek")
    assert deepseek[2].startswith("min 0.50 (deepseek-v3.kv_b at M 1)") and deepseek[3] == "no"
    assert "1 of 2 at >= 0.85" in deepseek[2]
    assert _row(text, "sampling")[2:] == ["median 1.20, min 1.20", "yes"]
    mla = _row(text, "MLA decode, corun_split512")
    # B < 32 rows are not the target's; the floor is 1.25x the bound, so half the bound asks for
    # 0.62 of the peak, and the kernel runs at 25 / 100 of it.
    assert mla[2].startswith("0.20-0.20 of the memory bound") and "1.25-1.25x" in mla[2]
    assert "asks for 0.62-0.62 of the peak" in mla[2] and "at 0.25-0.25 of it" in mla[2]
    # The floor is M 1's 1 us: M 1 could reach 0.1, M 64 0.7 and M 512 1.0 of their bounds.
    assert _row(text, "RoPE")[2:] == [
        "median 0.70, 0.10-0.90. At the M 1 time (1.00 us) as a floor for every M the median "
        "could reach 0.70", "yes"]
    assert _row(text, "decode attention at B <= 8 (")[3] == "no"
    assert _row(text, "decode attention at B <= 8, fused")[2:] == ["median 0.70, 0.70-0.70",
                                                                  "yes"]
    assert _row(text, "MoE token sort")[2:] == [
        "2 launches; 3.00-3.00x faster than the torch sort (min, median)", "no"]
    missed = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, _records(0.9),
                          block="kernels-h200-targets")
    assert _row(missed, "corun GEMM at M = 128")[3] == "no"


def test_a_family_not_measured_renders_as_such(tmp_path, monkeypatch):
    """A fresh or partial results file (one family run) renders every row, unmeasured ones
    as such, instead of failing the whole README render."""
    only_gemm = [r for r in _records(0.96) if r["op"] == "gemm"]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, only_gemm,
                        block="kernels-h200-targets")
    assert _row(text, "corun GEMM at M = 128")[3] == "yes"
    for start in ("sampling", "MLA decode, corun_split512", "MLA prefill", "RoPE",
                  "decode attention", "MoE token sort"):
        assert _row(text, start)[2:] == ["not measured", "—"], start


def test_decode_step_without_a_before_file(tmp_path, monkeypatch):
    text = render_block(tmp_path, monkeypatch, "models-h200-b128-after", HEAD,
                        [{"model": "m", "decode_batch": 1, "decode_context": 1,
                          "decode_step_us": 1.0, "decode_fraction_of_bound": 0.5}])
    assert "_not measured yet_" in text


def test_decode_step_before_and_after(tmp_path, monkeypatch):
    step = {"model": "qwen3-8b", "decode_batch": 128, "decode_context": 2048,
            "decode_fraction_of_bound": 0.7}
    (tmp_path / "models-h200-b128-before.json").write_text(json.dumps(
        [{**HEAD, "command": "before"}, {**step, "decode_step_us": 200.0},
         {**step, "model": "gone", "decode_step_us": 1.0}]))
    text = render_block(tmp_path, monkeypatch, "models-h200-b128-after", HEAD,
                        [{**step, "decode_step_us": 150.0},
                         {**step, "model": "new", "decode_step_us": 9.0}])
    assert "before: _NVIDIA H200" in text and "`before`" in text
    assert _row(text, "qwen3-8b")[3:6] == ["200.0", "150.0", "0.750"]
    assert _row(text, "new")[3:6] == ["—", "9.0", "—"]


def test_moe_sort_row_counts_the_policys_profiled_launches(tmp_path, monkeypatch):
    """Records that carry the policy run's launches: decode and prefill sizes apart; the
    target (the graph-captured decode step's sort) met at decode sizes when those are one
    launch, wholly when every size is."""
    align = {"op": "moe_align", "policy": "corun", "us": 1.0, "ratio": 2.0}
    records = [{**align, "M": 512, "K": 8, "launches_us": {"scatter": 3.0}},
               {**align, "M": 2048, "K": 8, "ratio": 4.0,
                "launches_us": {"count": 1.0, "scatter": 2.0}}]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, records,
                        block="kernels-h200-targets")
    assert _row(text, "MoE token sort")[2:] == [
        "decode (T x k <= 4096): 1 launch; prefill: 2 launches; 2.00-3.00x faster than the "
        "torch sort (min, median)", "at decode sizes"]
    two = [{**r, "launches_us": {"count": 1.0, "scatter": 2.0}} for r in records]
    assert _row(render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, two,
                             block="kernels-h200-targets"), "MoE token sort")[3] == "no"
    one = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, records[:1],
                       block="kernels-h200-targets")
    assert _row(one, "MoE token sort")[3] == "yes"


def test_rope_and_attention_rows_read_their_limit_off_the_device_copy(tmp_path, monkeypatch):
    """Rows that carry ``copy_us`` (torch's copy of the same bytes, graph-replayed) say what the
    copy reaches of the bound and how close the kernel runs to it; rows without it say nothing
    more, and an H100 file renders the same table under its own name."""
    rope = {"op": "rope", "policy": "corun", "shape": "deepseek-v3", "bound_us": 1.0}
    attention = {"op": "decode_attention", "policy": "corun", "target": "bw_fraction >= 0.6",
                 "bound_us": 4.0}
    records = [
        {**rope, "M": 1, "us": 2.0, "bw_fraction": 0.5, "copy_us": 4.0},  # copy 0.25, ours 2x
        {**rope, "M": 8, "us": 2.0, "bw_fraction": 0.5, "copy_us": 2.0},  # copy 0.5
        {**rope, "M": 64, "us": 2.0, "bw_fraction": 0.5},  # before the copy was timed
        {**attention, "us": 8.0, "bw_fraction": 0.5, "copy_us": 5.0},  # copy 0.8, ours 0.62
    ]
    head = {**HEAD, "machine": "NVIDIA H100 80GB HBM3"}
    text = render_block(tmp_path, monkeypatch, "kernels-h100", head, records,
                        block="kernels-h100-targets")
    assert "`experiments/results/kernels-h100.json`" in text
    assert _row(text, "RoPE")[2].endswith(
        ". Torch's device copy of the same bytes (graph-replayed; half of them written, so a "
        "reference, not a floor) reaches median 0.38 (0.25-0.50) of the bound, below the "
        "target's 0.6 itself; the kernel runs at median 1.50 (1.00-2.00) of the copy's speed "
        "(2 of 3 rows measured)")
    assert _row(text, "RoPE")[3] == "no"
    assert ("reaches median 0.80 (0.80-0.80) of the bound, at or above the target's 0.6; the "
            "kernel runs at median 0.62") in _row(text, "decode attention at B <= 8 (")[2]
    older = [{k: v for k, v in r.items() if k != "copy_us"} for r in records]
    plain = render_block(tmp_path, monkeypatch, "kernels-h100", head, older,
                         block="kernels-h100-targets")
    assert "device copy" not in plain


def test_attention_rows_say_what_their_launches_cost_empty(tmp_path, monkeypatch):
    """Rows that carry ``launch_floor_us`` (their launches with empty kernels at the same grids)
    say the floor and the most those launches reach with the bytes at the bound on top,
    bound / (bound + floor), counting the rows where that is under the target; the fused row says
    its own; rows without it say nothing more."""
    attention = {"op": "decode_attention", "target": "bw_fraction >= 0.6", "bound_us": 6.0}
    records = [
        {**attention, "policy": "corun", "us": 12.0, "bw_fraction": 0.5,
         "launch_floor_us": 6.0},  # at most 6 / 12 = 0.5
        {**attention, "policy": "corun", "us": 8.0, "bw_fraction": 0.75,
         "launch_floor_us": 2.0},  # at most 6 / 8 = 0.75
        {**attention, "policy": "corun_fused", "us": 10.0, "bw_fraction": 0.6,
         "launch_floor_us": 4.0},  # at most 6 / 10 = 0.6: not under the target
    ]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, records,
                        block="kernels-h200-targets")
    assert _row(text, "decode attention at B <= 8 (")[2].endswith(
        ". Their launches with empty kernels at the same grids take median 4.00 us (2.00-6.00); "
        "with the bytes at the bound on top, those launches reach at most median 0.62 "
        "(0.50-0.75) of the bound, under the target's 0.6 at 1 of 2 rows")
    assert _row(text, "decode attention at B <= 8, fused")[2].endswith(
        "reach at most median 0.60 (0.60-0.60) of the bound, under the target's 0.6 at 0 of 1 "
        "rows")
    older = [{k: v for k, v in r.items() if k != "launch_floor_us"} for r in records]
    plain = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, older,
                         block="kernels-h200-targets")
    assert "empty kernels" not in plain


def test_mla_decode_rows_add_the_products_alone_from_the_same_cards_probe(tmp_path, monkeypatch):
    """With the card's probe-mla-dots file beside its kernels file, each MLA decode row says what
    the loop's two products alone reach of the peak where the grid fills the card (B >= 64; the
    B 32 point is left out) against what the target asks there; another card's file (or none)
    adds nothing."""
    probe = {"probe": "mla_dots", "context": 4096}
    (tmp_path / "probe-mla-dots-h100.json").write_text(json.dumps([HEAD, *[
        {**probe, "batch": 32, "dots_of_peak": 0.2, "target_of_peak": 0.43},
        {**probe, "batch": 64, "dots_of_peak": 0.40, "target_of_peak": 0.43},
        {**probe, "batch": 128, "dots_of_peak": 0.41, "target_of_peak": 0.45},
    ]]))
    head = {**HEAD, "machine": "NVIDIA H100 80GB HBM3"}
    text = render_block(tmp_path, monkeypatch, "kernels-h100", head, _records(0.9),
                        block="kernels-h100-targets")
    note = ("The loop's two products alone (`experiments/results/probe-mla-dots-h100.json`: the "
            "literal tile and step order, a contiguous cache, no softmax or splits) reach "
            "0.40-0.41 of the peak at B >= 64, under the 0.43-0.45 the target asks at those "
            "points")
    assert _row(text, "MLA decode, corun_split512")[2].endswith(note)
    assert _row(text, "MLA decode, default")[2].endswith(note)
    other = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, _records(0.9),
                         block="kernels-h200-targets")
    assert "products alone" not in other


def test_mla_prefill_row_adds_the_products_alone_from_the_same_cards_probe(tmp_path, monkeypatch):
    """With the card's probe-mla-prefill file beside its kernels file, the MLA prefill row says
    what the loop reaches of SDPA's speed with the softmax taken out and the softmax's share of
    the kernel's time (equal ends print once), naming the probe's Triton; another card's file
    (or none) adds nothing."""
    probe = {"probe": "mla_prefill_dots"}
    (tmp_path / "probe-mla-prefill-h100.json").write_text(json.dumps([{**HEAD, "triton": "3.6"}, *[
        {**probe, "length": 512, "dots_of_sdpa": 0.97, "softmax_share": 0.18},
        {**probe, "length": 4096, "dots_of_sdpa": 1.08, "softmax_share": 0.18},
    ]]))
    head = {**HEAD, "machine": "NVIDIA H100 80GB HBM3"}
    text = render_block(tmp_path, monkeypatch, "kernels-h100", head, _records(0.9),
                        block="kernels-h100-targets")
    assert _row(text, "MLA prefill")[2].endswith(
        ". The loop's products alone (`experiments/results/probe-mla-prefill-h100.json`: the "
        "kernel's tile, the softmax taken out) run at 0.97-1.08 of SDPA's speed; the softmax, "
        "which Triton 3.6 runs after them on sm_90 (no wgmma left in flight in the kernel, "
        "offline), takes 18% of the kernel's time")
    other = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, _records(0.9),
                         block="kernels-h200-targets")
    assert "softmax taken out" not in _row(other, "MLA prefill")[2]


def test_attention_rows_say_which_rows_a_lighter_rows_time_holds_under_the_target(
        tmp_path, monkeypatch):
    """Each target row's floor is the fastest other row of its policy with no more sequences,
    splits a sequence or tokens, each program walking the same split: a row reaches at most its
    bound over that time. Rows past it in any respect (more sequences here) are no floor."""
    base = {"op": "decode_attention", "policy": "corun", "split_size": 256, "peer": "sdpa",
            "peer_us": 1.0, "ratio": 1.0}
    records = [
        {**base, "M": 1, "context": 512, "num_splits": 2, "us": 10.0, "bound_us": 0.7,
         "bw_fraction": 0.07},  # no target row: the floor of the two below
        {**base, "M": 1, "context": 4096, "num_splits": 16, "us": 11.0, "bound_us": 5.0,
         "bw_fraction": 0.45, "target": "bw_fraction >= 0.6"},  # at most 5 / 10 = 0.5
        {**base, "M": 1, "context": 32768, "num_splits": 128, "us": 60.0, "bound_us": 45.0,
         "bw_fraction": 0.75, "target": "bw_fraction >= 0.6"},  # at most 1.0
        {**base, "M": 8, "context": 256, "num_splits": 1, "us": 4.0, "bound_us": 3.0,
         "bw_fraction": 0.75, "target": "bw_fraction >= 0.6"},  # B 8: no lighter row
    ]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, records,
                        block="kernels-h200-targets")
    assert _row(text, "decode attention at B <= 8 (")[2].endswith(
        ". Each row's floor, the policy's fastest other row with no more sequences, splits or "
        "tokens (its programs walking the same split): these rows reach at most median 1.00 "
        "(0.50-1.00) of the bound, under the target's 0.6 at 1 of 3 rows (B 1 at 4096 tokens, "
        "5.00 us of bound: the floor B 1 at 512 tokens, 10.00 us)")


def test_the_targets_say_which_tuned_tables_the_gemm_rows_read(tmp_path, monkeypatch):
    """Rows from before the tables were per card say nothing; rows that record them name each
    card's file over the H200's."""
    head = {**HEAD, "machine": "NVIDIA H100 80GB HBM3"}
    older = render_block(tmp_path, monkeypatch, "kernels-h100", head, _records(0.9),
                         block="kernels-h100-targets")
    assert "ran the policies' picks" not in older
    tables = ["gemm_h200.json", "gemm_h100.json"]
    records = [{**r, "tuned_tables": tables} if r["op"] == "gemm" else r for r in _records(0.9)]
    text = render_block(tmp_path, monkeypatch, "kernels-h100", head, records,
                        block="kernels-h100-targets")
    assert ("The GEMM rows ran the policies' picks from `kernels/tuned/gemm_h100.json` over "
            "`kernels/tuned/gemm_h200.json`.") in text
