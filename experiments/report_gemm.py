"""README views of the GEMM tuning runs and probes written as results files: a ``tune_gemm`` run
into a file of its own (``tune-gemm-*``, beside an earlier candidate set's run), and the
``probe_gemm_*`` probes (mid M, kv_a's narrow columns, tail tiles) and the capture-spread probe.
Looked up by ``experiments.report`` through ``experiments.report_kernels.VIEWS``."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

from experiments.report import _fmt, _load, _source, _table


def tuned_gemm_block(name: str, before: str | None = None) -> Callable[[dict, list[dict]], str]:
    """A tune_gemm run's points (into a results file of its own): per point its best against
    cuBLAS (timed in the same run) and its pick; with ``before`` (an earlier run of the same
    points, another candidate set) that run's best beside each and both runs summarised."""

    def render(head: dict, records: list[dict]) -> str:
        from kernels.gemm import GemmConfig

        loaded = _load(before) if before else None
        earlier = {(e["layer"], e["m"]): e for e in (loaded[1] if loaded else [])}

        if not records:  # a narrowed run cut before its first point
            return _source(head, name) + "\n\n_no points_"

        def summary(ratios: list[float]) -> str:
            low, mid = min(ratios), statistics.median(ratios)
            return (f"min {low:.2f}, median {mid:.2f}, "
                    f"{sum(r >= 0.85 for r in ratios)} of {len(ratios)} at >= 0.85")

        ratios = [e["ratio_vs_cublas"] for e in records]
        if before:
            old = [e["ratio_vs_cublas"] for e in earlier.values()]
            # Compared at the points both runs timed; an after-run of more points is also
            # summarised whole.
            shared = [e["ratio_vs_cublas"] for e in records if (e["layer"], e["m"]) in earlier]
            said = (f"Of cuBLAS's speed, each run's best at its points: {summary(old)} before "
                    f"(`experiments/results/{before}.json`); {summary(shared)} after"
                    if old and shared else "")
            if said and len(shared) < len(ratios):
                said += f", and at all {len(ratios)} of its points {summary(ratios)}"
            said += "." if said else ""
        else:
            said = f"Of cuBLAS's speed, the best candidate at each point: {summary(ratios)}."
        rows = [[e["layer"], e["m"],
                 *([_fmt(earlier.get((e["layer"], e["m"]), {}).get("ratio_vs_cublas"))]
                   if before else []),
                 _fmt(e["ratio_vs_cublas"]), e.get("candidates", "—"),
                 GemmConfig.from_dict(e["config"]).label]
                for e in sorted(records, key=lambda e: (e["m"], e["layer"]))]
        header = ["layer", "M", *(["before", "after"] if before else ["best"]), "candidates",
                  "the pick" if not before else "after's pick"]
        return "\n".join([_source(head, name), "", said, "", _table(header, rows)])

    return render


