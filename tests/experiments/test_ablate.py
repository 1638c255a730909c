"""The ablations stay runnable: every axis's points are valid engine configs at the H200 scale
and at the dry run's, and the dry runs write records, audits and the PNG."""

from __future__ import annotations

import json

import pytest

from experiments import ablate, ablate_axes


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("axis", list(ablate_axes.AXES))
def test_every_point_is_a_valid_config(axis, dry_run):
    args = ablate.parse_args([axis, "--dry-run"] if dry_run else [axis, "--device", "cpu"])
    plan = ablate_axes.points(axis, None, None, dry_run, args.max_num_seqs)
    assert len({p.label for p in plan}) == len(plan) >= 2
    configs = [ablate.point_config(p, args) for p in plan]  # raises on an invalid combination
    spec = ablate_axes.AXES[axis]
    if axis != "kernel-policy":  # the axis's field really varies within a series
        for variant in spec.modes:
            fields = [tuple(sorted(p.fields.items())) for p in plan if p.variant == variant]
            assert len(set(fields)) == len(fields)
    assert all(c.model == args.model for c in configs)


def test_kernel_policy_dry_run_separates_kernels_from_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    ablate.main(["kernel-policy", "--dry-run", "--values", "corun", "batch_invariant", "default",
                 "--name", "ablate-test"])
    head, *records = json.loads((tmp_path / "ablate-test.json").read_text())
    assert head["axis"] == "kernel-policy" and head["skipped"] == []
    got = [(r["series"], r["kernel_policy"], r["engine_mode"]) for r in records]
    assert got == [("corun schedule", "corun", "corun"),
                   ("corun schedule", "batch_invariant", "corun"),
                   ("corun schedule", "default", "corun"),
                   ("own dynamic schedule", "batch_invariant", "batch_invariant"),
                   ("own dynamic schedule", "default", "default")]
    assert all("error" not in r and r["output_tok_s"] > 0 for r in records)
    # Fixed shapes make every kernel policy deterministic on this CPU; default's own schedule
    # (gemv at M=1 vs gemm) is the negative control.
    assert [r["mismatches"] for r in records[:4]] == [0, 0, 0, 0]
    assert (tmp_path / "ablate-test.png").exists()


def test_stall_budget_points_share_a_runner(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    built = []
    original = ablate.ModelRunner.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ablate.ModelRunner, "__init__", counting)
    ablate.main(["stall-budget", "--dry-run", "--modes", "corun", "--values", "64", "256",
                 "--name", "ablate-budget"])
    _, *records = json.loads((tmp_path / "ablate-budget.json").read_text())
    assert [r["value"] for r in records] == [64, 256] and len(built) == 1
    assert [r["config"]["prefill_token_budget"] for r in records] == [64, 256]


def test_serving_load_dry_run_launches_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    ablate.main(["serving-load", "--dry-run", "--name", "serving-test", "--time-budget-s", "20"])
    head, *records = json.loads((tmp_path / "serving-test.json").read_text())
    assert head["header"] and {r["request_rate"] for r in records} == {4.0, "inf"}
    assert all(r["mode"] == "corun" and r["completed"] >= 1 and not r["failed"] for r in records)
    assert (tmp_path / "serving-test.png").exists()
    # each run records the server's engine steps around it (from /metrics): a run's requests
    # took at least one prefill step and, with more than one output token, decode steps
    for r in records:
        steps = r["engine_steps"]
        assert steps["prefill"] + steps["combined"] >= 1 and steps["decode"] >= 1
        assert r["step_tokens_mean"] > 0
        assert set(r["engine_step_ms_mean"]) == {k for k, n in steps.items() if n}


