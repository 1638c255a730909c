"""tune_mla's prefill sweep alone (``--no-decode``): a results file with the pick, every candidate's
times and the peer's, and a refusal to overwrite the checked-in table without ``--out``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}


def _tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.tune_mla", "--dry-run", *args],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600,
                          check=False)  # fmt: skip


def test_prefill_only_sweep_keeps_every_candidate_and_the_peer(tmp_path):
    out = tmp_path / "prefill.json"
    done = _tune("--no-decode", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    (entry,) = data["entries"]
    assert entry["kind"] == "prefill" and data["header"]["complete"]
    lengths = len(entry["lengths"])
    assert len(entry["sdpa_us"]) == lengths and all(t > 0 for t in entry["sdpa_us"])
    picked = [c for c in entry["candidates"] if c["config"] == entry["config"]]
    assert picked and picked[0]["us"] == entry["us"]
    assert all(len(c["us"]) == lengths for c in entry["candidates"])


def test_no_decode_needs_an_out_other_than_the_table():
    for out in ([], ["--out", "kernels/tuned/mla_h200.json"]):
        done = _tune("--no-decode", *out)
        assert done.returncode == 2 and "--no-decode needs an --out" in done.stderr, out
