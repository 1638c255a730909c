"""bench_align_digest's logits-digest peer is the torch form the kernel replaced: corun's
``LogitsDigest.__call__`` runs ``kernels.logits_digest`` itself on CUDA, so timing (or checking)
the kernel against it compared the kernel with itself (run14 of kernels-h200.json: ratio 1.00)."""

from __future__ import annotations

import pytest

from corun.fingerprint import LogitsDigest
from experiments import bench_align_digest as bench
from kernels.reference import logits_digest_reference


@pytest.fixture
def cpu_bench(monkeypatch):
    """The bench's digest part on the CPU, with ``LogitsDigest.__call__`` standing for its CUDA
    dispatch (it raises: whatever calls it would be timing the kernel) and the kernel itself
    replaced by its reference (not under test here)."""

    def dispatches_to_the_kernel(self, logits):
        raise AssertionError("LogitsDigest.__call__ on CUDA is kernels.logits_digest")

    monkeypatch.setattr(LogitsDigest, "__call__", dispatches_to_the_kernel)
    monkeypatch.setattr(bench, "logits_digest", logits_digest_reference)
    monkeypatch.setattr(bench, "_require_cuda", lambda: None)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "ROUTINGS", ())
    monkeypatch.setattr(bench, "DIGEST_ROWS", (3,))
    monkeypatch.setattr(bench, "VOCAB", 1024)
    timed = []
    monkeypatch.setattr(bench, "bench_us", lambda fn, **_: timed.append(fn()) or 1.0)
    return timed


def test_the_timed_peer_is_the_torch_form(cpu_bench):
    (record,) = bench.collect(quick=True)
    assert record["op"] == "logits_digest" and record["peer"] == bench.PEER_DIGEST_NAME
    ours, peer = cpu_bench
    assert peer.equal(ours)  # the same integers, from the torch ops


def test_the_equality_check_compares_with_the_torch_form(cpu_bench):
    checks = {c["check"]: c for c in bench.check_invariance_gpu()}
    assert checks["equals_torch_digest"]["passed"]
