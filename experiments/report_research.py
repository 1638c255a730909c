"""README views of the research scripts (issue 14): the paper's table beside its claims, the
invariance atlas, and one table per ablation. ``experiments.report`` looks names up here
(``research_view``); every figure comes from the results file, and a row is rendered only
when the file has it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.report import _fmt, _source, _table, columns_block
from experiments.report_serving import SERVING_COLUMNS, STEP_COLUMNS

PEERS = ("batch_invariant", "batch_invariant_tuned")
PEER_NAMES = {"batch_invariant": "batch-invariant (portable)",
              "batch_invariant_tuned": "batch-invariant (tuned)"}
# The claims table's comparisons: the paper's peer (portable batch-invariant), the stronger tuned
# peer it does not have, and ``default``, the non-deterministic speed corun is meant to match.
CLAIM_PEERS = (*PEERS, "default")
CLAIM_PEER_NAMES = {**PEER_NAMES, "default": "default (not deterministic)"}


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def _by_model(records: list[dict]) -> list[dict]:
    """The records grouped by model (alphabetically), each model's modes in run order: a merged
    file holds its families in the order of the device calls that measured them."""
    order = {m: i for i, m in enumerate(sorted({r.get("model", "") for r in records}))}
    return sorted(records, key=lambda r: order[r.get("model", "")])


def paper_block(head: dict, records: list[dict]) -> str:
    rows = []
    for r in _by_model(records):
        measured = (r.get("measured_at") or "—")[:16].replace("T", " ")
        if "error" in r:
            rows.append([r["model"], _fmt(r.get("layers")), r["mode"], measured,
                         f"failed: {r['error'][:80]}", *["—"] * 10])
            continue
        rows.append([r["model"], _fmt(r.get("layers")), r["mode"], measured,
                     _fmt(r["output_tok_s"]),
                     _fmt(r.get("ttft_ms_mean"), 1), _fmt(r.get("ttft_ms_p50"), 1),
                     _fmt(r.get("tpot_ms_mean")), _fmt(r.get("tpot_ms_p50")),
                     _fmt(r.get("prefill_seconds")), _fmt(r.get("decode_step_ms_p50")),
                     _fmt(r.get("jit_compiles_timed")), len(r.get("discarded_runs", [])),
                     _fmt(r.get("mismatches")), _fmt(r.get("num_preemptions"))])
    trunc = head.get("truncation", {})
    depth = "; ".join(f"{f}: `{t['config']}`, {t['layers']} of {t['full_layers']} layers "
                      f"({t['bf16_weight_gb']} GB)" for f, t in trunc.items())
    return "\n".join([_source(head, "paper-h200"), "", f"Depth: {depth}.", "", _table(
        ["model", "layers", "mode", "measured (UTC)", "output tok/s", "TTFT mean ms",
         "TTFT p50 ms", "TPOT mean ms", "TPOT p50 ms", "prefill s", "decode step p50 ms",
         "compiles in the timed run", "runs discarded for compiling", "mismatches",
         "preemptions"], rows)])


_CLAIM_FIELDS = {"throughput": "output_tok_s", "ttft": "ttft_ms_mean", "tpot": "tpot_ms_mean"}


def _change_pct(corun: dict, peer: dict | None, short: str, recorded: float) -> float:
    """corun's change against ``peer`` in percent, from the two records' raw figures (the
    record's own field is rounded to 0.1, and a mean of rounded values drifts); the recorded
    value where the peer's record is not in the file."""
    field = _CLAIM_FIELDS[short]
    if peer is None or not corun.get(field) or not peer.get(field):
        return recorded
    return 100 * (corun[field] / peer[field] - 1)


def paper_claims_block(head: dict, records: list[dict]) -> str:
    """The paper's three claims beside corun's measured change against each batch-invariant
    peer, per model and on average; a claim row appears only where a model has both records."""
    claims = head.get("paper_claims", {})
    corun = _by_model([r for r in records if r.get("mode") == "corun" and "error" not in r])
    lines = [_source(head, "paper-h200"), ""]
    rows = []
    low, high = claims.get("throughput_gain_over_batch_invariant_pct", ("?", "?"))
    spec = (("throughput", "output throughput", f"+{low}% to +{high}%"),
            ("ttft", "TTFT (mean)", _pct(claims.get("ttft_change_pct_mean"))),
            ("tpot", "TPOT (mean)", _pct(claims.get("tpot_change_pct_mean"))))
    by_model_mode = {(r.get("model"), r.get("mode")): r for r in records if "error" not in r}
    for peer in CLAIM_PEERS:
        for short, what, paper in spec:
            key = f"{short}_change_pct_vs_{peer}"
            got = {r["model"]: _change_pct(r, by_model_mode.get((r["model"], peer)), short,
                                           r[key]) for r in corun if key in r}
            if not got:
                continue
            mean = statistics.fmean(got.values())
            if peer != "batch_invariant":  # the paper states no claim against this peer
                gap = "—"
            elif short == "throughput":
                low, high = claims.get("throughput_gain_over_batch_invariant_pct", (None, None))
                inside = low is not None and all(low <= v <= high for v in got.values())
                gap = "inside the range" if inside else "outside the range"
            else:
                target = claims.get(f"{short}_change_pct_mean")
                gap = "—" if target is None else f"{mean - target:+.1f} points"
            rows.append([f"{what} vs {CLAIM_PEER_NAMES[peer]}",
                         paper if peer == "batch_invariant" else "— (not the paper's peer)",
                         ", ".join(f"{m} {_pct(v)}" for m, v in got.items()), _pct(mean), gap])
    if not rows:
        return "\n".join(lines + ["_no model has both a corun and a batch-invariant record yet_"])
    lines.append(_table(["claim: corun vs", "paper", "measured per model", "measured mean",
                         "measured - paper"], rows))
    return "\n".join(lines)


def _cell(count: int | None, of: int | None) -> str:
    if count is None:
        return "—"
    return "0" if count == 0 else f"**{count}** of {of}"


def atlas_block(head: dict, records: list[dict], only_variant: bool = False) -> str:
    """The atlas table; ``only_variant`` keeps the measured cases that are not batch-invariant
    (the README's summary: every other case changed no bit under (a)-(d))."""
    rows, measured = [], [r for r in records if "other_rows" in r]
    for r in records:
        if only_variant and ("other_rows" not in r or r["batch_invariant"]):
            continue
        if "other_rows" not in r:
            rows.append([r["op"], r["impl"], r["policy"], r.get("shape", "—"),
                         f"not measured: {(r.get('error') or r.get('skipped', ''))[:90]}",
                         "", "", "", ""])
            continue
        verdict = ("batch-invariant" if r["batch_invariant"] else
                   "position-invariant" if r["position_invariant"] else "neither")
        if not r["deterministic"]:
            verdict += ", not run-to-run deterministic"
        rows.append([r["op"], r["impl"], r["policy"], r["shape"],
                     _cell(r["other_rows"], r["row_elements"]),
                     _cell(r["row_index"], r["row_elements"]),
                     _cell(r["batch_size"], r["row_elements"]),
                     ", ".join(map(str, r["batch_sizes_changed"])) or "—",
                     _cell(r["run_to_run"], r["run_to_run_elements"]) + f" · {verdict}"])
    position = sum(r["position_invariant"] for r in measured)
    batch = sum(r["batch_invariant"] for r in measured)
    skipped = head.get("skipped") or []
    return "\n".join([
        _source(head, "invariance-atlas-h200"), "",
        f"Of {len(measured)} cases measured, {position} are position-invariant ((a) and (b) "
        f"unchanged) and {batch} of those batch-invariant too ((c) unchanged)"
        + (f"; {len(skipped)} cases were skipped by the time budget" if skipped else "") + "."
        + (" The cases below are the ones that are not batch-invariant; the full table is in "
           "`experiments/README.md`." if only_variant else ""),
        "", _table(["op", "implementation", "policy", "shape", "(a) other rows",
                    "(b) row index", "(c) batch size", "changed at M", "(d) run to run"],
                   rows)])


def _provenance(head: dict) -> str:
    """What a results file says of itself beyond the run: points merged from an earlier run
    (``--merge``), and series its run did not reach (``not_run``), each with where and why."""
    out = ""
    merged = head.get("merged")
    if merged:
        out += (f" {merged['points_kept']} points are kept from an earlier run"
                f" ({merged.get('date')}, `{merged.get('command')}`).")
        if merged.get("note"):
            out += f" Merge: {merged['note']}."
    for recovered in head.get("recovered") or []:
        out += (f" {recovered['points']} points of {', '.join(recovered['modes'])} are read back"
                f" from `{recovered['log']}`, the log of a run stopped before it saved them"
                " (`experiments/serving_log.py`: the fields its printed result blocks hold).")
    not_run = head.get("not_run")
    if not_run:
        out += f" Not run: {', '.join(not_run['modes'])} ({not_run['why']})."
    return out


def ablate_block(name: str) -> Callable[[dict, list[dict]], str]:
    def render(head: dict, records: list[dict]) -> str:
        repeated = (head.get("repeats") or 1) > 1
        rows = [[r["series"], _fmt(r["value"]),
                 f"failed: {r['error'][:80]}" if "error" in r else _fmt(r["output_tok_s"]),
                 *([", ".join(f"{t:.0f}" for t in r.get("output_tok_s_runs", []))]
                   if repeated else []),
                 _fmt(r.get("ttft_ms_p50"), 1), _fmt(r.get("tpot_ms_p50")),
                 _fmt(r.get("decode_step_ms_p50")), _fmt(r.get("mismatches")),
                 _fmt(r.get("num_preemptions"))] for r in records]
        skipped = head.get("skipped") or []
        return "\n".join([_source(head, name), "", f"Axis `{head.get('axis')}`: "
                          f"{head.get('what', '')}."
                          + (f" Skipped by the time budget: {', '.join(skipped)}." if skipped
                             else "") + _provenance(head), "",
                          _table(["series", "value", "output tok/s",
                                  *([f"runs (median of {head['repeats']})"] if repeated
                                    else []),
                                  "TTFT p50 ms", "TPOT p50 ms", "decode step p50 ms",
                                  "mismatches", "preemptions"], rows),
                          "", f"![{name}](results/{name}.png)"])

    return render


def research_view(name: str) -> Callable[[dict, list[dict]], str] | None:
    """The view of a results block name, or None if it is not one of these."""
    if name == "paper-h200":
        return paper_block
    if name == "paper-h200-claims":
        return paper_claims_block
    if name == "invariance-atlas-h200":
        return atlas_block
    if name == "invariance-atlas-h200-summary":
        return lambda head, records: atlas_block(head, records, only_variant=True)
    if name.startswith("ablate-serving-load-"):  # -h200, -h100: the card it ran on
        table = columns_block(name, SERVING_COLUMNS, STEP_COLUMNS)
        return lambda head, records: (f"{table(head, records)}\n\n"
                                      + (f"{_provenance(head).strip()}\n\n"
                                         if _provenance(head) else "")
                                      + f"![{name}](results/{name}.png)")
    if name.startswith("ablate-"):
        return ablate_block(name)
    return None


ALIASES = {"paper-h200-claims": "paper-h200",
           "invariance-atlas-h200-summary": "invariance-atlas-h200"}
