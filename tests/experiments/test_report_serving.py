"""The serving views render only what a results file holds: the peers' mixed-step graphs are
compared only where the same peer also ran with them eager, in the same run."""

from __future__ import annotations

from tests.experiments.rendering import render_block

HEAD = {"header": True, "machine": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
        "date": "d", "command": "c"}


def _server(label: str, mode: str, tput: float, ttft: float, itl: float, rate=4.0) -> dict:
    return {"label": label, "mode": mode, "request_rate": rate, "max_concurrency": None,
            "completed": 10, "failed": 0, "output_throughput": tput, "median_ttft_ms": ttft,
            "p99_itl_ms": itl, "median_tpot_ms": 8.0, "p99_tpot_ms": 9.0,
            "extra_server_args": ""}


def test_peer_graphs_summary_pairs_each_peer_with_its_eager_twin(tmp_path, monkeypatch):
    records = [_server("corun", "corun", 400.0, 34.0, 33.0),
               {**_server("default", "default", 400.0, 30.0, 35.0), "server_start_s": 41.0},
               {**_server("default-eager-mixed", "default", 380.0, 73.0, 58.0),
                "server_start_s": 30.5},
               _server("batch_invariant_tuned", "batch_invariant_tuned", 390.0, 40.0, 40.0),
               _server("default", "default", 1500.0, 100.0, 60.0, rate="inf")]
    text = render_block(tmp_path, monkeypatch, "serving-peer-graphs-h200", HEAD, records,
                        "serving-peer-graphs-h200-summary")
    assert ("- **4 req/s.** `default` 400 tok/s against 380 eager (1.05x), TTFT p50 30 against "
            "73 ms, ITL p99 35 against 58 ms, server start 41 against 30 s; corun 1.00x its tok/s, "
            "TTFT p50 34 ms.") in text
    assert "batch_invariant_tuned" not in text  # no eager twin in this run
    assert "concurrency" not in text  # no pair at that load
    alone = render_block(tmp_path, monkeypatch, "serving-peer-graphs-h200", HEAD, records[:2],
                         "serving-peer-graphs-h200-summary")
    assert "No peer ran both" in alone


def test_serving_views_name_failed_servers_and_skip_them(tmp_path, monkeypatch):
    """A server that did not start (an error record) or served nothing at a load is left out
    of the comparisons (no division by its zero throughput) and named in a Failed sentence;
    requests lost beside served ones are counted there too."""
    records = [_server("corun", "corun", 400.0, 34.0, 33.0),
               {"label": "default", "mode": "default", "extra_server_args": "",
                "error": "RuntimeError('server default exited with 1')"},
               {**_server("default-eager-mixed", "default", 380.0, 73.0, 58.0),
                "completed": 10, "failed": 2},
               {**_server("batch_invariant_tuned", "batch_invariant_tuned", 0.0, 0.0, 0.0),
                "completed": 0, "failed": 5},
               _server("batch_invariant_tuned-eager-mixed", "batch_invariant_tuned", 350.0,
                       80.0, 60.0)]
    for name in ("serving-peer-graphs-h200", "serving-h200", "serving-step-h200"):
        text = render_block(tmp_path, monkeypatch, name, HEAD, records, f"{name}-summary")
        assert "`default` did not start (RuntimeError('server default exited with 1'))" in text
        assert "`batch_invariant_tuned` served nothing at 4 req/s" in text
        assert "`default-eager-mixed` lost 2 of 12 requests at 4 req/s" in text
    peer = render_block(tmp_path, monkeypatch, "serving-peer-graphs-h200", HEAD, records,
                        "serving-peer-graphs-h200-summary")
    assert "No peer ran both" in peer


def test_step_columns_show_only_where_a_run_recorded_the_server_s_steps(tmp_path, monkeypatch):
    """The engine-step columns (bench_serving.step_breakdown's nested fields) appear once a
    record has them, and read into the nested dicts; earlier files keep their tables."""
    plain = _server("corun", "corun", 400.0, 34.0, 33.0)
    stepped = {**plain, "engine_steps": {"prefill": 3, "decode": 40, "combined": 0},
               "engine_step_ms_mean": {"prefill": 61.5, "decode": 10.25},
               "step_tokens_mean": 57.5}
    old = render_block(tmp_path, monkeypatch, "serving-h200", HEAD, [plain])
    assert "decode steps" not in old
    new = render_block(tmp_path, monkeypatch, "serving-h200", HEAD, [stepped, plain])
    header = next(line for line in new.splitlines() if line.startswith("| mode"))
    # no overlapped step ran, so no record has its mean: that column stays out
    assert header.endswith("| prefill steps | prefill step ms | decode steps | decode step ms | "
                           "overlapped steps | tokens a step |")
    first, second = [line for line in new.splitlines() if line.startswith("| corun")]
    assert first.endswith("| 3 | 61.50 | 40 | 10.25 | 0 | 57.50 |")
    assert second.endswith("| — | — | — | — | — | — |")