def probe_gemm_mid_m_block(name: str) -> Callable[[dict, list[dict]], str]:
    """experiments/probe_gemm_mid_m.py: per shape and M, cuBLAS and the pick beside the fastest
    variant of each kind (whole tiles, split 2, persistent, stream-K), each as a share of
    cuBLAS's speed, the reduce's time alone, (second run on) the card's copy of the weights
    and the pick's loads without the product where the pick is TMA-fed whole tiles, and (third
    run on) the fastest TMA-fed whole tile's loads alone, as a time and as a multiple of that
    tile's whole GEMM."""

    def best(variants: list[dict], kind: str) -> dict | None:
        timed = [v for v in variants if "us" in v
                 and (kind in v["name"] if kind else
                      not any(w in v["name"] for w in ("split", "persistent", "stream-K")))]
        return min(timed, key=lambda v: v["us"]) if timed else None

    def cell(v: dict | None, reduce: bool = False) -> str:
        if v is None:
            return "—"
        text = f"{_fmt(v['ratio'])} ({v['name']})"
        return text + (f", reduce {_fmt(v['reduce_us'])} us" if reduce and v.get("reduce_us")
                       else "")

    def render(head: dict, records: list[dict]) -> str:
        floors = any("copy_us" in r for r in records)  # the second run on

        def loads(r: dict) -> str:
            if "loads_only_whole_tiles_us" not in r:
                return "—"
            return (f"{_fmt(r['loads_only_whole_tiles_us'])} / "
                    f"{_fmt(r['loads_only_132_shares_us'])}")

        fastest = any("loads_only_fastest_whole" in r for r in records)  # the third run on

        def fastest_loads(r: dict) -> str:
            # beside the same tile's whole GEMM: above 1 the loads-alone kernel is no floor
            timed = r.get("loads_only_fastest_whole")
            if not timed:
                return "—"
            gemm_us = next(v["us"] for v in r["variants"] if v["name"] == timed["name"])
            return (f"{_fmt(timed['us'])} ({timed['name']}), "
                    f"{timed['us'] / gemm_us:.2f}x its GEMM")

        rows = [[r["layer"], r["M"], _fmt(r["cublas_us"]), _fmt(r["pick_ratio"]),
                 cell(best(r["variants"], "")), cell(best(r["variants"], "split 2"), True),
                 cell(best(r["variants"], "persistent")),
                 cell(best(r["variants"], "stream-K"), True),
                 *([_fmt(r.get("copy_us")), loads(r)] if floors else []),
                 *([fastest_loads(r)] if fastest else [])]
                for r in records]
        header = ["layer", "M", "cuBLAS (us)", "pick", "whole tiles, best", "split 2, best",
                  "persistent, best", "stream-K, best",
                  *(["copy of the weights (us)",
                     "the pick's TMA loads alone: whole tiles / 132 shares (us)"]
                    if floors else []),
                  *(["the fastest TMA-fed whole tile's loads alone (us), against its GEMM"]
                    if fastest else [])]
        return _source(head, name) + "\n\n" + _table(header, rows)

    return render


def probe_gemm_narrow_n_block(head: dict, records: list[dict], *, name: str) -> str:
    """experiments/probe_gemm_narrow_n.py: per M, cuBLAS, the pick and the fastest wide part,
    narrow part and pair of the column split, each pair as a share of cuBLAS's speed, and how
    many pairs keep the pick's bits."""
    def fastest(timed: dict[str, float]) -> str:
        label = min(timed, key=timed.get)
        return f"{_fmt(timed[label])} ({label})"

    rows = []
    for r in records:
        best = min(r["pairs"], key=lambda p: p["us"])
        same = sum(p["same_bits_as_pick"] for p in r["pairs"])
        rows.append([r["layer"], r["M"], _fmt(r["cublas_us"]),
                     f"{_fmt(r['pick_ratio'])} ({_fmt(r['pick_us'])} us)",
                     fastest(r["wide"]), fastest(r["narrow"]),
                     f"{_fmt(best['ratio'])} ({_fmt(best['us'])} us: {best['wide']} + "
                     f"{best['narrow']}; {'the' if best['same_bits_as_pick'] else 'not the'} "
                     f"pick's bits)", f"{same} of {len(r['pairs'])}"])
    header = ["layer", "M", "cuBLAS (us)", "pick, of cuBLAS's speed",
              "the wide_n wide columns alone, fastest (us)", "the narrow rest alone, fastest (us)",
              "the best pair, of cuBLAS's speed", "pairs with the pick's bits"]
    return _source(head, name) + "\n\n" + _table(header, rows)


def probe_gemm_tail_block(head: dict, records: list[dict], *, name: str) -> str:
    """experiments/probe_gemm_tail.py: per point, cuBLAS, the pick and the fastest tail config
    (split and unsplit), each as a share of cuBLAS's speed, and the tail configs that walk K as
    the pick does with their bits against the pick's."""
    from kernels.gemm import GemmConfig

    def best(tails: list[dict], split: bool) -> str:
        timed = [t for t in tails if "us" in t and ("split" in t["name"]) == split]
        if not timed:
            return "—"
        top = min(timed, key=lambda t: t["us"])
        return f"{_fmt(top['ratio'])} ({top['name']})"

    rows = []
    for r in records:
        compared = [t for t in r["tails"] if t.get("same_bits_as_pick") is not None]
        same = sum(t["same_bits_as_pick"] for t in compared)
        errors = sum("error" in t for t in r["tails"])
        rows.append([r["layer"], r["M"], _fmt(r["cublas_us"]),
                     f"{_fmt(r['pick_ratio'])} ({GemmConfig.from_dict(r['pick']).label})",
                     best(r["tails"], False), best(r["tails"], True),
                     f"{same} of {len(compared)}" if compared else "—", errors])
    header = ["layer", "M", "cuBLAS (us)", "pick, of cuBLAS's speed", "tail, unsplit, best",
              "tail, split, best", "same K walk as the pick: the pick's bits",
              "configs that did not run"]
    return _source(head, name) + "\n\n" + _table(header, rows)

