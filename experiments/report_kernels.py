"""README views of the kernel results that gather several records into one line: issue 13's
targets as measured (``kernels-h200-targets``), a decode step before and after a change of
the tuned tables or of a kernel path (``models-h200-b128-after``, ``-b128-retune``, ``-b8-fused``),
and MLA prefill tuning runs written as results files (``tune-mla-prefill-*``); the GEMM tuning
runs' and probes' views are ``experiments.report_gemm``'s.
Looked up by ``experiments.report``."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

from experiments.report import _fmt, _load, _source, _span, _table
from experiments.report_gemm import GEMM_VIEWS


def _timed(records: list[dict], op: str, **match: object) -> list[dict]:
    return [r for r in records if r.get("op") == op and "us" in r and not r.get("superseded")
            and not r.get("error") and all(r.get(k) == v for k, v in match.items())]


def _stats(values: list[float]) -> tuple[float, float, float] | None:
    """(min, median, max), or None when no row was measured."""
    return (min(values), statistics.median(values), max(values)) if values else None


NOT_MEASURED = ("not measured", None)


def _gemm_at(records: list[dict], m: int) -> tuple[str, bool | None]:
    stats = _stats([r["ratio"] for r in _timed(records, "gemm", policy="corun", M=m)])
    if stats is None:
        return f"M {m}: not measured", None
    low, mid, _ = stats
    return f"M {m}: median {mid:.2f}, min {low:.2f}", mid >= 0.95 and low >= 0.85


def _gemm_rows(records: list[dict]) -> list[tuple[str, str, str, bool | None]]:
    at_128, ok_128 = _gemm_at(records, 128)
    at_256, ok_256 = _gemm_at(records, 256)
    both = None if None in (ok_128, ok_256) else ok_128 and ok_256
    rows = [("corun GEMM at M = 128 / 256 vs cuBLAS", "median >= 0.95, min >= 0.85",
             f"{at_128}; {at_256}", both)]
    deepseek = [r for r in _timed(records, "gemm", policy="corun")
                if str(r.get("layer", "")).startswith("deepseek-v3.")]
    measured = NOT_MEASURED
    if deepseek:
        worst = min(deepseek, key=lambda r: r["ratio"])
        low, mid, _ = _stats([r["ratio"] for r in deepseek])
        measured = (f"min {low:.2f} ({worst['layer']} at M {worst['M']}), median {mid:.2f}, "
                    f"{sum(r['ratio'] >= 0.85 for r in deepseek)} of {len(deepseek)} at >= 0.85",
                    low >= 0.85)
    rows.append(("corun GEMM, DeepSeek-V3 shapes, every M", ">= 0.85 every shape", *measured))
    return rows


# The probe's points where its grid (two 64-head blocks a sequence) fills the card.
MLA_PROBE_FULL_GRID_BATCH = 64


def _mla_probe_note(probe: list[dict] | None, name: str) -> str:
    """What the MLA decode loop's two products alone reach of the dense peak
    (experiments/probe_mla_dots.py) where the grid fills the card, beside the share of the peak
    the target asks at those points: the products are a ceiling for the kernel's structure."""
    full = [r for r in probe or [] if r["batch"] >= MLA_PROBE_FULL_GRID_BATCH]
    if not full:
        return ""
    dots = [r["dots_of_peak"] for r in full]
    asks = [r["target_of_peak"] for r in full]
    verdict = "under" if max(dots) < min(asks) else "not under"
    return (f". The loop's two products alone (`experiments/results/{name}.json`: the literal "
            f"tile and step order, a contiguous cache, no softmax or splits) reach "
            f"{_span(dots, 2)} of the peak at B >= {MLA_PROBE_FULL_GRID_BATCH}, {verdict} the "
            f"{_span(asks, 2)} the target asks at those points")


def _mla_prefill_probe_note(head: dict, probe: list[dict], name: str) -> str:
    """What MLA prefill's loop reaches of SDPA's speed with its softmax taken out
    (experiments/probe_mla_prefill.py), and the share of the kernel's time the softmax adds: on
    sm_90 Triton runs it after the products, never under them (the probe header's Triton)."""
    if not probe:
        return ""
    dots = [r["dots_of_sdpa"] for r in probe]
    share = [100 * r["softmax_share"] for r in probe]
    return (f". The loop's products alone (`experiments/results/{name}.json`: the kernel's tile, "
            f"the softmax taken out) run at {_span(dots, 2)} of SDPA's speed; the softmax, "
            f"which Triton {head.get('triton', '?')} runs after them on sm_90 (no wgmma left in "
            f"flight in the "
            f"kernel, offline), takes {_span(share, 0, '%')} of the kernel's time")