def test_repeats_keep_the_median_run_and_every_runs_throughput(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    timed = []
    original = ablate.measure_point

    def scripted(config, runner, work, args, label):
        engine, finals, record = original(config, runner, work, args, label)
        record["output_tok_s"] = [30.0, 10.0, 20.0][len(timed) % 3]  # a known order of runs
        timed.append(label)
        return engine, finals, record

    monkeypatch.setattr(ablate, "measure_point", scripted)
    ablate.main(["overlap", "--dry-run", "--modes", "corun", "--values", "False",
                 "--repeats", "3", "--name", "ablate-repeats"])
    head, record = json.loads((tmp_path / "ablate-repeats.json").read_text())
    assert head["repeats"] == 3 and "median of 3" in head["timing"]
    assert timed == [f"corun@False run {i}" for i in (1, 2, 3)]
    assert record["output_tok_s"] == 20.0 and record["output_tok_s_runs"] == [30.0, 10.0, 20.0]
    assert record["output_tok_s_spread"] == 2.0 and record["mismatches"] == 0
    with pytest.raises(SystemExit):
        ablate.parse_args(["overlap", "--dry-run", "--repeats", "0"])


def test_merge_keeps_the_earlier_points_not_rerun(tmp_path, monkeypatch):
    """--modes without corun runs only the peers' own-schedule points of kernel-policy, and
    --merge keeps an earlier file's other points (a re-run point replaces its earlier record)."""
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps([
        {"header": True, "date": "2026-12-01", "command": "ablate kernel-policy"},
        {"series": "corun schedule", "value": "corun", "output_tok_s": 1.0},
        {"series": "own dynamic schedule", "value": "default", "output_tok_s": 2.0}]))
    ablate.main(["kernel-policy", "--dry-run", "--modes", "default", "--values", "default",
                 "--name", "ablate-merged", "--merge", str(earlier)])
    head, *records = json.loads((tmp_path / "ablate-merged.json").read_text())
    assert head["merged"] == {"from": "earlier.json", "date": "2026-12-01",
                              "command": "ablate kernel-policy", "points_kept": 1}
    assert [(r["series"], r["value"]) for r in records] == [
        ("corun schedule", "corun"), ("own dynamic schedule", "default")]
    assert records[0]["output_tok_s"] == 1.0 and records[1]["output_tok_s"] != 2.0
    assert records[1]["engine_mode"] == "default"


def test_serving_load_merge_keeps_the_earlier_modes(tmp_path, monkeypatch):
    """--modes default --merge EARLIER: the earlier file's other modes stay, this run's replace."""
    from experiments import ablate_serving, bench_serving

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))

    def fake_bench(argv):  # bench_serving's file: a header, one record per (mode, rate)
        modes = argv[argv.index("--modes") + 1].split(",")
        name = argv[argv.index("--result-name") + 1]
        (tmp_path / f"{name}.json").write_text(json.dumps(
            [{"header": True}, *({"mode": m, "request_rate": 4.0, "output_throughput": 9.0}
                                 for m in modes)]))

    monkeypatch.setattr(bench_serving, "main", fake_bench)
    monkeypatch.setattr(ablate_serving, "plot", lambda records, path: None)
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps([
        {"header": True, "date": "2026-12-04", "command": "ablate serving-load"},
        {"mode": "corun", "request_rate": 4.0, "output_throughput": 1.0},
        {"mode": "default", "request_rate": 4.0, "output_throughput": 2.0}]))
    ablate.main(["serving-load", "--modes", "default", "--name", "load", "--merge",
                 str(earlier)])
    head, *records = json.loads((tmp_path / "load.json").read_text())
    assert head["merged"]["points_kept"] == 1 and head["merged"]["date"] == "2026-12-04"
    assert [(r["mode"], r["output_throughput"]) for r in records] == [("corun", 1.0),
                                                                     ("default", 9.0)]
    # A run cut short (the device call's time limit) leaves its own records under another name,
    # never a file of the merged name without the earlier modes.
    (tmp_path / "load.json").unlink()

    def cut_bench(argv):
        fake_bench(argv)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_serving, "main", cut_bench)
    with pytest.raises(KeyboardInterrupt):
        ablate.main(["serving-load", "--modes", "default", "--name", "load", "--merge",
                     str(earlier)])
    assert not (tmp_path / "load.json").exists()
    assert (tmp_path / "load-unmerged.json").exists()


