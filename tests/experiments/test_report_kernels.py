"""The kernel tables count only live checks: a check of a superseded policy or pairing, and a
finding recorded either way, are listed with their reason but left out of the pass count, and a
failing live check is still counted and pointed at."""

from __future__ import annotations

from tests.experiments.rendering import render_block

HEAD = {"header": True, "machine": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
        "date": "d", "command": "c", "families": ["gemm"], "timing": "graph replay"}
TIMING = {"op": "gemm", "policy": "corun", "M": 64, "N": 64, "K": 64, "dtype": "bf16",
          "us": 2.0, "peer": "cublas", "peer_us": 2.0, "ratio": 1.0}


def _check(name: str, passed: bool, **extra: str) -> dict:
    return {"op": "gemm", "check": name, "mode": "corun", "shape": [64, 64, 64],
            "passed": passed, "detail": "d", **extra}


def _render(tmp_path, monkeypatch, records: list[dict], block: str) -> str:
    return render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, [TIMING, *records], block)


def test_superseded_and_informative_checks_are_listed_not_counted(tmp_path, monkeypatch):
    records = [_check("position", True), _check("old_pairing", False, superseded="old rule"),
               _check("block_k", False, informative="Hopper keeps bits")]
    summary = _render(tmp_path, monkeypatch, records, "kernels-h200-summary")
    assert "1 of 1 as expected." in summary
    assert "Not counted: 1 of a superseded policy or check and 1 recorded as findings" in summary
    assert "failing ones" not in summary
    table = _render(tmp_path, monkeypatch, records, "kernels-h200")
    assert "| superseded: old rule |" in table
    assert "| finding (bits kept): Hopper keeps bits |" in table
    assert "FAIL" not in table


def test_a_failing_live_check_is_counted_and_pointed_at(tmp_path, monkeypatch):
    records = [_check("position", True), _check("batch", False)]
    summary = _render(tmp_path, monkeypatch, records, "kernels-h200-summary")
    assert "1 of 2 as expected (the failing ones are listed" in summary
    assert "Not counted" not in summary
    assert "| batch | corun | [64, 64, 64] | FAIL |" in _render(
        tmp_path, monkeypatch, records, "kernels-h200")


def test_ptxas_view_lists_every_launch(tmp_path, monkeypatch):
    head = {**HEAD, "ptxas": "Build cuda_12.8", "shape": "s", "shared_limit_bytes": 232448}
    rows = [{"case": "64 x 32, 8 warps", "kernel": "k", "registers": 255, "spill_store_bytes": 320,
             "spill_load_bytes": 220, "shared_bytes": 151552, "fits_shared": True, "wgmma": 40,
             "cp_async": 18, "tma_loads": 0},
            {"case": "bad", "kernel": "k", "error": "OutOfResources"}]
    text = render_block(tmp_path, monkeypatch, "ptxas-gemm-sm90", head, rows)
    assert "| 64 x 32, 8 warps | k | 255 | 320 | 220 | 151552 | yes | 40 | 18 | 0 |  |" in text
    assert "| bad | k | — | — | — | — | no | — | — | — | OutOfResources |" in text
    assert "ptxas Build cuda_12.8; s; shared memory limit 232448 bytes a block." in text


def _summary_row(text: str, op: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {op} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_summary_median_of_an_even_count_is_the_mean_of_the_middle_two(tmp_path, monkeypatch):
    # The targets table (statistics.median) and the summary must give one median for one set of
    # rows: over ratios 1, 2, 3, 4 that is 2.50 (the upper middle, 3.00, is not the median).
    rows = [{**TIMING, "M": m, "us": 1.0, "peer_us": r, "ratio": r, "bw_fraction": r / 10}
            for m, r in ((1, 1.0), (8, 2.0), (32, 3.0), (64, 4.0))]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, rows, "kernels-h200-summary")
    assert _summary_row(text, "gemm")[4:9] == ["1.00", "2.50", "4.00", "0.25", "0.40"]


def test_summary_names_every_peer_of_a_group_timed_against_several(tmp_path, monkeypatch):
    # A row op's peer is the fastest of its peers at that shape: a group whose rows were timed
    # against different peers must not be labelled with its first row's alone.
    rows = [{**TIMING, "op": "rope", "M": m, "peer": peer}
            for m, peer in ((1, "liger"), (8, "torch-compile"), (32, "torch-compile"))]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, rows, "kernels-h200-summary")
    assert _summary_row(text, "rope")[3] == "torch-compile (2), liger (1)"
    one = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, [TIMING],
                       "kernels-h200-summary")
    assert _summary_row(one, "gemm")[3] == "cublas"