def _mla_decode_row(records: list[dict], policy: str) -> tuple[str, str, str, bool | None]:
    rows = [r for r in _timed(records, "mla_decode", policy=policy)
            if r["batch"] >= 32 and r["context"] >= 1024]
    measured = NOT_MEASURED
    if rows:
        low, _, high = _stats([r["bw_fraction"] for r in rows])
        floor_low, _, floor_high = _stats([r["compute_floor_us"] / r["bound_us"] for r in rows])
        peak_low, _, peak_high = _stats([r["compute_floor_us"] / r["us"] for r in rows])
        measured = (f"{low:.2f}-{high:.2f} of the memory bound. The MMA floor (the FLOPs at "
                    f"the measured dense peak) is {floor_low:.2f}-{floor_high:.2f}x that bound, "
                    f"so the target asks for {floor_low / 2:.2f}-{floor_high / 2:.2f} of the "
                    f"peak; the kernel runs at {peak_low:.2f}-{peak_high:.2f} of it", low >= 0.5)
    return (f"MLA decode, {policy} (128 heads, absorbed), B >= 32, ctx >= 1024",
            ">= 0.5 of the memory bound", *measured)


def _span_row(what: str, target: str, values: list[float], threshold: float,
              by_median: bool = False) -> tuple[str, str, str, bool | None]:
    stats = _stats(values)
    if stats is None:
        return (what, target, *NOT_MEASURED)
    low, mid, high = stats
    return (what, target, f"median {mid:.2f}, {low:.2f}-{high:.2f}",
            (mid if by_median else low) >= threshold)


def _l2_resident_note(rows: list[dict]) -> str:
    """How many rows move less than the L2 holds: the graph replays do not flush it, so their
    K/V may be read from L2, and their fraction of the HBM bound flatters them."""
    from experiments.report import L2_BYTES, moved_bytes

    resident = [r for r in rows if r.get("bound_us") and moved_bytes(r) < L2_BYTES]
    if not resident:
        return ""
    return (f". {len(resident)} of these {len(rows)} rows move less than the 50 MB L2, which the "
            "graph replays do not flush, so their fraction of the HBM bound is an upper estimate")


ROPE_TARGET_BW_FRACTION = 0.6  # issue 13: the median over M 1-8192
ROPE_TARGET_SHAPE = "deepseek-v3"  # bench_elementwise's shape label of the target's rows
DECODE_ATTENTION_TARGET_BW_FRACTION = 0.6  # issue 13: every target row at B <= 8


def _rope_row(rope: list[dict]) -> tuple[str, str, str, bool | None]:
    """The fractions of the bound, and what a kernel that ran every M at the smallest M's time
    (launch plus two dependent loads: position, then its cos/sin row) at the least would reach:
    the bound of a small M is far below that floor, so the median over M has a ceiling."""
    row = _span_row("RoPE, DeepSeek 64-dim rope x 128 heads, M 1-8192",
                    f">= {ROPE_TARGET_BW_FRACTION} of the bound (median)",
                    [r["bw_fraction"] for r in rope], ROPE_TARGET_BW_FRACTION, by_median=True)
    if not rope:
        return row
    floor = min(rope, key=lambda r: r["M"])
    ceiling = statistics.median(r["bound_us"] / max(r["bound_us"], floor["us"]) for r in rope)
    return (*row[:2], f"{row[2]}. At the M {floor['M']} time ({floor['us']:.2f} us) as a floor "
                      f"for every M the median could reach {ceiling:.2f}"
                      f"{_copy_note(rope, ROPE_TARGET_BW_FRACTION)}",
            row[3])


def _copy_note(rows: list[dict], threshold: float) -> str:
    """What torch's device copy of each row's bytes (``copy_us``, graph-replayed like the kernel)
    reaches of the same bound, and how close the kernel runs to it: what one launch moving those
    bytes takes in practice (a reference: a kernel that mostly reads can beat it). Empty where
    the rows predate the measurement."""
    copied = [r for r in rows if r.get("copy_us")]
    if not copied:
        return ""
    low, mid, high = _stats([r["bound_us"] / r["copy_us"] for r in copied])
    of_copy = _stats([r["copy_us"] / r["us"] for r in copied])
    verdict = (f"below the target's {threshold} itself" if mid < threshold
               else f"at or above the target's {threshold}")
    return (f". Torch's device copy of the same bytes (graph-replayed; half of them written, so a "
            f"reference, not a floor) reaches median {mid:.2f} "
            f"({low:.2f}-{high:.2f}) of the bound, {verdict}; the kernel runs at median "
            f"{of_copy[1]:.2f} ({of_copy[0]:.2f}-{of_copy[2]:.2f}) of the copy's speed "
            f"({len(copied)} of {len(rows)} rows measured)")


