"""The serving benchmark's bookkeeping: request generation, arrivals, vLLM-style metrics."""

from __future__ import annotations

import json
import math

import pytest

from experiments.serving_client import RequestResult, arrival_gaps, make_requests, summarize


def test_requests_are_reproducible_and_within_the_length_ranges():
    a = make_requests(20, input_len=10, output_len=4, range_ratio=0.5, vocab_range=256, seed=3)
    assert a == make_requests(20, 10, 4, 0.5, 256, seed=3)
    assert a != make_requests(20, 10, 4, 0.5, 256, seed=4)
    for prompt, out_len, seed in a:
        assert 5 <= len(prompt) <= 15 and 2 <= out_len <= 6
        assert all(0 <= t < 256 for t in prompt) and 0 <= seed < 2**63


def test_poisson_gaps_have_the_requested_rate():
    gaps = arrival_gaps(4000, rate=8.0, burstiness=1.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5


def test_summarize_uses_vllm_definitions():
    ok = RequestResult(
        prompt_len=10,
        success=True,
        output_tokens=5,
        ttft=0.1,
        itl=[0.02, 0.02, 0.03, 0.03],
        latency=0.2,
        start_time=0.0,
    )
    failed = RequestResult(prompt_len=7, error="HTTP 503")
    record = summarize([ok, failed], duration=2.0)
    assert (record["completed"], record["failed"]) == (1, 1)
    assert record["total_input_tokens"] == 10 and record["total_output_tokens"] == 5
    assert record["request_throughput"] == pytest.approx(0.5)
    assert record["total_token_throughput"] == pytest.approx(7.5)
    # TPOT = (E2EL - TTFT) / (output_len - 1)
    assert record["mean_tpot_ms"] == pytest.approx(25.0)
    assert record["median_itl_ms"] == pytest.approx(25.0)
    assert record["p99_e2el_ms"] == pytest.approx(200.0)
    assert record["errors"] == ["HTTP 503"]


def test_variant_adds_a_labelled_server_with_its_flags():
    from experiments.bench_serving import ServerSpec, build_parser, server_specs

    args = build_parser().parse_args([
        "--launch", "--modes", "corun,default",
        "--variant", "corun-t2048=corun --prefill-step-tokens 2048 --prefill-token-budget 2048"])
    assert server_specs(args) == [
        ServerSpec("corun", "corun"), ServerSpec("default", "default"),
        ServerSpec("corun-t2048", "corun",
                   "--prefill-step-tokens 2048 --prefill-token-budget 2048")]


@pytest.mark.parametrize("text", ["corun", "=corun --x 1", "label="])
def test_variant_without_label_or_mode_is_refused(text):
    from experiments.bench_serving import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--variant", text])


def test_variant_labels_must_be_unique():
    from experiments.bench_serving import build_parser, server_specs

    args = build_parser().parse_args(["--modes", "corun", "--variant", "corun=corun --seed 1"])
    with pytest.raises(SystemExit, match="unique"):
        server_specs(args)


def test_a_launch_run_cut_during_a_rate_keeps_the_rates_before_it(tmp_path, monkeypatch):
    """The results file is written after every rate: a device call's time limit that stops the
    run (KeyboardInterrupt from `timeout --signal=INT`) leaves the rates already measured."""
    from experiments import bench_serving

    calls = []

    async def fake_benchmark(base_url, model, requests, rate, *rest, **kwargs):
        calls.append(rate)
        if len(calls) == 2:
            raise KeyboardInterrupt
        done = RequestResult(prompt_len=4, success=True, output_tokens=2, ttft=0.1,
                             itl=[0.01], latency=0.11)
        return [done], 1.0

    stopped = []
    monkeypatch.setattr(bench_serving, "launch_server", lambda spec, port, args: "proc")
    monkeypatch.setattr(bench_serving, "stop_server", stopped.append)
    monkeypatch.setattr(bench_serving, "served_model", lambda url: "tiny")
    monkeypatch.setattr(bench_serving, "run_benchmark", fake_benchmark)
    argv = ["--launch", "--modes", "default", "--request-rate", "1,2,4", "--warmup-requests", "0",
            "--num-prompts", "2", "--result-name", "cut", "--result-dir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        bench_serving.main(argv)
    assert stopped == ["proc"]  # the server is shut down on the way out
    head, *records = json.loads((tmp_path / "cut.json").read_text())
    assert head["header"] and [r["request_rate"] for r in records] == [1.0]
    assert records[0]["mode"] == records[0]["label"] == "default"


def test_launch_records_carry_each_servers_start_up_seconds(tmp_path, monkeypatch):
    """A launched server's seconds from start to healthy (its graph captures included) go into
    every record of that server, so a peer's extra graphs show their start-up cost."""
    from experiments import bench_serving

    async def fake_benchmark(*args, **kwargs):
        return [RequestResult(prompt_len=4, success=True, output_tokens=2, ttft=0.1,
                              itl=[0.01], latency=0.11)], 1.0

    clock = iter([10.0, 12.5, 20.0, 27.0])
    monkeypatch.setattr(bench_serving, "_clock", lambda: next(clock))
    monkeypatch.setattr(bench_serving, "launch_server", lambda spec, port, args: spec.label)
    monkeypatch.setattr(bench_serving, "stop_server", lambda proc: None)
    monkeypatch.setattr(bench_serving, "served_model", lambda url: "tiny")
    monkeypatch.setattr(bench_serving, "run_benchmark", fake_benchmark)
    monkeypatch.setattr(bench_serving, "plot", lambda *args: None)
    argv = ["--launch", "--modes", "default", "--variant", "eager=default --dynamic-graph-tokens "
            "none", "--request-rate", "1", "--warmup-requests", "0", "--num-prompts", "2",
            "--result-name", "start", "--result-dir", str(tmp_path)]
    bench_serving.main(argv)
    _, *records = json.loads((tmp_path / "start.json").read_text())
    assert {r["label"]: r["server_start_s"] for r in records} == {"default": 2.5, "eager": 7.0}


def test_a_server_that_does_not_start_is_recorded_and_the_next_ones_run(tmp_path, monkeypatch):
    """A launched server whose start-up fails (it exits, or never answers /health) leaves an
    error record, and the servers after it are still measured."""
    from experiments import bench_serving

    async def fake_benchmark(*args, **kwargs):
        return [RequestResult(prompt_len=4, success=True, output_tokens=2, ttft=0.1,
                              itl=[0.01], latency=0.11)], 1.0

    def launch(spec, port, args):
        if spec.label == "default":
            raise RuntimeError("server default exited with 1")
        return spec.label

    monkeypatch.setattr(bench_serving, "launch_server", launch)
    monkeypatch.setattr(bench_serving, "stop_server", lambda proc: None)
    monkeypatch.setattr(bench_serving, "served_model", lambda url: "tiny")
    monkeypatch.setattr(bench_serving, "run_benchmark", fake_benchmark)
    argv = ["--launch", "--modes", "default,corun", "--request-rate", "1", "--warmup-requests",
            "0", "--num-prompts", "2", "--result-name", "failed", "--result-dir", str(tmp_path)]
    bench_serving.main(argv)
    _, failed, served = json.loads((tmp_path / "failed.json").read_text())
    assert failed["label"] == "default" and "exited with 1" in failed["error"]
    assert served["label"] == "corun" and served["completed"] == 1
    assert (tmp_path / "failed-corun.png").exists()