def test_rows_above_the_bound_that_cannot_sit_in_l2_are_named_apart(tmp_path, monkeypatch):
    # 8.8 us of bound is ~38 MB moved: inside the L2 story. 4465 us is ~19 GB: no L2 holds it,
    # so the note must not explain it by L2 residency.
    small = {**TIMING, "op": "silu_mul", "bound_us": 8.779, "bw_fraction": 1.35}
    moe = {**TIMING, "op": "moe_layer", "M": 64, "us": 4329.9, "peer_us": 6231.2, "ratio": 1.44,
           "bound_us": 4465.471, "bw_fraction": 1.0313}
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, [small, moe],
                        "kernels-h200-summary")
    assert ("Not so for moe_layer corun (1 row, 19.2 GB, up to 1.03 of the bound): they move "
            "more than twice what the L2 holds") in text
    assert "silu_mul corun (" not in text
    only_small = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, [small],
                              "kernels-h200-summary")
    assert "Not so for" not in only_small and "does not bind there." in only_small


def test_rows_whose_peer_is_marked_invalid_show_no_ratio(tmp_path, monkeypatch):
    # run14 timed logits_digest against LogitsDigest.__call__, which is the kernel itself on
    # CUDA: its 1.00 is no ratio to a peer. The kernel's own time and bound fraction stand.
    why = "the peer called this kernel"
    rows = [{**TIMING, "op": "logits_digest", "M": m, "peer": "torch LogitsDigest",
             "us": 5.0, "peer_us": 5.0, "ratio": 1.0, "bw_fraction": 0.3, "peer_invalid": why}
            for m in (1, 64)]
    summary = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, [TIMING, *rows],
                           "kernels-h200-summary")
    assert _summary_row(summary, "logits_digest")[2:] == [
        "2", "torch LogitsDigest (invalid)", "—", "—", "—", "0.30", "0.30"]
    assert _summary_row(summary, "gemm")[4:7] == ["1.00", "1.00", "1.00"]
    assert f"No peer/ours where the peer is marked invalid in the file: logits_digest: {why}." \
        in summary
    table = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, rows, "kernels-h200")
    assert "| torch LogitsDigest (invalid) | 5.0 | — | 0.30 |" in table


def test_full_table_tells_rows_of_one_op_and_shape_apart(tmp_path, monkeypatch):
    # Decode attention's M, N, K are batch, q heads and head dim: its contexts (and sampling's
    # configs, the sort's BLOCK_M) only show in the point column.
    rows = [{**TIMING, "op": "decode_attention", "M": 8, "N": 32, "K": 128, "context": ctx}
            for ctx in (512, 2048)]
    rows += [{**TIMING, "op": "sample", "M": 1, "N": 151936, "K": 0, "config": label}
             for label in ("greedy", "plain")]
    rows.append({**TIMING, "op": "moe_align", "shape": "deepseek-v3", "block_m": 64})
    table = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, rows, "kernels-h200")
    for cells in ("| decode_attention | corun | ctx 512 | 8 | 32 | 128 |",
                  "| decode_attention | corun | ctx 2048 | 8 | 32 | 128 |",
                  "| sample | corun | greedy | 1 | 151936 | 0 |",
                  "| sample | corun | plain | 1 | 151936 | 0 |",
                  "| moe_align | corun | deepseek-v3, BLOCK_M 64 | 64 | 64 | 64 |"):
        assert cells in table


def test_decode_attention_target_counts_the_rows_that_fit_the_l2(tmp_path, monkeypatch):
    # Graph replays do not flush the L2: a row that moves less than it may read K/V from there,
    # and the targets row says how many of its rows are such (bound_us at 4.3 TB/s: 2 us moves
    # about 8.6 MB, 20 us about 86 MB).
    rows = [{**TIMING, "op": "decode_attention", "M": 8, "context": ctx, "target": True,
             "us": 4.0, "bound_us": bound, "bw_fraction": bound / 4.0}
            for ctx, bound in ((512, 2.0), (8192, 20.0))]
    text = render_block(tmp_path, monkeypatch, "kernels-h200", HEAD, rows, "kernels-h200-targets")
    assert "1 of these 2 rows move less than the 50 MB L2" in text


