"""Render the recorded results (experiments/results/*.json) as the README's tables.

The README shows only figures that a results file holds: this script rewrites the blocks between
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` from the file of that name, so a table
can not drift from its measurement.

    python -m experiments.report            # rewrite README.md, docs/results/*.md and
                                            # experiments/README.md
    python -m experiments.report --check    # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def _load(name: str) -> tuple[dict, list[dict]] | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    records = json.loads(path.read_text())
    if isinstance(records, dict):  # a tuned table's layout: {"header": {...}, "entries": [...]}
        return records.get("header", {}), records.get("entries", [])
    head = next((r for r in records if r.get("header")), {})
    return head, [r for r in records if not r.get("header")]


def _source(head: dict, name: str) -> str:
    commands = head.get("commands")  # a file merged from several runs: one command per part
    said = ("; ".join(f"{part}: `{command}`" for part, command in commands.items())
            if commands else f"`{head.get('command', '?')}`")
    return (
        f"_{head.get('machine', '?')}, torch {head.get('torch', '?')}, triton "
        f"{head.get('triton', '?')}, {head.get('date', '?')}; `experiments/results/{name}.json`, "
        f"{'commands' if commands else 'command'} {said}_"
    )


def _table(header: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _fmt(value: object, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "—" if value is None else str(value)


def _op_label(r: dict) -> str:
    """The op, a variant row's config, and a mark on rows that timed a policy since replaced."""
    variant = f" {r['variant']}" if "variant" in r else ""
    return r["op"] + variant + (" (superseded policy)" if r.get("superseded") else "")


def _point(r: dict) -> str:
    """What tells a row from the others of its op, policy and M, N, K: the layer, model or
    shape it was timed at, the sampling config, a rope tiling, the decode context, the sort's
    BLOCK_M (without it, e.g., decode attention's contexts rendered as identical rows)."""
    parts = [str(r[key]) for key in ("layer", "model", "shape") if r.get(key)]
    if isinstance(r.get("config"), str):
        parts.append(r["config"])
    if r["op"] == "rope_variant" and r.get("config"):
        parts.append(f"tiling {r['config']}")
    if "context" in r:
        parts.append(f"ctx {r['context']}")
    if r["op"].startswith("moe_align") and "block_m" in r:
        parts.append(f"BLOCK_M {r['block_m']}")
    return ", ".join(parts) or "—"


def _peer_label(r: dict) -> str:
    return r["peer"] + (" (invalid)" if r.get("peer_invalid") else "")


def _invalid_peer_note(rows: list[dict]) -> str:
    """Why rows marked ``peer_invalid`` in the file show no ratio: the time named as the peer's
    was not a peer's (each op's reason once)."""
    reasons = {r["op"]: r["peer_invalid"] for r in rows if r.get("peer_invalid")}
    if not reasons:
        return ""
    return "No peer/ours where the peer is marked invalid in the file: " + "; ".join(
        f"{op}: {reason}" for op, reason in reasons.items()) + "."


def kernels_block(head: dict, records: list[dict], name: str = "kernels-h200") -> str:
    timings = [r for r in records if "us" in r and not r.get("error")]
    checks = [r for r in records if "passed" in r]
    errors = [r for r in records if r.get("error")]
    rows = [
        [
            _op_label(r),
            r["policy"],
            _point(r),
            r["M"],
            r["N"],
            r["K"],
            r["dtype"],
            _fmt(r["us"], 1),
            _peer_label(r),
            _fmt(r["peer_us"], 1),
            "—" if r.get("peer_invalid") else _fmt(r.get("ratio")),
            _fmt(r.get("bw_fraction")),
        ]
        for r in timings
    ]
    parts = [
        _source(head, name),
        "",
        _table(
            [
                "op",
                "policy",
                "point",
                "M",
                "N",
                "K",
                "dtype",
                "us",
                "peer",
                "peer us",
                "peer/ours",
                "of bw bound",
            ],
            rows,
        ),
    ]
    if invalid := _invalid_peer_note(timings):
        parts += ["", invalid]
    if checks:
        counted = _counted_checks(checks)
        passed = sum(1 for c in counted if c["passed"])
        parts += [
            "",
            f"Invariance checks at real shapes on the GPU: {passed} of {len(counted)} as expected."
            + _uncounted_note(checks),
            "",
            _table(
                ["op", "check", "mode", "shape", "result", "detail"],
                [
                    [
                        c["op"],
                        c["check"],
                        c["mode"],
                        c.get("shape"),
                        _check_result(c),
                        c.get("detail", ""),
                    ]
                    for c in checks
                ],
            ),
        ]
    if errors:
        parts += [
            "",
            "Families that failed to run: "
            + ", ".join(
                f"{e.get('family')} ({e.get('stage')}: {e.get('error', '')[:80]})" for e in errors
            ),
        ]
    return "\n".join(parts)


