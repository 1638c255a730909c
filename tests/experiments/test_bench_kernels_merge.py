"""bench_kernels --merge: a run's ops replace the merged file's records of the same ops, every
record names its run, and a run whose records were all replaced leaves the header."""

from __future__ import annotations

import json

import pytest

from experiments import bench_kernels


def _run(date: str, families: str, ops: dict[str, int]) -> list[dict]:
    head = {"header": True, "date": date, "command": f"bench_kernels --families {families}",
            "families": families, "timing": f"timing of {date}", "machine": "NVIDIA H200"}
    return [head, *({"op": op, "policy": "corun", "M": i, "N": 8, "K": 8, "us": float(i + 1),
                     "peer": "cublas", "peer_us": 1.0, "ratio": 1.0}
                    for op, count in ops.items() for i in range(count))]


def test_merge_replaces_ops_and_keeps_each_records_run(tmp_path):
    first = _run("d1", "gemm,mla", {"gemm": 3, "mla_decode": 2})
    merged = bench_kernels.merge_runs(first, _run("d2", "mla", {"mla_decode": 4}))
    head, *records = merged
    assert [r["run"] for r in head["runs"]] == ["run1", "run2"]
    assert head["runs"][1] == {"command": "bench_kernels --families mla", "date": "d2",
                               "families": ["mla"], "run": "run2", "timing": "timing of d2"}
    assert [(r["op"], r["run"]) for r in records] == [("gemm", "run1")] * 3 + [
        ("mla_decode", "run2")] * 4
    assert head["date"] == "d2" and "merged from 2 runs" in head["command"]
    # gemm re-run too: run1 no longer holds any record and leaves the header.
    again = bench_kernels.merge_runs(merged, _run("d3", "gemm", {"gemm": 1}))
    assert [r["run"] for r in again[0]["runs"]] == ["run2", "run3"]
    assert {(r["op"], r["run"]) for r in again[1:]} == {("mla_decode", "run2"), ("gemm", "run3")}


def test_a_runs_note_stays_with_its_run_through_later_merges():
    """A note on a run's header (what was done to its records after it ran) travels into its
    ``runs`` entry, not the merged header, and survives a later run's merge."""
    noted = _run("d2", "attention", {"decode_attention": 1})
    noted[0]["note"] = "relabelled"
    merged = bench_kernels.merge_runs(_run("d1", "gemm", {"gemm": 2}), noted)
    assert "note" not in merged[0] and merged[0]["runs"][1]["note"] == "relabelled"
    again = bench_kernels.merge_runs(merged, _run("d3", "mla", {"mla_decode": 1}))
    assert [r.get("note") for r in again[0]["runs"]] == [None, "relabelled", None]
    # a single-run base keeps its own note as run1's
    first = bench_kernels.merge_runs(noted, _run("d3", "mla", {"mla_decode": 1}))
    assert [r.get("note") for r in first[0]["runs"]] == ["relabelled", None]


def test_merge_from_files_writes_the_merged_file(tmp_path):
    base, new = tmp_path / "kernels-h200.json", tmp_path / "new.json"
    base.write_text(json.dumps(_run("d1", "gemm", {"gemm": 2})))
    new.write_text(json.dumps(_run("d2", "attention", {"decode_attention": 1})))
    out = tmp_path / "out"
    assert bench_kernels.main(["--merge", str(base), "--merge-from", str(new),
                               "--out", str(out)]) == 0
    head, *records = json.loads((out / "kernels-h200.json").read_text())
    assert {r["op"] for r in records} == {"gemm", "decode_attention"}
    assert (out / "kernels-h200.png").exists()  # the merged file keeps the base's name


def test_a_run_on_another_card_is_not_merged_into_a_card_s_file():
    """An H100's timings and bounds never land in the H200's kernels file (each card has its
    own: kernels-h100.json)."""
    h100 = _run("d2", "attention", {"decode_attention": 1})
    h100[0]["machine"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(ValueError, match="each card keeps its own kernels file"):
        bench_kernels.merge_runs(_run("d1", "gemm", {"gemm": 2}), h100)


def test_a_cut_merging_run_leaves_a_whole_merged_file(tmp_path, monkeypatch):
    """The merged file is rewritten after every family: a run its time limit stops in its
    second family leaves the base's records with the first family's, and this run's own
    records under kernels-h200-lastrun.json (never them alone under the committed name)."""
    import torch

    base = tmp_path / "kernels-h200.json"
    base.write_text(json.dumps(_run("d1", "gemm,mla", {"gemm": 2, "mla_decode": 1})))
    record = _run("d2", "attention", {"decode_attention": 1})[1]

    def family(name, quick):
        if name == "mla":
            raise KeyboardInterrupt  # the time limit, during the second family
        return [record], [], []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")  # the header's
    monkeypatch.setattr(bench_kernels, "run_family", family)
    out = tmp_path / "out"
    try:
        bench_kernels.main(["--merge", str(base), "--families", "attention,mla",
                            "--out", str(out)])
    except KeyboardInterrupt:
        pass
    _, *merged = json.loads((out / "kernels-h200.json").read_text())
    assert sorted(r["op"] for r in merged) == ["decode_attention", "gemm", "gemm", "mla_decode"]
    own_head, *own = json.loads((out / "kernels-h200-lastrun.json").read_text())
    assert [r["op"] for r in own] == ["decode_attention"]
    assert own_head["families"] == "attention"  # not the mla it never measured
    # an H100 run does not merge into the H200's file (refused before any work)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit):
        bench_kernels.main(["--merge", str(base), "--families", "attention", "--out", str(out)])
