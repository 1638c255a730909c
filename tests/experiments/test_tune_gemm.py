"""tune_gemm's logic on the CPU: the shapes come from the named models (every linear layer and
the LM head, each (N, K) once), the candidate sets carry the split-K variants the mid-M points
need, the portable choice is the pool's geometric-mean winner, and a cut run resumes where it
stopped (the dry run, through the Triton interpreter)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from experiments import gemm_candidates, gemm_shapes, tune_gemm
from kernels.gemm import H200_NUM_SMS, GemmConfig, load_tuned_table
from models.config import NAMED_CONFIGS


def test_shapes_are_every_gemm_of_the_named_models_once():
    shapes = gemm_shapes.gemm_shapes()
    by_label = {label: (n, k) for label, n, k in shapes}
    assert len({(n, k) for _, n, k in shapes}) == len(shapes)
    q8 = NAMED_CONFIGS["qwen3-8b"]
    assert by_label["qwen3-8b.qkv"] == (6144, q8.hidden_size)
    assert by_label["qwen3-8b.lm_head"] == (q8.vocab_size, q8.hidden_size)
    # DeepSeek-V3: MLA projections, the dense MLP of the first layers and the shared expert.
    assert by_label["deepseek-v3.kv_a"] == (576, 7168)
    assert by_label["deepseek-v3.q_b"] == (128 * 192, 1536)
    assert by_label["deepseek-v3.dense_gate_up"] == (2 * 18432, 7168)
    assert by_label["deepseek-v3.shared.down"] == (7168, 2048)
    assert by_label["hy3.shared.gate_up"] == (2 * 1536, 4096)
    assert by_label["qwen3-30b-a3b.router"] == (128, 2048)
    # Every model of the sweep contributes, and the bench's subset is a prefix of it.
    assert {label.rsplit(".", 1)[0].split(".shared")[0] for label in by_label} == set(
        gemm_shapes.TUNED_MODELS)
    bench = gemm_shapes.gemm_shapes(gemm_shapes.BENCH_MODELS)
    assert bench == shapes[: len(bench)]


def test_decode_candidates_include_shallow_k_steps_for_short_k():
    """DeepSeek-V3's kv_b (K = 512) gets tiles of more than two K steps at decode M."""
    for m in (1, 8, 32, 64):
        configs = gemm_candidates.candidates(m, 32768, 512, with_pool=False)
        assert any(-(-512 // c.block_k) >= 8 for c in configs), m
        assert {c.block_m for c in configs} == {16 if m <= 16 else min(64, m)}


def test_mid_m_candidates_split_k_where_k_allows():
    configs = gemm_candidates.candidates(128, 6144, 4096, with_pool=False)
    splits = {c.split_k for c in configs}
    assert {1, 2, 3, 4} <= splits
    for c in configs:  # every split keeps at least two K blocks
        assert -(-4096 // c.block_k) >= 2 * c.split_k
    assert not set(gemm_candidates.BATCH_INVARIANT_POOL) & set(configs)
    pool = set(gemm_candidates.BATCH_INVARIANT_POOL)
    assert pool <= set(gemm_candidates.candidates(128, 6144, 4096))
    # Large M splits only where the tiles leave SMs idle (the N = 576 projection, not 24576).
    narrow = gemm_candidates.candidates(2048, 576, 7168, with_pool=False)
    wide = gemm_candidates.candidates(2048, 24576, 4096, with_pool=False)
    assert any(c.split_k == 2 for c in narrow)
    assert all(c.split_k == 1 for c in wide)


def test_mid_m_candidates_add_the_deep_tma_fed_whole_tiles():
    """M 65..256 also times the deeper pipelines (whole tiles, TMA-fed), and no other M does."""
    deep = GemmConfig(128, 64, 64, num_warps=4, num_stages=7, tma=True)
    for m in (128, 256):
        assert deep in gemm_candidates.candidates(m, 6144, 4096, with_pool=False)
    for m in (64, 512):
        assert deep not in gemm_candidates.candidates(m, 6144, 4096, with_pool=False)


def test_an_entry_is_stale_only_against_its_own_m_ranges_candidate_set(tmp_path):
    """--retune-m redoes an entry of another candidate set than its M range's: the large-M
    splits made M 512-8192 entries of the earlier name stale, and no M <= 256 entry."""
    small, large = gemm_candidates.CANDIDATE_SET, gemm_candidates.LARGE_M_CANDIDATE_SET
    mid = gemm_candidates.MID_M_CANDIDATE_SET
    every_m = set(gemm_shapes.M_VALUES)
    assert not tune_gemm._needs_retune({"m": 64, "candidate_set": small}, every_m)
    assert not tune_gemm._needs_retune({"m": 128, "candidate_set": mid}, every_m)
    assert tune_gemm._needs_retune({"m": 128, "candidate_set": small}, every_m)
    assert tune_gemm._needs_retune({"m": 128, "candidate_set": large}, every_m)
    assert not tune_gemm._needs_retune({"m": 512, "candidate_set": large}, every_m)
    assert tune_gemm._needs_retune({"m": 512, "candidate_set": small}, every_m)
    assert not tune_gemm._needs_retune({"m": 512, "candidate_set": small}, {128})
    # A fresh table re-tuned at its large M has nothing to redo.
    out = tmp_path / "gemm_tuned.json"
    assert tune_gemm.main(["--dry-run", "--out", str(out)]) == 0
    fresh = json.loads(out.read_text())
    assert {e["candidate_set"] for e in fresh["entries"] if e["m"] > 256} == {large}
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--resume", "--retune-m", "512"]) == 0
    again = json.loads(out.read_text())
    assert again["entries"] == fresh["entries"] and again["header"]["complete"] is True


def test_large_m_few_tiles_split_k_up_to_two_programs_an_sm():
    """DeepSeek-V3's kv_a at M 512: each tile with few programs gets split 2, and 4 and 8 where
    the split programs stay within two an SM (with two K blocks a split at least)."""
    m, n, k = 512, 576, 7168
    configs = gemm_candidates.candidates(m, n, k, with_pool=False)
    assert {c.split_k for c in configs} == {1, 2, 4, 8}
    for c in configs:
        tiles = -(-m // c.block_m) * -(-n // c.block_n)
        assert tiles < H200_NUM_SMS or c.split_k == 1
        assert c.split_k <= 2 or tiles * c.split_k <= 2 * H200_NUM_SMS, c
        assert -(-k // c.block_k) >= 2 * c.split_k
    narrow = GemmConfig(64, 256, 64, num_warps=4, num_stages=4)  # 24 tiles: up to 8
    assert {c.split_k for c in configs
            if dataclasses.replace(c, split_k=1) == narrow} == {1, 2, 4, 8}
    # DeepSeek-V3's shared.gate_up at M 512: 64 tiles of 128 x 256 take split 4 (256 programs),
    # not 8 (512).
    wide = GemmConfig(128, 256, 64, num_warps=8, num_stages=3)
    assert {c.split_k for c in gemm_candidates.candidates(512, 4096, 7168, with_pool=False)
            if dataclasses.replace(c, split_k=1) == wide} == {1, 2, 4}


def test_stream_k_candidates_run_one_row_tile_in_the_tma_range():
    """Stream-K candidates at M 64-256 only, each with a row tile covering M (the entry serves
    every M up to its own), at both program counts, pointer- and TMA-fed."""
    for m in (64, 128, 256):
        stream = [c for c in gemm_candidates.candidates(m, 6144, 4096, with_pool=False)
                  if c.stream_k_programs]
        assert stream and all(c.block_m >= m and c.split_k == 1 for c in stream), m
        assert {c.stream_k_programs for c in stream} == set(gemm_candidates.STREAM_K_PROGRAMS)
        assert {c.tma for c in stream} == {False, True}
    for m in (1, 32, 512):
        assert not any(c.stream_k_programs for c in gemm_candidates.candidates(m, 6144, 4096)), m


def test_no_split_pick_never_cuts_k(monkeypatch):
    """batch_invariant_tuned's entry (no_split_config) is never a stream-K config, which cuts
    K where the programs' shares end, even when one is the fastest of all."""
    setup = dataclasses.replace(tune_gemm.dry_run_setup(), max_candidates=None)
    stream = GemmConfig(16, 16, 16, stream_k_programs=3)
    whole = GemmConfig(16, 16, 16)
    monkeypatch.setattr(tune_gemm, "candidates", lambda m, n, k, with_pool=True: [stream, whole])
    times = {stream: 1.0, whole: 2.0}
    monkeypatch.setattr(tune_gemm, "_time_config",
                        lambda setup, x, w, expected, config:
                        times[dataclasses.replace(config, mask_rows=False)])
    w = torch.randn(48, 64)
    entry = tune_gemm._tune_point(setup, "tiny", 1, 48, 64, w)
    assert GemmConfig.from_dict(entry["config"]) == stream
    assert GemmConfig.from_dict(entry["no_split_config"]) == whole
    assert entry["stream_k_us"] == 1.0  # the fastest stream-K time, kept whether it won or not


def test_the_pick_is_the_finalist_fast_every_round_not_one_lucky_timing(monkeypatch):
    """A candidate timed fast once and slow twice more loses to a steady one: the fastest
    FINALISTS of the first pass (and the fastest that keep K whole) are timed FINALIST_REPEATS
    more times and ranked by median; the entry keeps the pick's every timing."""
    setup = dataclasses.replace(tune_gemm.dry_run_setup(), max_candidates=None)
    lucky = GemmConfig(32, 32, 16, split_k=4)
    steady = GemmConfig(32, 16, 16, split_k=2)
    whole = GemmConfig(16, 16, 16)
    slow = [GemmConfig(16, 16, 32, split_k=s, num_stages=st) for s in (2, 4) for st in (2, 3)]
    assert tune_gemm.FINALISTS == 4 and len({lucky, steady, *slow}) == 6
    rounds = {lucky: [1.0, 3.0, 3.2], steady: [1.5, 1.6, 1.4], whole: [5.0, 5.5, 4.5],
              **{c: [2.0 + i / 10, 9.0, 9.0] for i, c in enumerate(slow)}}
    calls: list[GemmConfig] = []

    def time_config(setup, x, w, expected, config):
        calls.append(config)
        return rounds[config][calls.count(config) - 1]

    monkeypatch.setattr(tune_gemm, "candidates",
                        lambda m, n, k, with_pool=True: [lucky, steady, whole, *slow])
    monkeypatch.setattr(tune_gemm, "_time_config", time_config)
    entry = tune_gemm._tune_point(setup, "tiny", 64, 48, 64, torch.randn(48, 64))
    assert GemmConfig.from_dict(entry["config"]) == steady
    assert entry["us"] == 1.5 and entry["us_rounds"] == [1.5, 1.6, 1.4]
    # the finalists: the first pass's four fastest, and `whole` (no split) though 7th
    retimed = {c for c in calls if calls.count(c) == 1 + tune_gemm.FINALIST_REPEATS}
    assert retimed == {lucky, steady, slow[0], slow[1], whole}
    assert GemmConfig.from_dict(entry["no_split_config"]) == whole and entry["no_split_us"] == 5.0
    assert entry["candidates"] == 7


def test_a_finalist_failing_a_round_is_dropped(monkeypatch):
    setup = dataclasses.replace(tune_gemm.dry_run_setup(), max_candidates=None)
    flaky, other = GemmConfig(16, 16, 16), GemmConfig(32, 16, 16)
    rounds = {flaky: [1.0, None, 1.0], other: [2.0, 2.0, 2.0]}
    calls: list[GemmConfig] = []

    def time_config(setup, x, w, expected, config):
        calls.append(config)
        return rounds[config][calls.count(config) - 1]

    monkeypatch.setattr(tune_gemm, "candidates", lambda m, n, k, with_pool=True: [flaky, other])
    monkeypatch.setattr(tune_gemm, "_time_config", time_config)
    entry = tune_gemm._tune_point(setup, "tiny", 64, 48, 64, torch.randn(48, 64))
    assert GemmConfig.from_dict(entry["config"]) == other


def test_repick_retunes_the_points_timed_once_and_resumes(tmp_path):
    """--repick tunes again this run's points not picked over three placements (no us_rounds:
    picked on one timing; or rounds without cublas_us_rounds: re-timed on one placement); a cut
    run leaves the rest with their old entries, and the same command goes on with them."""
    out = tmp_path / "gemm_tuned.json"
    assert tune_gemm.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(tune_gemm.picked_over_placements(e) for e in data["entries"])
    for i, e in enumerate(data["entries"]):
        e.pop("cublas_us_rounds")
        if i % 2:
            e.pop("us_rounds")
        e["us"] = -1.0  # an old entry's mark
    out.write_text(json.dumps(data))
    argv = ["--dry-run", "--out", str(out), "--resume", "--repick", "--m-values", "128,512"]
    assert tune_gemm.main([*argv, "--budget-s", "0"]) == 0
    cut = json.loads(out.read_text())["entries"]
    assert len(cut) == len(data["entries"])
    assert sum(tune_gemm.picked_over_placements(e) for e in cut) == 1
    assert tune_gemm.main(argv) == 0
    done = json.loads(out.read_text())["entries"]
    assert {(e["m"], e["n"]) for e in done if tune_gemm.picked_over_placements(e)} == {
        (m, n) for _, n, _ in tune_gemm.dry_run_setup().shapes for m in (128, 512)}
    assert all(e["us"] == -1.0 for e in done if e["m"] == 1)  # outside --m-values: kept
    with pytest.raises(SystemExit):
        tune_gemm.main(["--dry-run", "--out", str(out), "--repick"])


@pytest.mark.parametrize("m", [1, 512])
def test_candidates_are_timed_as_each_policy_runs_them(m, monkeypatch):
    """The table's picks serve the M-dependent policies, which mask the rows of a part-empty
    row tile: candidates are timed so. batch_invariant runs its pool config unmasked at every M,
    so the pool's times (``pool_us``) are the unmasked ones, timed again where the two differ."""
    setup = dataclasses.replace(tune_gemm.dry_run_setup(), max_candidates=None)
    pool = gemm_candidates.BATCH_INVARIANT_POOL
    other = GemmConfig(16, 16, 16)
    monkeypatch.setattr(tune_gemm, "candidates",
                        lambda m, n, k, with_pool=True: [other, *pool])
    timed = []
    monkeypatch.setattr(tune_gemm, "_time_config",  # masked 1 us, re-read 2 us
                        lambda setup, x, w, expected, config:
                        timed.append(config) or (1.0 if config.mask_rows else 2.0))
    label = f"{gemm_shapes.POOL_MODEL}.tiny_qkv"
    entry = tune_gemm._tune_point(setup, label, m, 48, 64, torch.randn(48, 64))
    masked = {c for c in timed if c.mask_rows}
    assert {dataclasses.replace(c, mask_rows=False) for c in masked} == \
        {c for c in (other, *pool) if m < c.block_m}
    assert set(pool) <= set(timed)  # each pool config unmasked, as batch_invariant runs it
    # then the finalists' rounds: each finalist as the M-dependent policies run it
    first_pass = 1 + len(pool) + len({c for c in pool if m < c.block_m})
    rounds = timed[first_pass:]
    finalists = set(rounds)
    assert len(rounds) == tune_gemm.FINALIST_REPEATS * len(finalists)
    assert finalists == {tune_gemm.with_row_mask(c, m) for c in (other, *pool)
                         if tune_gemm.with_row_mask(c, m) in finalists}
    assert entry["pool_us"] == [2.0] * len(pool)  # batch_invariant's times: never masked
    assert entry["us"] == (1.0 if m < other.block_m else 2.0)
    assert "mask_rows" not in entry["config"]  # the policy adds it; the table keeps the tile


def test_pool_choice_is_the_geometric_mean_winner():
    pool = gemm_candidates.BATCH_INVARIANT_POOL
    entries = [{"pool_us": [10.0, 1.0, 5.0, 5.0]}, {"pool_us": [10.0, 100.0, 5.0, 6.0]},
               {"pool_us": [1.0, 2.0]}]  # a point with part of the pool timed is left out
    assert tune_gemm._pool_choice(entries) == pool[2]
    assert tune_gemm._pool_choice([{"m": 1}]) is None


def test_pool_choice_keeps_the_previous_config_within_the_margin():
    """A re-tune does not flip the portable peer's config on a near tie (timing noise)."""
    pool = gemm_candidates.BATCH_INVARIANT_POOL
    near_tie = [{"pool_us": [10.0, 20.0, 9.95, 20.0]}]  # pool[2] 0.5% faster than pool[0]
    assert tune_gemm._pool_choice(near_tie) == pool[2]
    assert tune_gemm._pool_choice(near_tie, previous=pool[0]) == pool[0]
    clear_win = [{"pool_us": [10.0, 20.0, 9.0, 20.0]}]  # 10% faster: the new winner
    assert tune_gemm._pool_choice(clear_win, previous=pool[0]) == pool[2]
    # A previous config outside the pool (an older pool) is not kept.
    outsider = dataclasses.replace(pool[0], block_k=32)
    assert outsider not in pool
    assert tune_gemm._pool_choice(near_tie, previous=outsider) == pool[2]


def test_dry_run_writes_a_table_the_policy_reads_and_resumes(tmp_path):
    out = tmp_path / "gemm_tuned.json"
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--budget-s", "0"]) == 0
    cut = json.loads(out.read_text())
    assert cut["header"]["complete"] is False and cut["header"]["dry_run"] is True
    assert len(cut["entries"]) == 1  # the budget is checked before each point after the first
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--resume"]) == 0
    data = json.loads(out.read_text())
    setup = tune_gemm.dry_run_setup()
    assert data["header"]["complete"] is True
    assert len(data["header"]["runs"]) == 2
    assert data["entries"][0] == cut["entries"][0]  # kept, not re-tuned
    points = {(e["m"], e["n"], e["k"]) for e in data["entries"]}
    assert points == {(m, n, k) for _, n, k in setup.shapes for m in setup.m_values}
    for e in data["entries"]:
        assert e["ratio_vs_cublas"] > 0 and e["candidates"] >= 1
        assert GemmConfig.from_dict(e["no_split_config"]).split_k == 1
    table = load_tuned_table(out)
    assert table.lookup(100, 48, 64, __import__("torch").bfloat16) == GemmConfig.from_dict(
        next(e["config"] for e in data["entries"] if (e["m"], e["n"]) == (128, 48)))


def test_tma_twins_from_the_serving_batch_on():
    """Every candidate from M 64 on (mid M and prefill M alike) also runs TMA-fed; decode M
    below it does not. Mid M's deep tiles come TMA-fed only, and so do the wave splits of its
    tail twins (test_mid_m_tail_tiles_with_their_wave_splits_where_256_divides_n_too)."""
    deep = {GemmConfig(*tile[:3], num_warps=tile[3], num_stages=tile[4], tma=True)
            for tile in gemm_candidates._MID_DEEP_TILES}
    for m in (64, 128, 256, 512, 8192):
        configs = [c for c in gemm_candidates.candidates(m, 6144, 4096, with_pool=False)
                   if c not in deep and not c.block_n_tail]
        plain = [c for c in configs if not c.tma]
        assert [dataclasses.replace(c, tma=False) for c in configs if c.tma] == plain, m
    for m in (8, 32):
        assert not any(c.tma for c in gemm_candidates.candidates(m, 6144, 4096))


def test_retune_m_replaces_stale_points_and_keeps_a_whole_table(tmp_path):
    """--retune-m tunes the named M again where an entry came from another candidate set; a cut
    run keeps the old entries of the points it has not reached, and --resume finishes."""
    out = tmp_path / "gemm_tuned.json"
    assert tune_gemm.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for e in data["entries"]:
        if e["m"] == 128:
            e["candidate_set"] = "older"
    out.write_text(json.dumps(data))
    before = {(e["m"], e["n"], e["k"]): e for e in data["entries"]}
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--resume", "--retune-m", "128",
                           "--budget-s", "0"]) == 0
    cut = json.loads(out.read_text())
    assert cut["header"]["complete"] is False
    assert {(e["m"], e["n"], e["k"]) for e in cut["entries"]} == set(before)  # nothing lost
    fresh = [e for e in cut["entries"]
             if e["m"] == 128 and e["candidate_set"] == gemm_candidates.MID_M_CANDIDATE_SET]
    assert len(fresh) == 1  # the budget stops the run after its first point
    assert cut["header"]["retune_pending_m"] == [128]
    # A plain --resume finishes what the cut --retune-m run left.
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--resume"]) == 0
    done = json.loads(out.read_text())
    assert done["header"]["complete"] is True and done["header"]["retune_pending_m"] == []
    for e in done["entries"]:
        key = (e["m"], e["n"], e["k"])
        if e["m"] == 128:
            assert e["candidate_set"] == gemm_candidates.MID_M_CANDIDATE_SET
        else:
            assert e == before[key]  # other M untouched


def test_retune_m_without_resume_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        tune_gemm.main(["--dry-run", "--out", str(tmp_path / "t.json"), "--retune-m", "128"])
    assert not (tmp_path / "t.json").exists()


def test_a_tma_entry_reaches_the_policy(tmp_path):
    """A tuned entry whose winner is TMA-fed is what the policy returns for that point."""
    path = tmp_path / "gemm_h200.json"
    winner = GemmConfig(64, 128, 64, num_warps=4, num_stages=4, tma=True)
    path.write_text(json.dumps({"header": {}, "batch_invariant": None, "entries": [
        {"m": 128, "n": 4096, "k": 4096, "config": winner.to_dict(),
         "no_split_config": winner.to_dict()}]}))
    table = load_tuned_table(path)
    assert table.lookup(100, 4096, 4096, __import__("torch").bfloat16) == winner
    assert table.lookup(100, 4096, 4096, __import__("torch").bfloat16, no_split=True).tma


def test_models_and_m_values_narrow_a_run_and_never_claim_the_whole_table(tmp_path):
    """--models / --m-values tune only those points into a file of their own, whose header counts
    the whole table's points (so it is not complete); --resume then fills in the rest, keeping
    them. Narrowing the checked-in table without --resume is refused."""
    out = tmp_path / "narrow.json"
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--models", gemm_shapes.POOL_MODEL,
                           "--m-values", "128"]) == 0
    narrow = json.loads(out.read_text())
    assert [(e["layer"], e["m"]) for e in narrow["entries"]] == [
        (f"{gemm_shapes.POOL_MODEL}.tiny_qkv", 128)]
    assert narrow["header"]["complete"] is False and narrow["header"]["expected_points"] == 6
    assert narrow["header"]["tuned_this_run"] == {"models": [gemm_shapes.POOL_MODEL],
                                                  "m_values": [128]}
    assert tune_gemm.main(["--dry-run", "--out", str(out), "--resume"]) == 0
    whole = json.loads(out.read_text())
    assert whole["header"]["complete"] is True and len(whole["entries"]) == 6
    assert narrow["entries"][0] in whole["entries"]
    for argv in (["--models", "llama"], ["--m-values", "3"], ["--models", "qwen3-8b"]):
        with pytest.raises(SystemExit):
            tune_gemm.main(["--dry-run", *argv])


def test_models_narrow_by_each_models_own_gemms_not_by_label():
    """A shape two models share carries its first model's label; --models still finds it for
    the second (Qwen3-0.6B's GEMMs all carry earlier models' labels or its own)."""
    shapes = tuple(gemm_shapes.gemm_shapes())
    for model in gemm_shapes.TUNED_MODELS:
        own = {(n, k) for _, n, k in gemm_shapes.model_gemm_shapes(model)}
        assert {(n, k) for _, n, k in gemm_shapes.models_shapes(shapes, [model])} == own, model


def test_a_narrowed_run_with_nothing_to_tune_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        tune_gemm.main(["--dry-run", "--out", str(tmp_path / "t.json"), "--models", "hy3"])
    assert not (tmp_path / "t.json").exists()


def _tuned_file(path, machine, points, batch_invariant=None):
    path.write_text(json.dumps({
        "header": {"machine": machine, "torch": "t", "triton": "3.6.0", "cuda": "13.0",
                   "runs": [{"command": f"tune into {path.name}"}]},
        "batch_invariant": batch_invariant,
        "entries": [{"m": m, "n": n, "k": k, "layer": f"q.{n}", "candidates": 3,
                     "config": GemmConfig(bm, 64, 64).to_dict()} for m, n, k, bm in points]}))
    return path


def test_merge_from_folds_one_cards_files_into_its_table_later_files_winning(tmp_path):
    """--merge-from: the union of the files' points, a later file's entry at the same (M, N, K)
    replacing an earlier one; the header keeps the timing machine and every file's runs; a new
    table carries no portable config (the H200's serves), an existing one keeps its own."""
    h100 = "NVIDIA H100 80GB HBM3"
    first = _tuned_file(tmp_path / "a.json", h100, [(128, 96, 80, 16), (256, 96, 80, 32)],
                        batch_invariant=GemmConfig(128, 128, 64).to_dict())
    second = _tuned_file(tmp_path / "b.json", h100, [(256, 96, 80, 64), (512, 32, 48, 128)])
    out = tmp_path / "gemm_h100.json"
    assert tune_gemm.main(["--out", str(out), "--merge-from", str(first), str(second)]) == 0
    table = json.loads(out.read_text())
    assert {(e["m"], e["n"], e["k"]): e["config"]["block_m"] for e in table["entries"]} == {
        (128, 96, 80): 16, (256, 96, 80): 64, (512, 32, 48): 128}
    head = table["header"]
    assert head["machine"] == h100 and head["triton"] == "3.6.0" and head["complete"] is False
    assert [r["command"] for r in head["runs"]] == ["tune into a.json", "tune into b.json"]
    assert head["points"] == 3 and head["expected_points"] == len(gemm_shapes.gemm_shapes()) * 9
    assert table["batch_invariant"] is None
    assert load_tuned_table(out).lookup(200, 96, 80, torch.bfloat16).block_m == 64
    kept = GemmConfig(64, 128, 64, persistent=True).to_dict()
    data = json.loads(out.read_text())
    out.write_text(json.dumps({**data, "batch_invariant": kept}))
    assert tune_gemm.main(["--out", str(out), "--merge-from", str(first)]) == 0
    again = json.loads(out.read_text())
    assert again["batch_invariant"] == kept
    assert again["header"]["runs"] == head["runs"]  # a file merged again adds no run twice
    assert {(e["m"], e["config"]["block_m"]) for e in again["entries"]} == {
        (128, 16), (256, 32), (512, 128)}


def test_merge_from_refuses_files_of_other_machines_and_a_missing_out(tmp_path):
    one = _tuned_file(tmp_path / "a.json", "NVIDIA H100 80GB HBM3", [(128, 96, 80, 16)])
    other = _tuned_file(tmp_path / "b.json", "NVIDIA H200", [(128, 96, 80, 32)])
    out = tmp_path / "gemm_h100.json"
    with pytest.raises(ValueError, match="one machine"):
        tune_gemm.main(["--out", str(out), "--merge-from", str(one), str(other)])
    assert not out.exists()
    with pytest.raises(SystemExit):
        tune_gemm.main(["--merge-from", str(one)])


def test_a_run_off_the_gpu_names_its_out(tmp_path):
    """A table is one card's timings: without a GPU there is no card to name it after."""
    with pytest.raises(SystemExit):
        tune_gemm.main(["--dry-run"])
    assert tune_gemm.main(["--dry-run", "--out", str(tmp_path / "t.json"), "--budget-s", "0"]) == 0


def test_tail_tiles_are_candidates_where_n_is_a_whole_number_of_them_and_not_of_256():
    """DeepSeek-V3's kv_a (N 576 = 3 x 192) gets the 128 + 64 and 64 + 32 twins of its
    candidates of those widths, stream-K aside, and its entries a candidate set of their own
    (so only they went stale); N 6144 and the LM heads' 151936 get none outside mid M."""
    assert gemm_candidates.tail_tiles(576) == ((128, 64), (64, 32))
    assert gemm_candidates.tail_tiles(6144) == gemm_candidates.tail_tiles(151936) == ()
    for m in (m for m in gemm_shapes.M_VALUES if not 64 < m <= 256):
        configs = gemm_candidates.candidates(m, 576, 7168, with_pool=False)
        tails = [c for c in configs if c.block_n_tail]
        assert tails and all(not c.stream_k_programs for c in tails), m
        assert {(c.block_n, c.block_n_tail) for c in tails} <= {(128, 64), (64, 32)}
        assert all(dataclasses.replace(c, block_n_tail=0) in configs for c in tails)
        assert not any(c.block_n_tail for c in gemm_candidates.candidates(m, 6144, 4096))
        assert gemm_candidates.candidate_set(m, 576) == gemm_candidates.candidate_set(m) + "-tail"
        assert gemm_candidates.candidate_set(m, 6144) == gemm_candidates.candidate_set(m)
    # Large M: the 64-row tail tile at 3 stages (two programs an SM), plain and TMA-fed.
    two_an_sm = GemmConfig(64, 128, 64, num_warps=4, num_stages=3, block_n_tail=64)
    for tma in (False, True):
        large_m = gemm_candidates.candidates(8192, 576, 7168)
        assert dataclasses.replace(two_an_sm, tma=tma) in large_m
    assert two_an_sm not in gemm_candidates.candidates(128, 576, 7168)
    every_m = set(gemm_shapes.M_VALUES)
    before = {"m": 8192, "n": 576, "candidate_set": gemm_candidates.LARGE_M_CANDIDATE_SET}
    assert tune_gemm._needs_retune(before, every_m)
    assert not tune_gemm._needs_retune({**before, "n": 6144}, every_m)
    assert not tune_gemm._needs_retune(
        {**before, "candidate_set": gemm_candidates.candidate_set(8192, 576)}, every_m)


def test_mid_m_tail_tiles_with_their_wave_splits_where_256_divides_n_too():
    """At M 65..256 a whole number of 192- or 96-wide tiles takes tail twins even where 256
    divides N (they change how many programs fill the SMs): DeepSeek-V3's q_a (N 1536) gets the
    probe's winners, 128 x (64 + 32) at split 8 (M 128) and 4 (M 256), TMA-fed; every twin fits
    shared memory and a split keeps two K blocks and the programs within two an SM. Those points
    get a candidate set of their own; N without such tiles (4096, 151936) gets no tail."""
    from kernels.gemm import SMEM_BUDGET_BYTES, TARGET_NUM_CTAS
    from kernels.utils import cdiv

    assert gemm_candidates.tail_tiles(1536, 128) == ((128, 64), (64, 32))
    assert gemm_candidates.tail_tiles(1536) == gemm_candidates.tail_tiles(1536, 512) == ()
    assert gemm_candidates.tail_tiles(4096, 128) == gemm_candidates.tail_tiles(151936, 256) == ()
    for m, split in ((128, 8), (256, 4)):
        configs = gemm_candidates.candidates(m, 1536, 7168, with_pool=False)
        winner = GemmConfig(128, 64, 64, split_k=split, num_warps=4, num_stages=4, tma=True,
                            block_n_tail=32)
        assert winner in configs, m
        tails = [c for c in configs if c.block_n_tail]
        assert all(c.smem_bytes(gemm_candidates.DTYPE.itemsize) <= SMEM_BUDGET_BYTES for c in tails)
        assert all(not c.stream_k_programs for c in tails)
        for c in tails:
            if c.split_k > 1:
                assert cdiv(7168, c.block_k) >= 2 * c.split_k, c
        for c in (c for c in tails if c.split_k == 8):
            assert cdiv(m, c.block_m) * cdiv(1536, c.tile_n) * 8 <= TARGET_NUM_CTAS, c
        assert gemm_candidates.candidate_set(m, 1536) == (
            gemm_candidates.candidate_set(m) + gemm_candidates.MID_TAIL_CANDIDATE_SUFFIX)
        assert gemm_candidates.candidate_set(m, 4096) == gemm_candidates.candidate_set(m)
        assert not any(c.block_n_tail for c in gemm_candidates.candidates(m, 4096, 4096))
    assert gemm_candidates.candidate_set(512, 1536) == gemm_candidates.candidate_set(512)
    entry = {"m": 128, "n": 1536, "candidate_set": gemm_candidates.MID_M_CANDIDATE_SET}
    assert tune_gemm._needs_retune(entry, {128})
    assert not tune_gemm._needs_retune({**entry, "n": 4096}, {128})


def test_each_finalists_round_runs_on_fresh_operands_and_cublas_beside_it(monkeypatch):
    """A config's time moves with where its operands lie (probe-capture-spread-h100.json), so
    each later round times the finalists on fresh copies of x and w, and cuBLAS on the same
    copies: the entry's cuBLAS time is the median of the same three placements."""
    setup = dataclasses.replace(tune_gemm.dry_run_setup(), max_candidates=None)
    config = GemmConfig(16, 16, 16)
    monkeypatch.setattr(tune_gemm, "candidates", lambda m, n, k, with_pool=True: [config])
    seen = []

    def time_config(setup, x, w, expected, config):
        seen.append((x.data_ptr(), w.data_ptr(), x.clone(), w.clone()))
        return 1.0 + len(seen)

    cublas = iter([7.0, 5.0, 6.0])

    def bench(self, fn):  # only cuBLAS goes through Setup.bench here
        fn()
        return next(cublas)

    monkeypatch.setattr(tune_gemm, "_time_config", time_config)
    monkeypatch.setattr(tune_gemm.Setup, "bench", bench)
    w = torch.randn(48, 64)
    entry = tune_gemm._tune_point(setup, "tiny", 8, 48, 64, w)
    assert len(seen) == 1 + tune_gemm.FINALIST_REPEATS
    assert len({(x_ptr, w_ptr) for x_ptr, w_ptr, _, _ in seen}) == len(seen)  # three placements
    assert all(torch.equal(x, seen[0][2]) and torch.equal(w_copy, w) for _, _, x, w_copy in seen)
    assert entry["us_rounds"] == [2.0, 3.0, 4.0] and entry["us"] == 3.0
    assert entry["cublas_us_rounds"] == [7.0, 5.0, 6.0] and entry["cublas_us"] == 6.0
    assert entry["ratio_vs_cublas"] == 2.0
