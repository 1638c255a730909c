"""bench_paper's dry run: the tiny twins of the paper's three families on the CPU write a results
file with a header that says how deep each run is, one record per (model, mode), and corun's
changes against its peers in the paper's form."""

from __future__ import annotations

import json

from experiments import bench_paper


def test_dry_run_covers_the_three_families_over_two_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    common = ["--dry-run", "--modes", "default", "corun", "--num-requests", "4", "--name"]
    bench_paper.main([*common, "paper-first", "--models", "qwen3-235b-a22b", "deepseek-v3"])
    # A second call (one model per device call) keeps the first call's models.
    bench_paper.main([*common, "paper-test", "--models", "hy3", "--merge",
                      str(tmp_path / "paper-first.json")])
    head, *records = json.loads((tmp_path / "paper-test.json").read_text())
    assert head["header"] and head["paper_claims"]["ttft_change_pct_mean"] == -51.8
    assert set(head["truncation"]) == {"qwen3-235b-a22b", "deepseek-v3", "hy3"}
    assert head["truncation"]["hy3"]["config"] == "tiny-hy3"
    # Each family names the call that measured it.
    assert set(head["commands"]) == set(head["truncation"])
    assert "hy3" in head["commands"]["hy3"] and "paper-first" in head["commands"]["deepseek-v3"]
    assert [(r["model"], r["mode"]) for r in records] == [
        (f, m) for f in ("qwen3-235b-a22b", "deepseek-v3", "hy3") for m in ("default", "corun")]
    assert not [r for r in records if "error" in r] and all("measured_at" in r for r in records)
    png = tmp_path / "paper-test.png"
    assert png.stat().st_size > 0
    png.unlink()
    bench_paper.main(["--replot", str(tmp_path / "paper-test.json")])
    assert png.stat().st_size > 0
    for corun in (r for r in records if r["mode"] == "corun"):
        assert corun["mismatches"] == 0 and corun["output_tok_s"] > 0
        assert "throughput_change_pct_vs_default" in corun and "tpot_change_pct_vs_default" in corun


def test_truncated_configs_fit_one_h200_with_room_for_kv():
    for family, (name, _) in bench_paper.FAMILIES.items():
        info = bench_paper.truncation(family, name)
        assert info["layers"] < info["full_layers"] and info["moe_layers"] >= 1
        assert info["bf16_weight_gb"] < 0.75 * bench_paper.H200_BYTES / 1e9


def test_plot_of_failed_modes_draws_nothing_and_does_not_raise(tmp_path):
    """A first mode that failed (say, out of memory) must not stop the run at its plot."""
    path = tmp_path / "paper.png"
    bench_paper.plot([{"model": "hy3", "mode": "default", "error": "OutOfMemoryError"}], path)
    assert not path.exists()
    bench_paper.plot([{"model": "hy3", "mode": "corun", "output_tok_s": 1.0, "ttft_ms_mean": 2.0,
                       "tpot_ms_mean": 3.0}], path)
    assert path.stat().st_size > 0


def test_a_cut_run_keeps_the_earlier_records_of_an_unfinished_family(tmp_path, monkeypatch):
    """The file is written after every family: a run cut in its second family (the device
    call's time limit) keeps that family's earlier records whole, with the first one's new."""
    from experiments import bench_offline

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    common = ["--dry-run", "--modes", "default", "corun", "--num-requests", "4", "--name"]
    bench_paper.main([*common, "paper-first", "--models", "qwen3-235b-a22b", "deepseek-v3"])
    earlier = json.loads((tmp_path / "paper-first.json").read_text())[1:]
    bench_variant = bench_offline.bench_variant
    calls = []

    def cut_in_deepseek(mode, model, args, work):
        calls.append(args.model)
        if args.model == "tiny-deepseek-v3" and mode == "corun":
            raise KeyboardInterrupt
        return bench_variant(mode, model, args, work)

    monkeypatch.setattr(bench_offline, "bench_variant", cut_in_deepseek)
    try:
        bench_paper.main([*common, "paper-cut", "--models", "hy3", "deepseek-v3", "--merge",
                          str(tmp_path / "paper-first.json")])
    except KeyboardInterrupt:
        pass
    head, *records = json.loads((tmp_path / "paper-cut.json").read_text())
    assert [(r["model"], r["mode"]) for r in records] == [
        (f, m) for f in ("qwen3-235b-a22b", "deepseek-v3", "hy3") for m in ("default", "corun")]
    deepseek = [r for r in records if r["model"] == "deepseek-v3"]
    assert [r["measured_at"] for r in deepseek] == [
        r["measured_at"] for r in earlier if r["model"] == "deepseek-v3"]
    assert "paper-first" in head["commands"]["deepseek-v3"] and "hy3" in head["commands"]["hy3"]


def test_a_cut_run_keeps_the_finished_modes_of_a_new_family(tmp_path, monkeypatch):
    """Nothing earlier to protect: the modes a cut run finished are written."""
    from experiments import bench_offline

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_variant = bench_offline.bench_variant

    def cut_at_corun(mode, model, args, work):
        if mode == "corun":
            raise KeyboardInterrupt
        return bench_variant(mode, model, args, work)

    monkeypatch.setattr(bench_offline, "bench_variant", cut_at_corun)
    try:
        bench_paper.main(["--dry-run", "--modes", "default", "corun", "--num-requests", "4",
                          "--name", "paper-new", "--models", "hy3"])
    except KeyboardInterrupt:
        pass
    _, *records = json.loads((tmp_path / "paper-new.json").read_text())
    assert [(r["model"], r["mode"]) for r in records] == [("hy3", "default")]