def _launch_floor_note(rows: list[dict], threshold: float) -> str:
    """What the rows' own launches cost with empty kernels at the same grids (``launch_floor_us``,
    graph-replayed like the kernel), and the most a kernel of those launches then reaches: its
    bytes at the bound on top of that fixed cost, bound / (bound + floor). Empty where the rows
    predate the measurement."""
    floored = [r for r in rows if r.get("launch_floor_us")]
    if not floored:
        return ""
    floor = _stats([r["launch_floor_us"] for r in floored])
    ceilings = [r["bound_us"] / (r["bound_us"] + r["launch_floor_us"]) for r in floored]
    low, mid, high = _stats(ceilings)
    short = sum(c < threshold for c in ceilings)
    return (f". Their launches with empty kernels at the same grids take median {floor[1]:.2f} "
            f"us ({floor[0]:.2f}-{floor[2]:.2f}); with the bytes at the bound on top, those "
            f"launches reach at most median {mid:.2f} ({low:.2f}-{high:.2f}) of the bound, "
            f"under the target's {threshold} at {short} of {len(floored)} rows")


def _program_floor_note(rows: list[dict], small: list[dict], threshold: float) -> str:
    """Each row's floor: the fastest other row of the same policy at B <= 8 (``small``) that does
    no more work in any respect (no more sequences, splits a sequence or tokens; each program
    walking a whole split of the same size), so a row reaches at most bound / max(floor, bound).
    Names the rows that floor holds under ``threshold``; empty where no row has a floor."""

    keys = ("M", "context", "num_splits", "split_size")

    def floor_of(row: dict) -> dict | None:
        if not all(row.get(k) for k in keys):  # rows from before these fields: no floor
            return None
        lighter = [q for q in small if q is not row and all(q.get(k) for k in keys)
                   and q["split_size"] == row["split_size"] and q["context"] >= q["split_size"]
                   and q["M"] <= row["M"] and q["num_splits"] <= row["num_splits"]
                   and q["context"] <= row["context"]]
        return min(lighter, key=lambda q: q["us"], default=None)

    floors = [(r, floor_of(r)) for r in rows]
    if not any(f for _, f in floors):
        return ""
    ceilings = [min(1.0, r["bound_us"] / f["us"]) if f else 1.0 for r, f in floors]
    low, mid, high = _stats(ceilings)
    held = [f"B {r['M']} at {r['context']} tokens, {r['bound_us']:.2f} us of bound: the floor B "
            f"{f['M']} at {f['context']} tokens, {f['us']:.2f} us"
            for (r, f), c in zip(floors, ceilings, strict=True) if c < threshold]
    return (f". Each row's floor, the policy's fastest other row with no more sequences, splits "
            f"or tokens (its programs walking the same split): these rows reach at most median "
            f"{mid:.2f} ({low:.2f}-{high:.2f}) of the bound, under the target's {threshold} at "
            f"{len(held)} of {len(rows)} rows" + (f" ({'; '.join(held)})" if held else ""))


def _decode_attention_row(records: list[dict], policy: str, what: str,
                          with_l2_and_copy: bool = True) -> tuple[str, str, str, bool | None]:
    """The policy's target rows (B <= 8) against the bound, with what their launches, their
    floors and (``with_l2_and_copy``) the L2 and a device copy of their bytes say of it."""
    target = DECODE_ATTENTION_TARGET_BW_FRACTION
    small = [r for r in _timed(records, "decode_attention", policy=policy)
             if r.get("M", 0) <= 8]
    rows = [r for r in small if r.get("target")]
    row = _span_row(what, f">= {target} of the bound", [r["bw_fraction"] for r in rows], target)
    notes = ((_l2_resident_note(rows) + _copy_note(rows, target) if with_l2_and_copy else "")
             + _launch_floor_note(rows, target) + _program_floor_note(rows, small, target))
    return (*row[:2], row[2] + notes, row[3])


