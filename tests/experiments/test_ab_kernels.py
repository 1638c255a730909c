"""experiments/ab_kernels.py on the interpreter: the exported baseline is the revision's file, a
baseline module's kernels stand in for the working tree's only inside the block, and the A/B
tells a bit-identical copy from a changed one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from experiments import ab_kernels
from kernels import mla, mla_kernels
from kernels.mla import MLATile, mla_prefill_attention, mla_prefill_config
from kernels.mode import Mode

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "kernels/mla_kernels.py"


def _export(tmp_path: Path, edit=None, files: tuple[str, ...] = (KERNELS,)) -> Path:
    """A baseline folder holding the working tree's own files (``edit`` applied to
    mla_kernels.py), laid out as ``export_baseline`` lays out a revision's."""
    folder = tmp_path / "baseline"
    folder.mkdir(parents=True)
    for name in files:
        text = (ROOT / name).read_text()
        if edit is not None and name == KERNELS:
            text = edit(text)
        (folder / Path(name).name).write_text(text)
    (folder / ab_kernels.SOURCE_FILE).write_text(
        json.dumps({"rev": "working tree", "files": list(files)}))
    return folder


def _halve_output(source: str) -> str:
    line = "    out = acc / l_i[:, None]\n"
    assert source.count(line) == 1, "the prefill kernel's output line moved: update this test"
    return source.replace(line, "    out = acc / l_i[:, None] * 0.5\n")


def _points() -> list[ab_kernels.Point]:
    torch.manual_seed(0)
    length, heads, qk_dim, v_dim = 40, 2, 24, 16
    q, k = (torch.randn(length, heads, qk_dim) for _ in range(2))
    v = torch.randn(length, heads, v_dim)
    cu = torch.tensor([0, length], dtype=torch.int32)
    cfg = mla_prefill_config(qk_dim, v_dim, torch.float32, Mode.CORUN,
                             tile=MLATile(32, 16, num_warps=4, num_stages=1))

    def ours() -> torch.Tensor:
        return mla_prefill_attention(q, k, v, cu, cu, 0.2, max_q_len=length, config=cfg)
    return [("mla_prefill 40", ours, "self", ours)]


def test_export_writes_the_revision_file_and_its_source(tmp_path):
    folder = ab_kernels.export_baseline("HEAD", [KERNELS], tmp_path / "baseline")
    head = subprocess.run(["git", "show", f"HEAD:{KERNELS}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert (folder / "mla_kernels.py").read_text() == head
    source = json.loads((folder / ab_kernels.SOURCE_FILE).read_text())
    assert source["files"] == [KERNELS] and len(source["rev"]) == 40


def test_export_rejects_a_file_outside_kernels(tmp_path):
    for path in ("corun/engine.py", "kernels/norm.py"):  # norm.py launches its own kernels
        with pytest.raises(ValueError, match="kernels/<op>_kernels.py"):
            ab_kernels.export_baseline("HEAD", [path], tmp_path)


def test_baseline_kernels_stand_in_only_inside_the_block(tmp_path):
    _, modules = ab_kernels.load_baseline(_export(tmp_path))
    before = mla._mla_prefill_kernel
    with ab_kernels.baseline_kernels(modules) as stand_ins:
        assert mla._mla_prefill_kernel.kernel is modules[0]._mla_prefill_kernel
        assert mla._mla_prefill_kernel in stand_ins
        # the working tree's kernel module keeps its own kernels for its own helpers' callers
        assert mla_kernels._mla_prefill_kernel is before
    assert mla._mla_prefill_kernel is before


def test_a_point_counts_the_baselines_launches(tmp_path):
    _, modules = ab_kernels.load_baseline(_export(tmp_path))
    with ab_kernels.baseline_kernels(modules) as stand_ins:
        _points()[0][1]()
    launched = {k.kernel.fn.__name__: k.launches for k in stand_ins if k.launches}
    assert launched == {"_mla_prefill_kernel": 1}


def test_ab_tells_same_bits_from_a_changed_kernel(tmp_path):
    def bench(fn) -> float:
        fn()
        return 1.0

    _, same = ab_kernels.load_baseline(_export(tmp_path / "same"))
    _, halved = ab_kernels.load_baseline(_export(tmp_path / "halved", _halve_output))
    (kept,) = ab_kernels.measure(_points(), same, bench)
    (changed,) = ab_kernels.measure(_points(), halved, bench)
    assert kept["same_bits"] and not changed["same_bits"]
    assert changed["speedup"] == 1.0 and changed["ratio"] == 1.0


def test_measure_refuses_a_baseline_that_launches_nothing(tmp_path):
    """Whether or not another test imported kernels.moe first (its launcher then binds the
    baseline's kernels too), an MLA prefill point launches none of them."""
    import kernels.moe  # noqa: F401

    folder = tmp_path / "baseline"
    ab_kernels.export_baseline("HEAD", ["kernels/moe_kernels.py"], folder)
    _, modules = ab_kernels.load_baseline(folder)
    with pytest.raises(ValueError, match="no kernel of the baseline"):
        ab_kernels.measure(_points(), modules, lambda fn: 1.0)


def test_a_baseline_module_imports_the_other_baselined_modules_helpers(tmp_path):
    """mla_kernels.py imports helpers from attention_kernels.py: with both baselined, the
    baseline's mla module gets the baseline's helpers, whichever order the files were named in,
    and the working tree's modules are back in place after the load."""
    import kernels.attention_kernels as attention_kernels

    folder = _export(tmp_path, files=(KERNELS, "kernels/attention_kernels.py"))
    _, (mla_base, attention_base) = ab_kernels.load_baseline(folder)
    assert mla_base._zero_padding_rows is attention_base._zero_padding_rows
    assert mla_base._zero_padding_rows is not attention_kernels._zero_padding_rows
    assert __import__("sys").modules["kernels.attention_kernels"] is attention_kernels