def test_ratio_plot_leaves_out_invalid_peers_and_superseded_policies():
    from experiments.bench_kernels import plotted

    rows = [{**TIMING, "op": "logits_digest", "peer_invalid": "timed itself"},
            {**TIMING, "superseded": "old policy"}, TIMING]
    assert plotted(rows) == [TIMING]


def test_an_h100_kernels_file_renders_with_its_own_bandwidth(tmp_path, monkeypatch):
    """A kernels file of another card (bench_kernels names it after the card) renders under its
    own name, and its notes read the copy rate its header says its bounds assume (the H100's
    3.0 TB/s, datasheet 3.35), not the H200's."""
    head = {**HEAD, "machine": "NVIDIA H100 80GB HBM3", "copy_bandwidth_bytes_per_s": 3.0e12,
            "copy_bandwidth_card": "h100"}
    # 4465 us at 3.0 TB/s is 13.4 GB moved (19.2 GB at the H200's rate)
    moe = {**TIMING, "op": "moe_layer", "us": 4329.9, "peer_us": 6231.2, "ratio": 1.44,
           "bound_us": 4465.471, "bw_fraction": 1.0313}
    text = render_block(tmp_path, monkeypatch, "kernels-h100", head, [moe], "kernels-h100-summary")
    assert "`experiments/results/kernels-h100.json`" in text
    assert "moe_layer corun (1 row, 13.4 GB, up to 1.03 of the bound)" in text
    assert "HBM bound (3.0 TB/s copy rate)" in text and "peak is 3.35 TB/s" in text


def test_bounds_are_computed_at_the_timed_card_s_copy_rate(monkeypatch):
    from experiments import harness

    monkeypatch.setattr(harness, "card_tag", lambda: "h100")
    assert harness.memory_bound_us(3e6) == 1.0 and harness.bandwidth_label() == "3.0 TB/s"
    assert harness.header()["copy_bandwidth_bytes_per_s"] == 3.0e12
    monkeypatch.setattr(harness, "card_tag", lambda: "x86_64")  # none measured: the H200's
    assert harness.memory_bound_us(4.3e6) == 1.0
    assert harness.header()["copy_bandwidth_card"].startswith("h200 (none measured")


