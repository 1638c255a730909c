"""harness.bench_us: graph replay first; a function a graph cannot capture is timed with do_bench,
and the fallback is said on stderr (its times flush L2 and include the launch)."""

from __future__ import annotations

import torch
import triton.testing

from experiments import harness


def _fake_cuda(monkeypatch, cudagraph):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(harness, "_warm_up", lambda fn, warmup_ms: None)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", cudagraph)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 0.5)


def test_graph_replay_is_timed_and_nothing_is_said(monkeypatch, capsys):
    _fake_cuda(monkeypatch, lambda fn, **kw: 0.25)
    assert harness.bench_us(lambda: None) == 250.0
    assert "do_bench" not in capsys.readouterr().err


def test_a_function_no_graph_captures_falls_back_aloud(monkeypatch, capsys):
    def cannot_capture(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    _fake_cuda(monkeypatch, cannot_capture)
    assert harness.bench_us(lambda: None) == 500.0
    err = capsys.readouterr().err
    assert "no CUDA graph (RuntimeError: operation not permitted" in err
    assert "timed with do_bench" in err
