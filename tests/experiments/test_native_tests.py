"""experiments/native_tests.py: a native pytest run's JUnit XML as results, and its README block."""

from __future__ import annotations

import json

import pytest

from experiments import native_tests
from tests.experiments.rendering import render_block

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6" time="12.5">
<testcase classname="tests.kernels.test_gemm" name="test_a[bf16]" time="0.1"/>
<testcase classname="tests.kernels.test_gemm" name="test_b" time="0.1">
  <failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="invariance_tests.test_moe_invariance.TestSort" name="test_c" time="0.1">
  <error message="fixture">trace</error></testcase>
<testcase classname="tests.kernels.test_mla" name="test_d" time="0.0">
  <skipped type="pytest.skip" message="interpreter only: checks host tensors">x</skipped></testcase>
<testcase classname="tests.kernels.test_mla" name="test_e" time="0.0">
  <skipped type="pytest.skip" message="interpreter only: checks host tensors">x</skipped></testcase>
<testcase classname="tests.kernels.test_mla" name="test_f" time="0.2"/>
</testsuite></testsuites>
"""


def _write(tmp_path, text: str = JUNIT):
    path = tmp_path / "pytest-tests.xml"
    path.write_text(text)
    return path


def test_summary_counts_every_outcome_and_names_the_failures(tmp_path):
    summary = native_tests.summarize(_write(tmp_path))
    assert (summary["tests"], summary["passed"], summary["failed"], summary["errors"],
            summary["skipped"]) == (6, 2, 1, 1, 2)
    assert summary["failed_ids"] == ["tests/kernels/test_gemm.py::test_b"]
    assert summary["error_ids"] == ["invariance_tests/test_moe_invariance.py::TestSort::test_c"]
    assert summary["skip_reasons"] == {"interpreter only: checks host tensors": 2}
    assert summary["pytest_wall_s"] == 12.5


def test_a_stage_replaces_its_own_record_and_keeps_the_others(tmp_path, monkeypatch):
    # the file is named after the card the tests ran on (here a pretended H200)
    monkeypatch.setattr(native_tests, "card_tag", lambda: "h200")
    xml = _write(tmp_path)
    out = tmp_path / "out"
    for stage in ("tests", "gpuengine"):
        native_tests.main([stage, str(xml), "--pytest-command", f"pytest {stage}",
                           "--out", str(out), "--merge", str(out / "native-tests-h200.json")])
    clean = _write(tmp_path, JUNIT.replace('<failure message="assert 1 == 2">trace</failure>', ""))
    native_tests.main(["tests", str(clean), "--pytest-command", "pytest again", "--out", str(out),
                       "--merge", str(out / "native-tests-h200.json")])
    head, *records = json.loads((out / "native-tests-h200.json").read_text())
    assert head["header"] and [r["stage"] for r in records] == ["gpuengine", "tests"]
    assert records[1]["failed"] == 0 and records[1]["command"] == "pytest again"
    assert records[0]["failed"] == 1


def test_a_missing_xml_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="junit_xml"):
        native_tests.main(["tests", str(tmp_path / "none.xml"), "--pytest-command", "x"])


def test_block_lists_counts_and_failing_tests(tmp_path, monkeypatch):
    record = {"stage": "tests", "date": "2026-12-05T00:00:00+00:00", "command": "pytest k",
              **native_tests.summarize(_write(tmp_path))}
    text = render_block(tmp_path, monkeypatch, "native-tests-h200",
                        {"header": True, "machine": "NVIDIA H200"}, [record])
    assert "| tests | 2026-12-05T00:00:00+00:00 | 6 | 2 | 1 | 1 | 2 |" in text
    assert "`tests/kernels/test_gemm.py::test_b`" in text and "tests: `pytest k`" in text


@pytest.mark.parametrize(("device_name", "tag"), [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
    ("NVIDIA GH200 480GB", "nvidia-gh200-480gb")])
def test_results_are_named_after_the_card(monkeypatch, device_name, tag):
    from experiments import harness

    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness.torch.cuda, "get_device_name", lambda *a: device_name)
    assert harness.card_tag() == tag