def test_tuned_prefill_table_renders_every_candidate_beside_the_peer(tmp_path, monkeypatch):
    """A tuned table's layout ({"header", "entries"}) loads like a records file; tune_mla's prefill
    entry renders the peer first, then each tile by its time at the longest length, each time
    with its share of the peer's speed, the pick marked."""
    import json

    from experiments import report

    pick = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "tma": True}
    other = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    entry = {"kind": "prefill", "lengths": [512, 4096], "config": pick, "sdpa_us": [50.0, 1400.0],
             "candidates": [{"config": pick, "us": [55.0, 1700.0]},
                            {"config": other, "us": [60.0, 1600.0]}]}
    (tmp_path / "tune-mla-prefill-h100.json").write_text(
        json.dumps({"header": HEAD, "entries": [entry]}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = report.render_readme("<!-- results:tune-mla-prefill-h100 -->\n"
                                "<!-- /results:tune-mla-prefill-h100 -->")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tile" not in line]
    assert rows == [
        "| SDPA (v padded), the peer | 50.0 | 1400.0 |",
        "| 128 x 64, 8 warps, 3 stages | 60.0 (0.83) | 1600.0 (0.88) |",
        "| 64 x 64, 4 warps, 2 stages, TMA-fed (the pick) | 55.0 (0.91) | 1700.0 (0.82) |",
    ]


def test_tuned_gemm_change_renders_both_runs_at_each_point(tmp_path, monkeypatch):
    """Two tune_gemm runs of the same points: each point's best against cuBLAS before and after,
    the after-run's pick, and a summary of both runs' minimum, median and count at >= 0.85."""
    import json

    from experiments import report

    def entry(layer: str, m: int, ratio: float, tma: bool = False) -> dict:
        config = {"block_m": 128, "block_n": 256, "block_k": 64, "split_k": 1, "num_warps": 8,
                  "num_stages": 3, "tma": tma}
        return {"layer": layer, "m": m, "ratio_vs_cublas": ratio, "config": config}

    for name, entries in (("tune-gemm-deepseek-large-m-h100-before",
                           [entry("ds.kv_a", 512, 0.6), entry("ds.o", 512, 0.9)]),
                          ("tune-gemm-deepseek-large-m-h100",
                           [entry("ds.o", 512, 0.95, True), entry("ds.kv_a", 512, 0.8, True)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"header": HEAD, "entries": entries}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = report.render_readme("<!-- results:tune-gemm-deepseek-large-m-h100 -->\n"
                                "<!-- /results:tune-gemm-deepseek-large-m-h100 -->")
    assert ("min 0.60, median 0.75, 1 of 2 at >= 0.85 before "
            "(`experiments/results/tune-gemm-deepseek-large-m-h100-before.json`); min 0.80, "
            "median 0.88, 1 of 2 at >= 0.85 after.") in text
    assert ("| ds.kv_a | 512 | 0.60 | 0.80 | — | 128 x 256 x 64, split 1, 8 warps, 3 stages, "
            "TMA-fed |") in text
    # one run alone: its best at each point and the candidates timed there
    (tmp_path / "tune-gemm-qwen3-8b-mid-m-h100.json").write_text(json.dumps(
        {"header": HEAD, "entries": [{**entry("q.qkv", 128, 0.79), "candidates": 65}]}))
    alone = report.render_readme("<!-- results:tune-gemm-qwen3-8b-mid-m-h100 -->\n"
                                 "<!-- /results:tune-gemm-qwen3-8b-mid-m-h100 -->")
    assert "the best candidate at each point: min 0.79, median 0.79, 0 of 1 at >= 0.85." in alone
    assert "| q.qkv | 128 | 0.79 | 65 | 128 x 256 x 64, split 1, 8 warps, 3 stages |" in alone
    # an after-run of more points: compared at the before-run's points, then summarised whole
    (tmp_path / "tune-gemm-qwen3-8b-mid-m-h100.json").write_text(json.dumps(
        {"header": HEAD, "entries": [entry("ds.kv_a", 512, 0.6), entry("ds.o", 512, 0.9)]}))
    wider_entries = [entry("ds.o", 512, 0.95), entry("ds.kv_a", 512, 0.8), entry("q.qkv", 128, 0.5)]
    (tmp_path / "tune-gemm-mid-m-deep-h100.json").write_text(json.dumps(
        {"header": HEAD, "entries": wider_entries}))
    wider = report.render_readme("<!-- results:tune-gemm-mid-m-deep-h100 -->\n"
                                 "<!-- /results:tune-gemm-mid-m-deep-h100 -->")
    assert ("min 0.60, median 0.75, 1 of 2 at >= 0.85 before (`experiments/results/"
            "tune-gemm-qwen3-8b-mid-m-h100.json`); min 0.80, median 0.88, 1 of 2 at >= 0.85 "
            "after, and at all 3 of its points min 0.50, median 0.80, 1 of 3 at >= 0.85.") in wider
    assert "| q.qkv | 128 | — | 0.50 |" in wider


def test_tuning_views_render_a_cut_run(tmp_path, monkeypatch):
    """A tune_mla file cut before its prefill entry, and a narrowed tune_gemm file cut before its
    first point, render as such instead of failing the whole README."""
    import json

    from experiments import report

    for name in ("tune-mla-prefill-h100", "tune-gemm-qwen3-8b-mid-m-h100"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"header": HEAD, "entries": []}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = report.render_readme("<!-- results:tune-mla-prefill-h100 -->\n"
                                "<!-- /results:tune-mla-prefill-h100 -->\n"
                                "<!-- results:tune-gemm-qwen3-8b-mid-m-h100 -->\n"
                                "<!-- /results:tune-gemm-qwen3-8b-mid-m-h100 -->")
    assert "_no prefill entry with its candidates' times_" in text and "_no points_" in text


def _probe_record(**extra: object) -> dict:
    def variant(name: str, us: float, reduce_us: float | None = None) -> dict:
        return {"name": name, "config": {}, "us": us, "ratio": round(10.0 / us, 4),
                "reduce_us": reduce_us}

    return {"layer": "q.qkv", "M": 128, "N": 6144, "K": 4096, "cublas_us": 10.0, "pick_us": 12.5,
            "pick_ratio": 0.8, "pick": {},
            "variants": [variant("128x64x64 w4 s3", 12.0), variant("128x64x64 w4 s7", 10.5),
                         variant("128x64x64 w8 s3 split 2", 20.0, 2.5),
                         {"name": "256x64x64 w8 s9", "error": "out of resources"},
                         variant("128x64x128 w8 s3 stream-K 132", 25.0, 4.0)],
            **extra}


def test_mid_m_probe_view_gives_each_kinds_fastest_and_the_floors_each_run_timed(
        tmp_path, monkeypatch):
    """The first run's records have no floors, the second's the copy and the pick's loads, the
    third's the fastest whole tile's loads: each run renders the columns it measured."""
    first = render_block(tmp_path, monkeypatch, "probe-gemm-mid-m-h100-before", HEAD,
                         [_probe_record()])
    assert ("| q.qkv | 128 | 10.00 | 0.80 | 0.95 (128x64x64 w4 s7) | 0.50 (128x64x64 w8 s3 "
            "split 2), reduce 2.50 us | — | 0.40 (128x64x128 w8 s3 stream-K 132), reduce 4.00 us |"
            ) in first
    assert "copy of the weights" not in first and "fastest TMA-fed" not in first
    floors = {"copy_us": 30.0, "loads_only_whole_tiles_us": 9.0, "loads_only_132_shares_us": 8.5}
    second = render_block(tmp_path, monkeypatch, "probe-gemm-mid-m-h100", HEAD,
                          [_probe_record(**floors), _probe_record(layer="q.o")])
    assert "| 30.00 | 9.00 / 8.50 |" in second and "fastest TMA-fed" not in second
    fastest = {"loads_only_fastest_whole": {"name": "128x64x64 w4 s7", "us": 7.25}}
    third = render_block(tmp_path, monkeypatch, "probe-gemm-mid-m-h100", HEAD,
                         [_probe_record(**floors, **fastest), _probe_record(layer="q.o")])
    # 7.25 us against the same tile's whole GEMM, 10.5 us
    assert "| 30.00 | 9.00 / 8.50 | 7.25 (128x64x64 w4 s7), 0.69x its GEMM |" in third
    q_o = next(line for line in third.splitlines() if line.startswith("| q.o |"))
    assert q_o.endswith("| — | — | — |")  # no copy, no pick's loads, no fastest tile's loads


def test_narrow_n_probe_view_gives_the_fastest_parts_and_pair_and_the_pairs_bits(
        tmp_path, monkeypatch):
    pairs = [{"wide": "a", "narrow": "b", "us": 100.0, "ratio": 0.8, "same_bits_as_pick": True},
             {"wide": "c", "narrow": "b", "us": 90.0, "ratio": 0.889, "same_bits_as_pick": False}]
    record = {"layer": "deepseek-v3.kv_a", "M": 8192, "N": 576, "K": 7168, "wide_n": 512,
              "cublas_us": 80.0, "pick_us": 125.0, "pick_ratio": 0.64, "pick": {},
              "wide": {"a": 85.0, "c": 70.0}, "narrow": {"b": 20.0, "d": 15.0}, "pairs": pairs}
    text = render_block(tmp_path, monkeypatch, "probe-gemm-narrow-n-h100", HEAD, [record])
    assert ("| deepseek-v3.kv_a | 8192 | 80.00 | 0.64 (125.00 us) | 70.00 (c) | 15.00 (d) | "
            "0.89 (90.00 us: c + b; not the pick's bits) | 1 of 2 |") in text


def test_tail_probe_view_gives_the_fastest_tails_and_their_bits_against_the_pick(
        tmp_path, monkeypatch):
    pick = {"block_m": 128, "block_n": 128, "block_k": 64, "split_k": 4, "num_warps": 8,
            "num_stages": 4, "tma": True}
    tails = [{"name": "128x(128+64)x64 w8 s3", "us": 20.0, "ratio": 0.7,
              "same_bits_as_pick": None},
             {"name": "128x(128+64)x64 w8 s3 split 4", "us": 16.0, "ratio": 0.875,
              "same_bits_as_pick": True},
             {"name": "128x(128+64)x64 w8 s3 split 8", "us": 15.0, "ratio": 0.933,
              "same_bits_as_pick": None},
             {"name": "64x(128+64)x64 w4 s4 split 2", "error": "out of resources"}]
    record = {"layer": "deepseek-v3.q_a", "M": 256, "N": 1536, "K": 7168, "cublas_us": 14.0,
              "pick_us": 17.0, "pick_ratio": 0.8235, "pick": pick, "tails": tails}
    text = render_block(tmp_path, monkeypatch, "probe-gemm-tail-h100", HEAD, [record])
    assert ("| deepseek-v3.q_a | 256 | 14.00 | 0.82 (128 x 128 x 64, split 4, 8 warps, 4 "
            "stages, TMA-fed) | 0.70 (128x(128+64)x64 w8 s3) | 0.93 (128x(128+64)x64 w8 s3 "
            "split 8) | 1 of 1 | 1 |") in text
