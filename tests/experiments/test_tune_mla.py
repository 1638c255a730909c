"""tune_mla's prefill sweep alone (``--no-decode``): a results file with the pick, every candidate's
times and the peer's, and a refusal to overwrite the checked-in table without ``--out``; and
decode_default's pick, a finalist of least median over its rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.tune_mla import FINALIST_REPEATS, _median_best, _retime_finalists
from kernels.mla import MLATile

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


def _tile(block_n: int) -> MLATile:
    return MLATile(64, block_n, num_warps=4, num_stages=2)


def test_default_pick_is_a_finalist_of_least_median_not_a_lucky_timing():
    lucky, steady, slow, slowest = (_tile(block_n) for block_n in (16, 32, 64, 128))
    later = {lucky: [30.0, 31.0], steady: [20.5, 20.2], slow: [22.0, 22.5]}
    calls = []

    def time_tile(tile):
        calls.append(tile)
        return later[tile][sum(t is tile for t in calls) - 1]

    first_pass = {lucky: 19.0, steady: 20.0, slow: 21.0, slowest: 40.0}
    rounds = _retime_finalists(first_pass, time_tile)
    assert set(rounds) == {lucky, steady, slow}  # the slowest is no finalist, never re-timed
    assert all(len(us) == 1 + FINALIST_REPEATS for us in rounds.values())
    assert calls[:3] == [lucky, steady, slow]  # interleaved: round by round, not tile by tile
    assert _median_best(rounds) is steady


def test_a_finalist_that_fails_a_later_round_is_dropped():
    fails, runs = _tile(16), _tile(32)
    rounds = _retime_finalists({fails: 10.0, runs: 11.0},
                               lambda tile: None if tile is fails else 11.0)
    assert list(rounds) == [runs]


def test_decode_default_entries_keep_their_rounds(tmp_path):
    out = tmp_path / "decode.json"
    done = _tune("--no-prefill", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    entries = [e for e in json.loads(out.read_text())["entries"] if e["kind"] == "decode_default"]
    assert len(entries) == 4  # batches (1, 2) x contexts (40, 64) of the dry run
    for entry in entries:
        assert len(entry["us_rounds"]) == 3
        assert entry["us"] == sorted(entry["us_rounds"])[1]