def generic_block(name: str) -> Callable[[dict, list[dict]], str]:
    """A table of every scalar field of the records, for result files without a custom view."""

    def render(head: dict, records: list[dict]) -> str:
        keys: list[str] = []
        for r in records:
            for k, v in r.items():
                if k not in keys and not isinstance(v, (list, dict)):
                    keys.append(k)
        rows = [[_fmt(r.get(k)) for k in keys] for r in records]
        return _source(head, name) + "\n\n" + _table(keys, rows)

    return render


def _counted_checks(checks: list[dict]) -> list[dict]:
    """The checks a pass count covers: not those of a superseded policy or check (re-run pending),
    nor findings recorded either way (``informative``)."""
    return [c for c in checks if not c.get("superseded") and not c.get("informative")]


def _uncounted_note(checks: list[dict]) -> str:
    superseded = sum(1 for c in checks if c.get("superseded"))
    informative = sum(1 for c in checks if c.get("informative") and not c.get("superseded"))
    parts = ([f"{superseded} of a superseded policy or check"] if superseded else []) + (
        [f"{informative} recorded as findings"] if informative else [])
    return f" Not counted: {' and '.join(parts)} (each says why)." if parts else ""


def _check_result(c: dict) -> str:
    if c.get("superseded"):
        return "superseded: " + c["superseded"]
    if c.get("informative"):
        return ("finding (bits changed)" if c["passed"] else "finding (bits kept)") + ": " + c[
            "informative"]
    return "pass" if c["passed"] else "FAIL"