def test_serving_load_merge_runs_at_the_earlier_budget_per_mode(tmp_path, monkeypatch):
    """A merged mode sends as many requests a rate as the earlier modes did: its budget is the
    earlier run's per mode, not this run's --time-budget-s."""
    from experiments import ablate_serving, bench_serving

    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    budgets = []

    def fake_bench(argv):
        budgets.append(float(argv[argv.index("--time-budget-s") + 1]))
        name = argv[argv.index("--result-name") + 1]
        (tmp_path / f"{name}.json").write_text(json.dumps([{"header": True}]))

    monkeypatch.setattr(bench_serving, "main", fake_bench)
    monkeypatch.setattr(ablate_serving, "plot", lambda records, path: None)
    earlier = tmp_path / "earlier.json"
    four_modes = "corun,batch_invariant_tuned,batch_invariant,default"
    earlier.write_text(json.dumps([{"header": True, "args": {
        "modes": four_modes, "time_budget_s": "190.0",
        "request_rate": "[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, inf]"}}]))
    ablate.main(["serving-load", "--modes", "default", "--name", "load", "--merge", str(earlier),
                 "--time-budget-s", "200"])
    assert budgets == [pytest.approx(47.5)]
    # one mode at one rate: the earlier budget of one point
    ablate.main(["serving-load", "--modes", "default", "--rates", "inf", "--name", "load",
                 "--merge", str(earlier), "--time-budget-s", "200"])
    assert budgets[-1] == pytest.approx(190 / 28)
    budgets.pop()
    # The output file is written after every rate: merging from it would lose it to a cut run.
    with pytest.raises(ValueError, match="writes its merged file there"):
        ablate.main(["serving-load", "--modes", "default", "--name", "earlier", "--merge",
                     str(earlier)])
    assert budgets == [pytest.approx(47.5)]  # refused before any work
    assert ablate_serving.merged_budget_s(
        {"args": {"time_budget_s": "None", "modes": "a", "request_rate": "[1.0]"}}, 1, 1) is None


def test_serving_load_merge_keeps_the_points_this_run_did_not_measure():
    """A run of one mode at one rate replaces that point alone: the mode's other rates and
    every other mode stay (an earlier merge keyed on the mode dropped default's six rates)."""
    from experiments.ablate_serving import merged_records

    def point(mode, rate, value):
        return {"mode": mode, "request_rate": rate, "max_concurrency": None, "v": value}

    earlier = [{"header": True}, point("corun", "inf", 1), point("default", 1.0, 2),
               point("default", "inf", 3), {"mode": "default", "error": "did not start"},
               {"mode": "batch_invariant", "error": "did not start"}]
    records, kept = merged_records(earlier, [point("default", "inf", 4)])
    assert kept == 3  # default's failed start goes (default ran now), the other mode's stays
    assert [(r["mode"], r.get("request_rate"), r.get("v")) for r in records] == [
        ("corun", "inf", 1), ("default", 1.0, 2), ("batch_invariant", None, None),
        ("default", "inf", 4)]


def test_a_merged_file_tells_later_merges_the_budget_its_points_ran_at():
    """A merged file's own run may have measured one point at another budget: its header's
    budget_per_point_s, not its run's arguments, sets a later merge's budget."""
    from experiments.ablate_serving import merged_budget_s

    merged = {"budget_per_point_s": 240 / 28, "args": {
        "time_budget_s": "60.0", "modes": "default", "request_rate": "[inf]"}}
    assert merged_budget_s(merged, 1, 7) == pytest.approx(60.0)  # not 420


def test_count_jit_compiles_chains_and_restores_the_hook():
    """Triton's post-compile hook is counted inside the block, the earlier hook still called,
    and put back after (the offline records' jit_compiles_timed)."""
    import triton

    from experiments.harness import count_jit_compiles

    runtime = triton.knobs.runtime
    seen = []
    runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["repr"])
    try:
        with count_jit_compiles() as compiled:
            runtime.jit_post_compile_hook(repr="_gemm_kernel[num_warps=4](a: *bf16)")
        assert compiled == ["_gemm_kernel"] and len(seen) == 1
        runtime.jit_post_compile_hook(repr="after")
        assert compiled == ["_gemm_kernel"] and seen[-1] == "after"
    finally:
        runtime.jit_post_compile_hook = None


def test_serving_load_plot_skips_a_server_that_did_not_start(tmp_path):
    from experiments import ablate_serving

    served = {"mode": "corun", "request_rate": 1.0, "max_concurrency": None,
              "output_throughput": 10.0, "median_ttft_ms": 5.0, "median_tpot_ms": 2.0}
    failed = {"label": "default", "mode": "default", "error": "RuntimeError('exited')"}
    ablate_serving.plot([served, failed], tmp_path / "load.png")
    assert (tmp_path / "load.png").exists()
