"""README views of the engine-level results: the offline headline, serving runs, the offline
sweeps and prefix caching (``experiments/report.py`` renders them; each figure is read from its
results file)."""

from __future__ import annotations

from collections.abc import Callable

from experiments.report import _fmt, _source, _span, columns_block


def offline_summary_block(head: dict, records: list[dict]) -> str:
    """The offline headline as sentences, every figure read from the file."""
    by = {r["mode"]: r for r in records}
    lines = [_source(head, "offline-h200"), ""]
    corun = by.get("corun")
    if corun:
        peers = [f"{_fmt(corun[f'throughput_vs_{p}'])}x `{p}`" for p in
                 ("default", "batch_invariant_tuned", "batch_invariant")
                 if f"throughput_vs_{p}" in corun]
        lines.append(f"- **Throughput.** `corun` {_fmt(corun['output_tok_s'])} output tok/s on "
                     f"{corun['requests']} requests: {', '.join(peers)}.")
    audited = [r for r in records if "mismatches" in r]
    if audited:
        parts = [f"`{r['mode']}` {r['mismatches']} ({r['mismatches_reschedule']} of "
                 f"{r['audit_requests']} rescheduled, {r['mismatches_alone']} of "
                 f"{r['alone_sample']} alone)" for r in audited]
        lines.append("- **Determinism.** Fingerprint mismatches against the main run: "
                     + "; ".join(parts) + ".")
    graphs = [r for r in records if "graph_vs_eager_mismatches" in r]
    if graphs:
        lines.append("- **Graph replay vs eager** (short requests replayed from the graphs and "
                     "run eagerly): " + "; ".join(
                         f"`{r['mode']}` {r['graph_vs_eager_mismatches']} of "
                         f"{r['graph_vs_eager_requests']} differ" for r in graphs) + ".")
    if corun and "decode_steps" in corun:
        peer = by.get("default", {})
        lines.append(
            f"- **Where corun's time goes.** {corun['prefill_steps']} packed prefill steps "
            f"({_fmt(corun['prefill_seconds'])} s, {_fmt(corun['prefill_real_token_fraction'])} "
            f"of their rows real) and {corun['decode_steps']} decode steps "
            f"({_fmt(corun['decode_seconds'])} s, {_fmt(corun['decode_live_mean'])} live of "
            f"{corun['config']['decode_batch_size']} on average; p50 "
            f"{_fmt(corun['decode_step_ms_p50'])} ms, "
            f"{_fmt(corun['decode_step_over_own_bound_p50'])}x the step's own memory bound)"
            + (f"; `default` ran {peer['prefill_steps']} mixed steps "
               f"({_fmt(peer['prefill_seconds'])} s) and {peer['decode_steps']} decode steps "
               f"({_fmt(peer['decode_seconds'])} s)" if "decode_steps" in peer else "")
            + f". TPOT p50 is {_fmt(corun.get('tpot_p50_over_bound'))}x the decode bound at the "
            f"mean live count.")
    return "\n".join(lines)


def _load_name(record: dict) -> str:
    """A serving record's load: "4 req/s", or "concurrency 64" for the all-at-once run."""
    if record["request_rate"] == "inf":
        return f"concurrency {record['max_concurrency']}"
    return f"{_fmt(record['request_rate'], 0)} req/s"


def _by_load(records: list[dict]) -> dict[str, dict[str, dict]]:
    """Serving records by load, then by server label; servers that served nothing at a load
    (every request failed) and servers that did not start are left out (``_failures`` says
    which)."""
    loads: dict[str, dict[str, dict]] = {}
    for r in records:
        if "error" not in r and r.get("completed"):
            loads.setdefault(_load_name(r), {})[r.get("label", r["mode"])] = r
    return loads


def _failures(records: list[dict]) -> str:
    """A sentence naming the servers that did not start, the loads a server served nothing at,
    and the requests that failed where others were served."""
    failed = []
    for r in records:
        label = r.get("label", r["mode"])
        if "error" in r:
            failed.append(f"`{label}` did not start ({r['error'][:80]})")
        elif not r.get("completed"):
            failed.append(f"`{label}` served nothing at {_load_name(r)}")
        elif r.get("failed"):
            failed.append(f"`{label}` lost {r['failed']} of {r['completed'] + r['failed']} "
                          f"requests at {_load_name(r)}")
    return f"Failed: {'; '.join(failed)}." if failed else ""