def _rows(records: list[dict], mla_probe_note: str = "",
          mla_prefill_note: str = "") -> list[list[str]]:
    rows = _gemm_rows(records)
    sample = _stats([r["ratio"] for r in _timed(records, "sample", policy="corun", target=True)])
    rows.append(("sampling vs torch softmax + exponential race (vocab 152k and 129k, B 1-256)",
                 "median >= 1.0, min >= 0.8",
                 *((f"median {sample[1]:.2f}, min {sample[0]:.2f}",
                    sample[1] >= 1.0 and sample[0] >= 0.8) if sample else NOT_MEASURED)))
    for policy in ("corun_split512", "default"):
        what, target, measured, met = _mla_decode_row(records, policy)
        rows.append((what, target, measured + (mla_probe_note if met is not None else ""), met))
    what, target, measured, met = _span_row(
        "MLA prefill vs SDPA (v padded)", ">= 0.9",
        [r["ratio"] for r in _timed(records, "mla_prefill", policy="corun")], 0.9)
    rows.append((what, target, measured + (mla_prefill_note if met is not None else ""), met))
    rows.append(_rope_row(_timed(records, "rope", policy="corun", shape=ROPE_TARGET_SHAPE)))
    rows.append(_decode_attention_row(
        records, "corun", "decode attention at B <= 8 (the benchmark's target rows)"))
    # the one-launch combine, opt-in until it is measured faster
    if any(r.get("target") for r in _timed(records, "decode_attention", policy="corun_fused")):
        rows.append(_decode_attention_row(
            records, "corun_fused", "decode attention at B <= 8, fused combine (one launch)",
            with_l2_and_copy=False))
    rows.append(("MoE token sort before the grouped GEMM", "one kernel, graph-capturable",
                 *_moe_align_measured(records)))
    return [[what, target, measured,
             "—" if met is None else met if isinstance(met, str) else "yes" if met else "no"]
            for what, target, measured, met in rows]


def _moe_align_measured(records: list[dict]) -> tuple[str, bool | str | None]:
    """Launches of the policy's sort at its one-launch sizes (T * k <= FUSED_MAX_PAIRS: the
    graph-captured decode step) and past them (prefill), from each record's profiled launches;
    results from before the policy records carried them count the config sweep's launches."""
    from kernels.moe_align import FUSED_MAX_PAIRS

    policy = _timed(records, "moe_align", policy="corun")
    align = _stats([r["ratio"] for r in policy])
    if not align:
        return NOT_MEASURED
    speed = f"{align[0]:.2f}-{align[1]:.2f}x faster than the torch sort (min, median)"
    if not any("launches_us" in r for r in policy):
        launches = [len(r.get("launches_us") or {}) for r in _timed(records, "moe_align_variant")]
        if not launches:
            return NOT_MEASURED
        return f"{max(launches)} launches; {speed}", max(launches) == 1
    profiled = [r for r in policy if "launches_us" in r]
    decode = [len(r["launches_us"]) for r in profiled if r["M"] * r["K"] <= FUSED_MAX_PAIRS]
    prefill = [len(r["launches_us"]) for r in profiled if r["M"] * r["K"] > FUSED_MAX_PAIRS]
    names = (f"decode (T x k <= {FUSED_MAX_PAIRS})", decode), ("prefill", prefill)
    spans = [f"{name}: {max(n)} launch{'es' if max(n) > 1 else ''}" for name, n in names if n]
    if max(decode + prefill) == 1:
        return "; ".join([*spans, speed]), True
    # The target is the graph-captured decode step's; prefill keeps its count launch by design.
    met = "at decode sizes" if decode and max(decode) == 1 else False
    return "; ".join([*spans, speed]), met


def kernels_targets_block(head: dict, records: list[dict], name: str = "kernels-h200") -> str:
    """Issue 13's target rows, each computed from the records named beside it (the H200's
    file, or another card's: ``name``); the MLA decode and prefill rows add the same card's
    ``probe-mla-dots`` and ``probe-mla-prefill`` files where there are some."""
    card = name.removeprefix("kernels-")
    dots_name, prefill_name = f"probe-mla-dots-{card}", f"probe-mla-prefill-{card}"
    dots, prefill = _load(dots_name), _load(prefill_name)
    rows = _rows(records, _mla_probe_note(dots[1], dots_name) if dots else "",
                 _mla_prefill_probe_note(*prefill, prefill_name) if prefill else "")
    return "\n".join([_source(head, name), "",
                      _table(["kernel", "target", "measured", "met"], rows),
                      *_gemm_tables_note(records)])