def _median(values: list[float]) -> float | None:
    """The median (of an even count, the mean of the middle two: ``statistics.median``, as the
    targets table in report_kernels takes it), or None when there is no value."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _peers(rows: list[dict]) -> str:
    """The peer of a group of rows; where the rows were timed against different peers (each
    row's peer is the fastest of several, or its own config), each one with its row count."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[_peer_label(r)] = counts.get(_peer_label(r), 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{peer} ({n})" for peer, n in sorted(counts.items(), key=lambda c: -c[1]))


def kernels_summary_block(head: dict, records: list[dict], name: str = "kernels-h200") -> str:
    """Per (op, policy): shape count, ratio vs the peer (min / median / max) and the fraction of
    the memory-bandwidth bound (median / max). The full table is in experiments/README.md."""
    timings = [r for r in records if "us" in r and not r.get("error")
               and (r.get("ratio") or r.get("peer_invalid"))]
    superseded = [r for r in timings if r.get("superseded")]
    timings = [r for r in timings if not r.get("superseded")]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in timings:
        # Diagnostic rows (target False: e.g. flat top-p rows, the whole-row fallback) apart.
        op = r["op"] + (" (diagnostic)" if r.get("target") is False else "")
        groups.setdefault((op, r["policy"]), []).append(r)
    rows = []
    for (op, policy), rs in groups.items():
        ratios = [r["ratio"] for r in rs if not r.get("peer_invalid")]
        bw = [r.get("bw_fraction") for r in rs if r.get("bw_fraction") is not None]
        rows.append([op, policy, len(rs), _peers(rs), _fmt(min(ratios) if ratios else None),
                     _fmt(_median(ratios)), _fmt(max(ratios) if ratios else None),
                     _bound_fraction(_median(bw)), _bound_fraction(max(bw) if bw else None)])
    checks = [r for r in records if "passed" in r]
    counted = _counted_checks(checks)
    passed = sum(1 for c in counted if c["passed"])
    runs = head.get("runs") or [{"families": head.get("families", "all"),
                                 "timing": head.get("timing", "")}]
    def families(run: dict) -> str:
        names = run["families"]
        return ", ".join(names) if isinstance(names, list) else str(names)

    def when(run: dict) -> str:  # which run of the merged file, and its date
        said = [str(run[key])[:10] for key in ("run", "date") if run.get(key)]
        return f" ({', '.join(said)})" if said else ""

    methods = "; ".join(f"{families(r)}{when(r)}: {r['timing']}" for r in runs)
    left_out = sorted({r["op"] for r in superseded})
    note = ([f"Left out: {len(superseded)} rows of {', '.join(left_out)} that timed a policy since "
             "replaced (marked `superseded` in the file, with the config each ran).", ""]
            if superseded else [])
    return "\n".join([
        _source(head, name), "",
        f"The runs the rows come from (each op from its latest run), with their timing: "
        f"{methods}.", "", *note,
        _table(["op", "policy", "shapes", "peer", "peer/ours min", "median", "max",
                "of bw bound (median)", "(max)"], rows), "",
        *([invalid, ""] if (invalid := _invalid_peer_note(timings)) else []),
        l2_note(_bound_card(head)) + _beyond_l2_note(timings, _bound_card(head)), "",
        f"GPU invariance checks at real shapes: {passed} of {len(counted)} as expected"
        + (" (the failing ones are listed in `experiments/README.md`)." if passed < len(counted)
           else ".") + _uncounted_note(checks),
    ])


# The bound is HBM traffic at the card's measured copy rate (the file's header says which); a
# graph replayed back to back keeps operands that fit the 50 MB L2 resident, so small
# elementwise shapes can run above it.
L2_BYTES = 50e6


def _bound_card(head: dict) -> str:
    """The card whose measured copy rate a kernels file's bounds assume (its header's
    ``copy_bandwidth_card``, the H200 where none was measured), else the H200 (the files
    written before headers said it were all the H200's)."""
    return (head.get("copy_bandwidth_card") or "h200").split()[0]


def l2_note(card: str) -> str:
    from experiments.harness import COPY_BANDWIDTH_BYTES_PER_S

    return ("A bound fraction marked * is above 1. In the graph-replayed families, operands that "
            "fit the 50 MB L2 stay resident between replays, so the HBM bound "
            f"({COPY_BANDWIDTH_BYTES_PER_S[card] / 1e12:.1f} TB/s copy rate) does not bind there.")


def moved_bytes(r: dict, bandwidth: float | None = None) -> float | None:
    """The bytes a kernel row's bound counts (its bound time at the bound's copy rate, the
    H200's unless given)."""
    from experiments.harness import H200_BANDWIDTH_BYTES_PER_S

    rate = bandwidth or H200_BANDWIDTH_BYTES_PER_S
    return r["bound_us"] * 1e-6 * rate if r.get("bound_us") else None


def _beyond_l2_note(rows: list[dict], card: str) -> str:
    """The rows above their bound that move more than twice the L2 (so their operands cannot sit
    in it): for them the explanation is the bound's rate, a copy's (bytes read plus bytes
    written), which a stream that mostly reads exceeds."""
    from experiments.harness import COPY_BANDWIDTH_BYTES_PER_S, DATASHEET_BANDWIDTH_BYTES_PER_S

    bandwidth = COPY_BANDWIDTH_BYTES_PER_S[card]
    beyond: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if (r.get("bw_fraction") or 0) > 1 and r.get("bound_us"):
            moved = moved_bytes(r, bandwidth)
            if moved > 2 * L2_BYTES:
                beyond.setdefault(f"{r['op']} {r['policy']}", []).append(
                    (moved / 1e9, r["bw_fraction"]))
    if not beyond:
        return ""
    groups = [f"{group} ({len(v)} row{'s' if len(v) > 1 else ''}, {_span([m for m, _ in v], 1)} "
              f"GB, up to {max(f for _, f in v):.2f} of the bound)" for group, v in beyond.items()]
    said = " and ".join([", ".join(groups[:-1]), groups[-1]] if len(groups) > 1 else groups)
    return (f" Not so for {said}: they move more than twice what the L2 holds, so their "
            "operands cannot sit in it even if read and written in place. The bound's "
            f"{bandwidth / 1e12:.1f} TB/s is a device-to-device copy's rate counting bytes read "
            "plus bytes written, and a stream that mostly reads runs faster (the datasheet's peak "
            f"is {DATASHEET_BANDWIDTH_BYTES_PER_S[card] / 1e12:.3g} TB/s), so for rows like "
            "these the bound is not a ceiling.")


def _span(values: list[float], digits: int = 1, unit: str = "") -> str:
    low, high = min(values), max(values)
    return (f"{low:.{digits}f}{unit}" if round(low, digits) == round(high, digits)
            else f"{low:.{digits}f}-{high:.{digits}f}{unit}")


def _bound_fraction(value: float | None) -> str:
    return _fmt(value) + ("*" if value is not None and value > 1.0 else "")


def _field(record: dict, key: str) -> object:
    """A record's field; a dotted key reads into a nested dict (``engine_steps.decode``)."""
    value: object = record
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def columns_block(name: str, columns: list[tuple[str, str]],
                  optional: list[tuple[str, str]] = ()) -> Callable[[dict, list[dict]], str]:
    """A table of the named fields (key, heading) of every record; the ``optional`` ones only
    where some record has them (fields that later runs added)."""

    def render(head: dict, records: list[dict]) -> str:
        shown = [*columns, *(c for c in optional
                             if any(_field(r, c[0]) is not None for r in records))]
        rows = [[_fmt(_field(r, key)) for key, _ in shown] for r in records]
        return _source(head, name) + "\n\n" + _table([h for _, h in shown], rows)

    return render


VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    "models-h200": columns_block("models-h200", [
        ("model", "model"), ("num_hidden_layers", "layers"), ("parameters", "parameters"),
        ("logits_finite", "finite"), ("prefill_tokens_per_s", "prefill tok/s (2048)"),
        ("decode_step_us", "decode step us (B=64)"), ("decode_tokens_per_s", "decode tok/s"),
        ("decode_memory_bound_us", "bound us"), ("decode_fraction_of_bound", "of bound"),
        ("peak_memory_gb", "peak GB"),
    ]),
    # one kernels file per card (bench_kernels): kernels-h200.json, kernels-h100.json
    **{name: functools.partial(kernels_block, name=name)
       for name in ("kernels-h200", "kernels-h100")},
    **{f"{name}-summary": functools.partial(kernels_summary_block, name=name)
       for name in ("kernels-h200", "kernels-h100")},
    "detokenize-cpu": columns_block("detokenize-cpu", [
        ("output_tokens", "output tokens a sequence"), ("batch", "sequences"),
        ("full_us", "full decode a step (us)"), ("incremental_us", "incremental a step (us)"),
        ("full_over_incremental", "full / incremental"),
    ]),
    **{name: columns_block(name, [
        ("workload", "workload"), ("batch", "B"), ("row_at_a_time_ops", "ops, row by row"),
        ("batched_ops", "ops, batched"), ("gpu_blocks_ops", "ops, GPU blocks"),
        ("one_block_ops", "ops, one block"), ("row_at_a_time_ms", "ms, row by row"),
        ("batched_ms", "ms, batched"), ("gpu_blocks_ms", "ms, GPU blocks"),
        ("one_block_ms", "ms, one block"),
    ]) for name in ("logits-processing-cpu", "logits-processing-h200", "logits-processing-h100")},
    "engine-host-cpu": columns_block("engine-host-cpu", [
        ("batch", "B"), ("output_tokens", "output tokens"), ("stop_strings", "stop strings"),
        ("final_only", "final only"), ("schedule_ms", "schedule ms"), ("commit_ms", "commit ms"),
        ("outputs_ms", "outputs ms"), ("host_ms", "host ms a step (all but the forward)"),
        ("decode_steps", "decode steps"),
    ]),
    **{name: columns_block(name, [
        ("batch", "B"), ("context", "context"), ("dots_us", "products only (us)"),
        ("mla_decode_default_us", "mla_decode, default (us)"), ("mma_floor_us", "MMA floor (us)"),
        ("dots_of_peak", "products only, of the peak"), ("kernel_of_peak", "kernel, of the peak"),
        ("target_of_peak", "the target, of the peak"),
    ], optional=[("softmax_of_peak", "+ softmax, of the peak"),
                 ("softmax_lazy_rescale_of_peak", "+ softmax, lazy rescale, of the peak"),
                 ("paged_softmax_of_peak", "+ softmax + paging, of the peak")])
       for name in ("probe-mla-dots-h100", "probe-mla-dots-h200")},
    **{name: columns_block(name, [
        ("length", "tokens"), ("dots_us", "products only (us)"),
        ("mla_prefill_us", "mla_prefill (us)"), ("sdpa_us", "SDPA, v padded (us)"),
        ("dots_of_sdpa", "products only, of SDPA's speed"),
        ("kernel_of_sdpa", "kernel, of SDPA's speed"),
        ("softmax_share", "the softmax's share of the kernel's time"),
    ]) for name in ("probe-mla-prefill-h100", "probe-mla-prefill-h200")},
    **{name: columns_block(name, [
        ("point", "point"), ("us", "working tree (us)"), ("baseline_us", "baseline (us)"),
        ("speedup", "baseline / working tree"), ("peer", "peer"), ("peer_us", "peer (us)"),
        ("ratio", "of the peer's speed"), ("baseline_ratio", "baseline, of the peer's speed"),
        ("same_bits", "same bits"),
    ]) for name in ("ab-softmax-fold-h100", "ab-softmax-fold-h200")},
}
ALIASES = {"kernels-h200-summary": "kernels-h200", "kernels-h100-summary": "kernels-h100"}