def probe_capture_spread_block(head: dict, records: list[dict], *, name: str) -> str:
    """experiments/probe_capture_spread.py: per point and condition (same operands each capture,
    fresh ones each capture), the pick's and cuBLAS's median time over the captures with their
    extremes and max / min, and the median of the per-capture ratios; with many points (the
    ``--survey``), first how often each side's placements spread past ``SPREAD_NOTED``."""
    from kernels.gemm import GemmConfig

    def times(series: dict) -> str:
        return (f"{_fmt(series['median_us'])} ({_fmt(series['min_us'])}-"
                f"{_fmt(series['max_us'])}), {_fmt(series['max_over_min'], 3)}")

    rows, fresh = [], []
    for r in records:
        for condition in ("same_operands", "fresh_operands"):
            if condition not in r:
                continue
            c = r[condition]
            rows.append([r["layer"], r["M"], GemmConfig.from_dict(r["pick"]).label,
                         condition.replace("_", " "), times(c["ours"]), times(c["cublas"]),
                         _fmt(c["ratio_median"])])
            if condition == "fresh_operands":
                fresh.append((r, c))
    header = ["layer", "M", "the pick", "operands", "pick: median (min-max) us, max / min",
              "cuBLAS: median (min-max) us, max / min", "of cuBLAS's speed (median)"]
    rounds = records[0]["rounds"] if records else 0
    said = f"{rounds} graph captures per condition, the pick and cuBLAS interleaved."
    if len(fresh) > 3:
        def over(side: str) -> str:
            spreads = [c[side]["max_over_min"] for _, c in fresh]
            worst_r, worst_c = max(fresh, key=lambda rc: rc[1][side]["max_over_min"])
            return (f"{sum(x > SPREAD_NOTED for x in spreads)} of {len(spreads)} points past "
                    f"{SPREAD_NOTED}x (median {_fmt(statistics.median(spreads), 3)}x, most "
                    f"{_fmt(worst_c[side]['max_over_min'], 3)}x at {worst_r['layer']} M "
                    f"{worst_r['M']})")
        said += (f" Over fresh placements, the pick's time spreads {over('ours')}; cuBLAS's "
                 f"{over('cublas')}.")
    if head.get("complete") is False:
        said += (f" Cut by its {_fmt(head.get('budget_s'), 0)} s budget after {len(records)} of "
                 f"{head.get('expected_points', '?')} points.")
    return _source(head, name) + "\n\n" + said + "\n\n" + _table(header, rows)


# A spread of time over placements the survey counts: past the ~3% cuBLAS's moved between runs
SPREAD_NOTED = 1.1


GEMM_VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    "tune-gemm-deepseek-large-m-h100": tuned_gemm_block(
        "tune-gemm-deepseek-large-m-h100", "tune-gemm-deepseek-large-m-h100-before"),
    "tune-gemm-qwen3-8b-mid-m-h100": tuned_gemm_block("tune-gemm-qwen3-8b-mid-m-h100"),
    "tune-gemm-mid-m-deep-h100": tuned_gemm_block("tune-gemm-mid-m-deep-h100",
                                                  "tune-gemm-qwen3-8b-mid-m-h100"),
    **{name: probe_gemm_mid_m_block(name)
       for name in ("probe-gemm-mid-m-h100", "probe-gemm-mid-m-h100-before",
                    "probe-gemm-mid-m-h100-run2",
                    "probe-gemm-mid-m-h200")},
    **{name: functools.partial(probe_gemm_narrow_n_block, name=name)
       for name in ("probe-gemm-narrow-n-h100", "probe-gemm-narrow-n-h200")},
    **{name: functools.partial(probe_gemm_tail_block, name=name)
       for name in ("probe-gemm-tail-h100", "probe-gemm-tail-h200")},
    **{name: functools.partial(probe_capture_spread_block, name=name)
       for name in ("probe-capture-spread-h100", "probe-capture-spread-h100-before-repick",
                    "probe-capture-spread-h200", "probe-capture-spread-survey-h100",
                    "probe-capture-spread-survey-h200")},
}