def _gemm_tables_note(records: list[dict]) -> list[str]:
    """Which tuned tables the GEMM rows' policies read (``tuned_tables``: bench_gemm records it
    since the tables became per card); nothing for rows from before."""
    read = sorted({tuple(r["tuned_tables"]) for r in records
                   if r.get("op") == "gemm" and not r.get("superseded") and r.get("tuned_tables")})
    if not read:
        return []
    files = "; ".join(" over ".join(f"`kernels/tuned/{f}`" for f in reversed(t)) for t in read)
    return ["", f"The GEMM rows ran the policies' picks from {files}."]


def decode_step_change_block(head: dict, records: list[dict],
                             before_name: str = "models-h200-b128-before",
                             after_name: str = "models-h200-b128-after") -> str:
    """bench_models' decode step, the same build timed before and after a change (of the tuned
    tables, or of a kernel path): ``before_name`` beside this file (``after_name``), one row per
    model."""
    loaded = _load(before_name)
    if loaded is None:
        return f"_not measured yet_ (`experiments/results/{before_name}.json`)"
    before_head, before = loaded
    earlier = {r["model"]: r for r in before}
    rows = []
    for r in records:
        old = earlier.get(r["model"], {})
        ratio = (r["decode_step_us"] / old["decode_step_us"]
                 if old.get("decode_step_us") else None)
        rows.append([r["model"], r["decode_batch"], r["decode_context"],
                     _fmt(old.get("decode_step_us"), 1), _fmt(r["decode_step_us"], 1),
                     _fmt(ratio, 3),
                     _fmt(old.get("decode_fraction_of_bound")),
                     _fmt(r["decode_fraction_of_bound"])])
    return "\n".join([
        "before: " + _source(before_head, before_name),
        "", "after: " + _source(head, after_name), "",
        _table(["model", "B", "context", "decode step us (before)", "(after)", "after / before",
                "of memory bound (before)", "(after)"], rows)])


# Decode steps timed after a change (the key) against the file before it (the value).
DECODE_STEP_CHANGES = {
    # The tables of 2026-12-04 against those before them.
    "models-h200-b128-after": "models-h200-b128-before",
    # The GEMM re-tune at M 128 / 256 of 2026-12-05, against the tables before it.
    "models-h200-b128-retune": "models-h200-b128-after",
    # The eighth session's B = 128 step: its changes (masked rows, the M 1-32 re-tune) reach no
    # M 128 config; against the run above it adds the third session's M 64-256 re-tune.
    "models-h200-b128-mask-rows": "models-h200-b128-retune",
    # B = 1, masked rows in both: the GEMM re-tune at M 1-32, and a repeat of the first run.
    "models-h200-b1-retune-small": "models-h200-b1-mask-rows",
    "models-h200-b1-mask-rows-repeat": "models-h200-b1-mask-rows",
    # Decode attention's fused combine (one launch) against its two launches.
    "models-h200-b8-fused": "models-h200-b8-two-launch",
}

def tuned_prefill_block(name: str) -> Callable[[dict, list[dict]], str]:
    """tune_mla's prefill entry: every candidate tile's time at each length and its share of
    the peer's speed (SDPA's time / the tile's), the peer first and the pick marked."""

    def render(head: dict, records: list[dict]) -> str:
        from kernels.mla_tuned import MLATile

        entry = next((r for r in records if r.get("kind") == "prefill"), None)
        if entry is None or not entry.get("candidates"):  # a run cut before any prefill length
            return _source(head, name) + "\n\n_no prefill entry with its candidates' times_"
        peer = entry["sdpa_us"]

        def label(config: dict) -> str:
            pick = " (the pick)" if config == entry["config"] else ""
            return MLATile.from_dict(config).label + pick

        rows = [["SDPA (v padded), the peer", *(f"{us:.1f}" for us in peer)]]
        rows += [[label(c["config"]), *(f"{us:.1f} ({p / us:.2f})"
                                        for us, p in zip(c["us"], peer, strict=True))]
                 for c in sorted(entry["candidates"], key=lambda c: c["us"][-1])]
        return _source(head, name) + "\n\n" + _table(
            ["tile", *(f"{n} tokens: us (of SDPA's speed)" for n in entry["lengths"])], rows)

    return render


VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    **GEMM_VIEWS,
    **{name: tuned_prefill_block(name)
       for name in ("tune-mla-prefill-h100", "tune-mla-prefill-h200")},
    **{f"{name}-targets": functools.partial(kernels_targets_block, name=name)
       for name in ("kernels-h200", "kernels-h100")},
    **{after: functools.partial(decode_step_change_block, before_name=before, after_name=after)
       for after, before in DECODE_STEP_CHANGES.items()},
}
ALIASES = {"kernels-h200-targets": "kernels-h200", "kernels-h100-targets": "kernels-h100"}