def serving_summary_block(head: dict, records: list[dict]) -> str:
    """corun against the other servers at each load, as sentences, every figure read from the
    file (and the packed prefill step's time from the offline headline's)."""
    lines = [_source(head, "serving-h200"), ""]
    for rate, by in _by_load(records).items():
        corun = by.get("corun")
        peers = {m: r for m, r in by.items() if m != "corun"}
        if corun is None or not peers:
            continue
        tput = ", ".join(f"`{m}` {_fmt(r['output_throughput'], 0)}" for m, r in by.items())
        tpot = [corun[f"{q}_tpot_ms"] / r[f"{q}_tpot_ms"] for r in peers.values()
                for q in ("median", "p99")]
        peer_itl = [r["p99_itl_ms"] for r in peers.values()]
        itl = [corun["p99_itl_ms"] / value for value in peer_itl]
        lines.append(
            f"- **{rate}.** Output tok/s: {tput}. corun's TPOT p50 and p99 are "
            f"{_span(tpot, unit='x')} the other modes', its ITL p99 "
            f"{_fmt(corun['p99_itl_ms'], 0)} ms against {_span(peer_itl, 0)} ms "
            f"({_span(itl, unit='x')}).")
    if failures := _failures(records):
        lines.append(failures)
    return "\n".join(lines)


def serving_step_summary_block(name: str) -> Callable[[dict, list[dict]], str]:
    """corun's servers (the packed step T and the other settings) under the serving load: each
    one's output tok/s (as a ratio to every peer of the same run: ``default`` and the
    batch-invariant peers), TTFT p50, TPOT p50 and ITL p99, at every load."""
    def figures(r: dict) -> str:
        return (f"TTFT p50 {_fmt(r['median_ttft_ms'], 0)} ms, TPOT p50 "
                f"{_fmt(r['median_tpot_ms'], 1)} ms, ITL p99 {_fmt(r['p99_itl_ms'], 0)} ms")

    def view(head: dict, records: list[dict]) -> str:
        lines = [_source(head, name), ""]
        for load, by in _by_load(records).items():
            peers = [(label, r) for label, r in by.items() if r["mode"] != "corun"]
            servers = [(label, r) for label, r in by.items() if r["mode"] == "corun"]
            if not peers or not servers:
                continue
            said = "; ".join(f"`{label}` {_fmt(r['output_throughput'], 0)} tok/s, {figures(r)}"
                             for label, r in peers)
            parts = []
            for label, r in servers:
                ratios = ", ".join(
                    f"{_fmt(r['output_throughput'] / p['output_throughput'])}x `{peer}`"
                    for peer, p in peers)
                parts.append(f"`{label}` {_fmt(r['output_throughput'], 0)} tok/s ({ratios}), "
                             f"{figures(r)}")
            lines.append(f"- **{load}** ({said}): " + "; ".join(parts) + ".")
        if failures := _failures(records):
            lines.append(failures)
        return "\n".join(lines)
    return view


# The label bench_serving gives a peer's server with --dynamic-graph-tokens none
# (run_h200.sh serving-peer-graphs).
EAGER_MIXED = "-eager-mixed"


def serving_peer_graphs_block(head: dict, records: list[dict]) -> str:
    """Each peer with its small prefill / mixed steps replayed from graphs against the same peer
    with them eager, at every load, and corun beside the peer with graphs: every figure read
    from the one run."""
    lines = [_source(head, "serving-peer-graphs-h200"), ""]
    for load, by in _by_load(records).items():
        parts = []
        for label, graphs in by.items():
            eager = by.get(label + EAGER_MIXED)
            if eager is None:
                continue
            parts.append(
                f"`{label}` {_fmt(graphs['output_throughput'], 0)} tok/s against "
                f"{_fmt(eager['output_throughput'], 0)} eager "
                f"({_fmt(graphs['output_throughput'] / eager['output_throughput'])}x), TTFT p50 "
                f"{_fmt(graphs['median_ttft_ms'], 0)} against {_fmt(eager['median_ttft_ms'], 0)} "
                f"ms, ITL p99 {_fmt(graphs['p99_itl_ms'], 0)} against "
                f"{_fmt(eager['p99_itl_ms'], 0)} ms")
            if graphs.get("server_start_s") and eager.get("server_start_s"):
                parts[-1] += (f", server start {_fmt(graphs['server_start_s'], 0)} against "
                              f"{_fmt(eager['server_start_s'], 0)} s")
            corun = by.get("corun")
            if corun is not None:
                ratio = corun["output_throughput"] / graphs["output_throughput"]
                parts[-1] += (f"; corun {_fmt(ratio)}x its tok/s, TTFT p50 "
                              f"{_fmt(corun['median_ttft_ms'], 0)} ms")
        if parts:
            lines.append(f"- **{load}.** " + "; ".join(parts) + ".")
    if len(lines) == 2:
        lines.append("No peer ran both with and without its mixed-step graphs.")
    if failures := _failures(records):
        lines.append(failures)
    return "\n".join(lines)


