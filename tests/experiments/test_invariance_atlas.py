"""The atlas's dry run: tiny shapes on the CPU (Triton interpreter) give one record per case
with the four counts; a known batch-variant vendor op shows up as such, ours do not."""

from __future__ import annotations

import json

import torch

from experiments import invariance_atlas
from experiments.atlas_cases import Case


def test_dry_run_records_every_check(tmp_path, monkeypatch):
    monkeypatch.setenv("CORUN_RESULTS_DIR", str(tmp_path))
    invariance_atlas.main(["--dry-run", "--ops", "gemm", "moe", "--name", "atlas-test"])
    head, *records = json.loads((tmp_path / "atlas-test.json").read_text())
    assert head["header"] and head["shapes"]["dtype"] == "torch.float32"
    by = {(r["op"], r["impl"], r["policy"]): r for r in records}
    assert len(by) == 10 and not [r for r in records if "error" in r]
    if not torch.cuda.is_available():  # the CPU's vendor ops
        # torch.matmul takes a gemv path at M = 1 here (DESIGN.md): batch-variant, while
        # position-invariant at a fixed M.
        cublas = by[("gemm", "cuBLAS / torch.matmul", "vendor")]
        assert cublas["position_invariant"] and cublas["batch_size"] > 0
        # The per-expert torch loop multiplies each expert's tokens together: another token
        # routed to an expert changes the row.
        assert by[("moe", "torch expert loop (index_add_)", "vendor")]["other_rows"] > 0
    for policy in ("corun", "batch_invariant"):
        for op in ("gemm", "moe"):
            r = by[(op, "triton (ours)", policy)]
            assert r["batch_invariant"] and r["deterministic"], (op, policy)


def test_checks_count_changed_elements():
    # A row that adds the batch's first row: changes with other rows, its index, the batch size.
    def run(ids):
        x = torch.tensor([[float(i), 1.0] for i in ids])
        return list(x + x[:1] * (len(ids) > 1))

    out = invariance_atlas.check_case(Case("toy", "toy", "vendor", "", 3, (1, 2, 3), run))
    assert out["other_rows"] == 0 and out["row_index"] == 1 and out["batch_size"] == 1
    assert out["batch_sizes_changed"] == [2, 3] and out["run_to_run"] == 0
    assert not out["position_invariant"] and out["deterministic"]
    assert invariance_atlas.diff_count(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])) == 1


def test_all_reduce_dry_run_on_gloo_ranks():
    """On 4 gloo CPU ranks the backend's ring all-reduce moves a row's order of addition with
    its index (and the batch size); ours in the batch-invariant and corun policies (all-gather,
    then the sum in rank order) keeps every bit."""
    from experiments import atlas_all_reduce

    records = atlas_all_reduce.all_reduce_records(native=False, tiny=True)
    by = {(r["impl"], r["policy"]): r for r in records}
    assert all(r["op"] == "all_reduce" and r["world_size"] == 4 for r in records)
    vendor = by[("gloo dist.all_reduce", "vendor")]
    assert vendor["row_index"] > 0 and not vendor["position_invariant"]
    assert vendor["deterministic"]
    for policy in ("batch_invariant", "corun"):
        ours = by[("ParallelContext.all_reduce (rank_order)", policy)]
        assert ours["batch_invariant"] and ours["deterministic"], policy
    assert by[("ParallelContext.all_reduce (all_reduce)", "default")]["row_index"] > 0


def test_all_reduce_on_one_gpu_is_a_skipped_record(monkeypatch):
    from experiments import atlas_all_reduce

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (record,) = atlas_all_reduce.all_reduce_records(native=True, tiny=False)
    assert record["op"] == "all_reduce" and "needs at least 2" in record["skipped"]


def test_all_reduce_failure_is_an_error_record(monkeypatch):
    """Ranks that fail (here: cannot start) give an error record; the atlas goes on."""
    from experiments import atlas_all_reduce

    def fail(*args, **kwargs):
        raise atlas_all_reduce.WorkerError("rank 1 exited with code 1")

    monkeypatch.setattr(atlas_all_reduce, "spawn_workers", fail)
    (record,) = atlas_all_reduce.all_reduce_records(native=False, tiny=True)
    assert record["error"] == "rank 1 exited with code 1" and record["world_size"] == 4