def render_readme(text: str) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        from experiments import (
            report_device,
            report_glance,
            report_kernels,
            report_onpolicy,
            report_serving,
        )
        from experiments.report_research import ALIASES as RESEARCH_ALIASES
        from experiments.report_research import research_view

        aliases = {**ALIASES, **RESEARCH_ALIASES, **report_kernels.ALIASES,
                   **report_serving.ALIASES, **report_glance.ALIASES}
        loaded = _load(aliases.get(name, name))
        view = (VIEWS.get(name) or report_device.VIEWS.get(name) or report_kernels.VIEWS.get(name)
                or report_serving.VIEWS.get(name) or report_onpolicy.VIEWS.get(name)
                or report_glance.VIEWS.get(name)
                or research_view(name) or generic_block(name))
        body = "_not measured yet_" if loaded is None else view(*loaded)
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:([\w.-]+) -->.*?<!-- /results:\1 -->", replace, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is out of date")
    args = parser.parse_args(argv)
    stale = []
    for readme in (ROOT / "README.md", ROOT / "experiments" / "README.md",
                   *sorted((ROOT / "docs" / "results").glob("*.md"))):
        if not readme.exists():
            continue
        text = readme.read_text()
        new = render_readme(text)
        if new != text:
            stale.append(readme)
            if not args.check:
                readme.write_text(new)
    if args.check and stale:
        print("out of date:", ", ".join(str(p) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
