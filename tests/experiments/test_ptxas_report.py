"""The offline sm_90a report compiles real launches without a GPU (a subprocess without the
interpreter, which would hide the JIT functions), and tune_mla's dry run still writes a table the
policy loads, value-split tiles among its candidates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.mla import MLATile, load_mla_tuned

ROOT = Path(__file__).resolve().parents[2]

# Compiles two MLA decode tiles for cuda:90 and assembles them with Triton's bundled ptxas; the
# recorded launch must come back out of the module untouched.
SCRIPT = """
import json, triton
from experiments.ptxas_report import mla_decode_reports
from kernels import mla
from kernels.mla import MLATile
rows = mla_decode_reports([MLATile(64, 32, 8, 2), MLATile(64, 32, 8, 2, dv_parts=2)])
assert isinstance(mla._mla_decode_kernel, triton.runtime.jit.JITFunction)
print(json.dumps(rows))
"""


def _without_interpreter() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_mla_decode_tiles_compile_offline_for_sm90():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=_without_interpreter(), cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    whole, split = json.loads(done.stdout.strip().splitlines()[-1])
    for row in (whole, split):
        assert "error" not in row, row
        assert 0 < row["registers"] <= 255 and row["num_warps"] == 8
        assert row["wgmma"] > 0 and row["cp_async"] > 0  # Hopper MMA, pipelined cache loads
        assert isinstance(row["spill_store_bytes"], int) and row["shared_bytes"] > 0
    # Two value parts: a grid twice as wide over the head blocks, half the accumulator.
    assert split["grid"][0] == 2 * whole["grid"][0]
    assert split["tile"]["dv_parts"] == 2 and "dv_parts" not in whole["tile"]
    assert split["spill_store_bytes"] <= whole["spill_store_bytes"]


@pytest.mark.slow
def test_tune_mla_dry_run_writes_a_loadable_table(tmp_path):
    out = tmp_path / "mla_tuned.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "experiments.tune_mla", "--dry-run", "--out",
                           str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["header"]["complete"] and data["header"]["dry_run"]
    assert any(MLATile(16, 16, num_warps=4, num_stages=2, dv_parts=2).to_dict() == c
               for c in data["header"]["decode_candidates"])
    table = load_mla_tuned(out)
    assert table.decode_fixed and table.decode_default and table.prefill


def test_deferred_wgmma_waits_count_only_waits_that_leave_a_product_in_flight():
    from experiments.ptxas_report import deferred_wgmma_waits

    ptx = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\n"
           "wgmma.commit_group.sync.aligned;\n"
           "wgmma.wait_group.sync.aligned 0;\n"
           "wgmma.wait_group.sync.aligned 1;\n"
           "wgmma.wait_group.sync.aligned  12 ;\n"
           "cp.async.wait_group 2;\n")
    assert deferred_wgmma_waits(ptx) == 2
    assert deferred_wgmma_waits(ptx.replace(" 1;", " 0;")) == 1