SERVING_COLUMNS = [
    ("mode", "mode"), ("request_rate", "rate req/s"), ("max_concurrency", "concurrency"),
    ("completed", "completed"), ("failed", "failed"), ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"), ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
    ("median_e2el_ms", "E2E p50 ms"),
]
# The server's engine steps during each run (bench_serving.step_breakdown, from /metrics).
STEP_COLUMNS = [
    ("engine_steps.prefill", "prefill steps"), ("engine_step_ms_mean.prefill", "prefill step ms"),
    ("engine_steps.decode", "decode steps"), ("engine_step_ms_mean.decode", "decode step ms"),
    ("engine_steps.combined", "overlapped steps"),
    ("engine_step_ms_mean.combined", "overlapped step ms"),
    ("step_tokens_mean", "tokens a step"),
]
VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    "offline-h200-summary": offline_summary_block,
    "offline-h200": columns_block("offline-h200", [
        ("mode", "mode"), ("requests", "requests"), ("output_tok_s", "output tok/s"),
        ("throughput_vs_default", "vs default"),
        ("throughput_vs_batch_invariant_tuned", "vs BI tuned"),
        ("throughput_vs_batch_invariant", "vs BI portable"),
        ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
        ("tpot_ms_p50", "TPOT p50 ms"), ("tpot_ms_p99", "TPOT p99 ms"),
        ("decode_step_ms_p50", "decode step p50 ms"),
        ("decode_step_over_own_bound_p50", "decode step / its bound"),
        ("tpot_p50_over_bound", "TPOT p50 / bound at live mean"),
        ("prefill_real_token_fraction", "prefill rows real"),
        ("mismatches", "mismatches"), ("mismatches_reschedule", "rescheduled"),
        ("audit_requests", "of"), ("mismatches_alone", "alone"), ("alone_sample", "of"),
        ("graph_vs_eager_mismatches", "graph vs eager"),
    ]),
    "serving-h200": columns_block("serving-h200", SERVING_COLUMNS, STEP_COLUMNS),
    **{name: columns_block(name, [("label", "server"), ("extra_server_args", "flags"),
                                  *SERVING_COLUMNS[1:]], STEP_COLUMNS)
       for name in ("serving-step-h200", "serving-step-h200-run2", "serving-corun-sweep-h200")},
    **{f"{name}-summary": serving_step_summary_block(name)
       for name in ("serving-step-h200", "serving-step-h200-run2", "serving-corun-sweep-h200")},
    "serving-h200-summary": serving_summary_block,
    "serving-peer-graphs-h200-summary": serving_peer_graphs_block,
    "serving-peer-graphs-h200": columns_block("serving-peer-graphs-h200", [
        ("label", "server"), ("extra_server_args", "flags"), *SERVING_COLUMNS[1:]], STEP_COLUMNS),
    **{name: columns_block(name, [
        ("point", "point"), ("output_tok_s", "out tok/s"), ("ttft_ms_p50", "TTFT p50 ms"),
        ("tpot_ms_p50", "TPOT p50 ms"), ("prefill_steps", "prefill steps"),
        ("prefill_seconds", "prefill s"), ("decode_steps", "decode steps"),
        ("decode_step_ms_p50", "decode step p50 ms"), ("decode_seconds", "decode s"),
        ("combined_seconds", "overlapped s"), ("decode_live_mean", "live (mean)"),
        ("prefill_real_token_fraction", "prefill rows real"),
    ]) for name in ("sweep-offline-h200", "sweep-offline-h200-run2", "sweep-offline-h200-run3",
                 "sweep-offline-h200-run4")},
    "offline-prefix-h200": columns_block("offline-prefix-h200", [
        ("mode", "mode"), ("prefix_caching", "prefix cache"), ("requests", "sequences"),
        ("output_tok_s", "out tok/s"), ("throughput_vs_nocache", "vs cache off"),
        ("ttft_ms_p50", "TTFT p50 ms"), ("ttft_p50_vs_nocache", "TTFT vs cache off"),
        ("tpot_ms_p50", "TPOT p50 ms"), ("prefix_cache_hit_rate", "hit rate"),
        ("prefill_real_token_fraction", "prefill rows real"), ("mismatches", "mismatches"),
        ("mismatches_vs_nocache", "differ from cache off"),
    ]),
}
ALIASES = {"offline-h200-summary": "offline-h200",
           "serving-h200-summary": "serving-h200",
           "serving-peer-graphs-h200-summary": "serving-peer-graphs-h200",
           "serving-step-h200-summary": "serving-step-h200",
           "serving-step-h200-run2-summary": "serving-step-h200-run2",
           "serving-corun-sweep-h200-summary": "serving-corun-sweep-h200"}
