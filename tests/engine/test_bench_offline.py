"""The offline benchmark and the sweep stay runnable: their CPU paths on a tiny model write the
results files the README renders (header, one record per variant, the audit and profile fields)."""

from __future__ import annotations

import json

import pytest

from corun.config import ENGINE_DEFAULTS
from experiments import bench_offline, sweep_offline

TINY = ["--model", "tiny-qwen3", "--device", "cpu", "--dtype", "float32", "--num-requests", "6",
        "--input-len", "8", "40", "--output-len", "3", "--max-num-seqs", "4"]


def test_bench_offline_writes_records_with_audits(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_offline.main([*TINY, "--max-num-batched-tokens", "64", "--corun-set",
                        "prefill_step_tokens=64", "prefill_chunk_size=32",
                        "prefill_token_budget=64", "--audit-requests", "3", "--alone-sample", "2",
                        "--modes", "corun", "default", "--name", "offline-test"])
    head, *records = json.loads((tmp_path / "offline-test.json").read_text())
    assert head["header"] and head["model"] == "tiny-qwen3"
    assert [r["mode"] for r in records] == ["corun", "default"]
    corun = records[0]
    assert corun["mismatches"] == 0 and corun["alone_sample"] == 2
    assert corun["prefill_steps"] >= 1 and corun["decode_steps"] >= 1
    assert "throughput_vs_default" in corun and (tmp_path / "offline-test.png").exists()
    # The interpreter compiles nothing; on a GPU this counts the warm-up's misses.
    assert corun["jit_compiles_timed"] == 0 and corun["jit_compiled_kernels"] == []


@pytest.mark.parametrize("compiling_runs, reruns, recorded, discarded", [
    (1, 1, 0, [3]),  # the warm-up missed shapes: the run is repeated, the clean one recorded
    (5, 1, 3, [3]),  # still compiling after its reruns: the last run is recorded, with its count
    (5, 2, 3, [3, 3]),
    (1, 0, 3, []),  # reruns off
])
def test_a_main_run_that_compiled_is_run_again(tmp_path, monkeypatch, compiling_runs, reruns,
                                               recorded, discarded):
    """A timed run in which Triton compiled (the warm-up missed a shape) is not the one recorded:
    on the H200 the dynamic peers' first runs compiled 2-10 kernels, seconds of their wall time."""
    import contextlib

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    calls = []

    @contextlib.contextmanager
    def fake_count():  # compiles three kernels in each of the first `compiling_runs` main runs
        calls.append(1)
        yield ["_gemm_kernel"] * 3 if len(calls) <= compiling_runs else []

    monkeypatch.setattr(bench_offline, "count_jit_compiles", fake_count)
    bench_offline.main([*TINY, "--max-num-batched-tokens", "64", "--no-audit", "--modes",
                        "default", "--reruns-if-compiled", str(reruns), "--name", "rerun-test"])
    _, record = json.loads((tmp_path / "rerun-test.json").read_text())
    assert len(calls) == min(compiling_runs, reruns) + 1
    assert record["jit_compiles_timed"] == recorded
    assert [run["jit_compiles"] for run in record["discarded_runs"]] == discarded
    assert all(run["wall_s"] > 0 for run in record["discarded_runs"])
    assert record["requests"] == 6 and record["output_tok_s"] > 0


def test_reruns_if_compiled_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        bench_offline.build_parser().parse_args(["--reruns-if-compiled", "-1"])
    assert "expected an int >= 0" in capsys.readouterr().err


def test_an_ablation_point_that_compiled_is_run_again(tmp_path, monkeypatch):
    """sweep_offline.measure_point (every ablation point) records its clean rerun too."""
    import contextlib

    from experiments import ablate

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    calls = []

    @contextlib.contextmanager
    def fake_count():  # the first timed run of every point compiles
        calls.append(1)
        yield ["_gemm_kernel"] if len(calls) % 2 == 1 else []

    monkeypatch.setattr(bench_offline, "count_jit_compiles", fake_count)
    ablate.main(["overlap", "--dry-run", "--modes", "corun", "--values", "false", "--name",
                 "overlap-test"])
    _, *records = json.loads((tmp_path / "overlap-test.json").read_text())
    assert records and all(r["jit_compiles_timed"] == 0 for r in records)
    assert all([run["jit_compiles"] for run in r["discarded_runs"]] == [1] for r in records)


def test_sweep_dry_run_writes_points(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    sweep_offline.main([*TINY, "--dry-run", "--points", "base", "overlap,budget=1T",
                        "default,tokens=256", "--name", "sweep-test"])
    head, *records = json.loads((tmp_path / "sweep-test.json").read_text())
    assert {r["point"] for r in records} == {"base", "overlap,budget=1T", "default,tokens=256"}
    assert all(r["output_tok_s"] > 0 for r in records)
    # default's point runs first: a run its time budget cuts still has --print-best's reference.
    assert records[0]["point"] == "default,tokens=256"


def test_best_corun_settings_compares_each_run_to_its_own_default():
    """A corun point of a shorter run (lower absolute tokens/s) wins when it is further ahead of
    the default point of its own run; points recorded before a field existed take its default."""
    from experiments.sweep_offline import best_corun_settings

    def point(mode: str, tok_s: float, **config) -> dict:
        return {"output_tok_s": tok_s, "config": {"mode": mode, **config}}

    long_run = [point("corun", 3800.0, prefill_step_tokens=4096), point("default", 3900.0)]
    short_run = [point("corun", 3000.0, prefill_step_tokens=8192, decode_split_size=1024),
                 point("default", 2900.0)]
    settings = best_corun_settings([long_run, short_run])
    assert "prefill_step_tokens=8192" in settings and "decode_split_size=1024" in settings
    settings = best_corun_settings([long_run])
    default_split = ENGINE_DEFAULTS["decode_split_size"]
    assert "prefill_step_tokens=4096" in settings
    assert f"decode_split_size={default_split}" in settings
    with pytest.raises(ValueError, match="default point"):
        best_corun_settings([[point("corun", 1.0)]])


def test_bench_offline_shared_prefix_compares_caching_on_and_off(tmp_path, monkeypatch):
    """The shared-prefix workload, caching on and off per mode: the on record hits, both run
    the same requests (the n = 4 one included), and corun's outputs are the same bits."""
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    bench_offline.main([
        "--model", "tiny-qwen3", "--device", "cpu", "--dtype", "float32", "--num-requests", "6",
        "--workload", "shared-prefix", "--num-system-prompts", "2", "--system-len", "40", "56",
        "--question-len", "3", "6", "--n-request", "4", "--output-len", "3",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--corun-set",
        "prefill_step_tokens=64", "prefill_chunk_size=16", "prefill_token_budget=64",
        "--audit-requests", "3", "--alone-sample", "3", "--prefix-caching", "both",
        "--modes", "corun", "batch_invariant", "--name", "offline-prefix-test"])
    head, *records = json.loads((tmp_path / "offline-prefix-test.json").read_text())
    assert head["workload"]["kind"] == "shared-prefix"
    assert [r["mode"] for r in records] == ["corun", "corun_nocache", "batch_invariant",
                                            "batch_invariant_nocache"]
    on, off = records[0], records[1]
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_queries"] == 0
    assert 0 < on["prefix_cache_hit_rate"] < 1 and on["requests"] == off["requests"] == 7
    for record in records[0::2]:
        assert record["mismatches_vs_nocache"] == 0 and record["mismatches"] == 0
        assert "throughput_vs_nocache" in record and "ttft_p50_vs_nocache" in record


def test_offline_percentiles_interpolate_as_numpy():
    """p50 of an even count is the mean of the middle two (it was the upper one)."""
    from experiments.offline_stats import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0], 0.99) == 1.99 and percentile([], 0.5) is None
