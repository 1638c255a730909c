"""The axes of ``experiments.ablate``: for each, its values and the modes it applies to.

A point is one engine config: ``bench_offline.engine_config(variant, args)`` (the headline's
settings: concurrency 256, corun's shipped defaults, the dynamic modes' 8192-token budget) with
the axis's field(s) set to one value, everything else at those defaults. ``variant`` is one of
``bench_offline.VARIANTS`` (``corun``, ``corun_isolated``, ``corun_overlap``, the peers); a
variant an axis does not apply to is not run on it (``decode-split-size`` does nothing under
``default``, whose split follows the batch).

``--dry-run`` scales every token count by 1/16 (and B to the CPU workload), as the sweep does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

PEERS = ("batch_invariant_tuned", "batch_invariant", "default")
ALL_MODES = ("corun", *PEERS)


@dataclasses.dataclass(frozen=True)
class Point:
    value: object  # the axis's value (x of the plot)
    variant: str  # bench_offline.VARIANTS key: the series
    fields: dict  # EngineConfig overrides
    kernel_policy: str | None = None  # kernel-policy axis: the kernels' mode under its schedule
    series_name: str | None = None  # the plot's line (default: the variant)

    @property
    def series(self) -> str:
        return self.series_name or self.variant

    @property
    def label(self) -> str:
        return f"{self.series}@{self.value}"


@dataclasses.dataclass(frozen=True)
class Axis:
    what: str  # one line for the README and the results header
    values: tuple  # at H200 scale
    modes: tuple[str, ...]  # the variants it applies to, in run order
    fields: Callable[[object, str], dict]  # (value, variant) -> EngineConfig overrides
    scale_values: bool = True  # token counts: divided by 16 in the dry run
    mode_major: bool = False  # points of one variant share a runner (only scheduling changes)


def _decode_batch(b, variant):
    # corun's B and every mode's concurrency cap together: B slots need B sequences admitted.
    fields = {"max_num_seqs": b}
    return {**fields, "decode_batch_size": b} if variant.startswith("corun") else fields


def _step_tokens(t, variant):
    # corun's packed step T; the dynamic modes' per-step token budget is the analogous knob.
    if variant.startswith("corun"):
        return {"prefill_step_tokens": t}
    return {"max_num_batched_tokens": t}


AXES: dict[str, Axis] = {
    "decode-batch": Axis(
        "corun's fixed decode batch B (with max_num_seqs = B); the peers' concurrency cap B",
        (32, 64, 128, 256), ("corun", "batch_invariant_tuned", "default"), _decode_batch,
        scale_values=False),
    "decode-split-size": Axis(
        "decode attention's fixed KV split size in tokens (not used by default's dynamic split)",
        (64, 128, 256, 512, 1024), ("corun", "batch_invariant_tuned"),
        lambda v, _: {"decode_split_size": v}, scale_values=False),
    "cuda-graphs": Axis(
        "fixed-shape steps captured as CUDA graphs and replayed, or run eagerly",
        (True, False), ALL_MODES, lambda v, _: {"cuda_graphs": v}, scale_values=False),
    "prefill-policy": Axis(
        "corun's prefill: aligned chunks of several requests packed in one fixed T-token step, "
        "or each chunk alone (the paper's)", ("packed", "isolated"), ("corun",),
        lambda v, _: {"prefill_policy": v}, scale_values=False),
    "prefill-chunk": Axis(
        "the chunk size C (corun: chunks end at multiples of C; peers: the largest chunk)",
        (256, 512, 1024, 2048), ("corun", "corun_isolated", "batch_invariant_tuned"),
        lambda v, _: {"prefill_chunk_size": v}),
    "prefill-step-tokens": Axis(
        "corun's packed step T; the peers' per-step token budget (max_num_batched_tokens)",
        (1024, 2048, 4096, 8192), ("corun", "batch_invariant_tuned", "default"), _step_tokens),
    "stall-budget": Axis(
        "corun's prefill_token_budget: prefill tokens run between two decode steps",
        (1024, 2048, 4096, 8192, 16384), ("corun", "corun_overlap"),
        lambda v, _: {"prefill_token_budget": v}, mode_major=True),
    "overlap": Axis(
        "corun's two-stream overlap of a decode step with a prefill step",
        (False, True), ("corun", "corun_isolated"),
        lambda v, _: {"overlap_prefill_decode": v}, scale_values=False),
    "decode-fused-combine": Axis(
        "decode attention's splits combined by the last lane in the split launch (one launch) or "
        "by a second launch: the same bits, so only speed can differ",
        (False, True), ("corun", "batch_invariant_tuned", "default"),
        lambda v, _: {"decode_fused_combine": v}, scale_values=False),
    "peer-graphs": Axis(
        "the peers' small prefill and mixed steps padded to token buckets and replayed from CUDA "
        "graphs (dynamic_graph_tokens at its default), or run eagerly at their exact shapes",
        (True, False), PEERS, lambda v, _: {} if v else {"dynamic_graph_tokens": ()},
        scale_values=False),
    "kernel-policy": Axis(
        "the kernels' policy under corun's schedule (fixed shapes), beside the peers under "
        "their own dynamic schedule", ALL_MODES, ("corun", *PEERS), lambda v, _: {},
        scale_values=False),
}


def points(axis: str, modes: list[str] | None, values: list | None, dry_run: bool,
           max_num_seqs: int) -> list[Point]:
    """The points of ``axis`` in run order: value-major (every variant at a value before the
    next value), or variant-major where the points of a variant can share one runner."""
    spec = AXES[axis]
    variants = tuple(modes) if modes else spec.modes
    vals = tuple(values) if values else spec.values
    if dry_run and spec.scale_values and not values:
        vals = tuple(max(16, v // 16) for v in vals)
    if dry_run and axis == "decode-batch" and not values:
        vals = tuple(sorted({max(1, max_num_seqs // 2), max_num_seqs}))
    if dry_run and axis == "decode-split-size" and not values:
        vals = (16, 32)
    if axis == "kernel-policy":
        # The corun schedule with every kernel policy (unless --modes leaves corun out), then each
        # peer under its own schedule.
        out = [Point(k, "corun", {}, kernel_policy=k, series_name="corun schedule")
               for k in vals if "corun" in variants]
        return out + [Point(v, v, {}, series_name="own dynamic schedule")
                      for v in variants if v != "corun" and v in vals]
    pairs = ([(v, x) for v in variants for x in vals] if spec.mode_major
             else [(v, x) for x in vals for v in variants])
    return [Point(x, v, spec.fields(x, v)) for v, x in pairs]


def plot(axis: str, records: list[dict], path) -> None:
    """Throughput and TPOT p50 against the axis, one line per series, mismatches annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "output_tok_s" in r]
    values = list(dict.fromkeys(str(r["value"]) for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for series in dict.fromkeys(r["series"] for r in ok):
        rows = [r for r in ok if r["series"] == series]
        xs = [values.index(str(r["value"])) for r in rows]
        for ax, key in zip(axes, ("output_tok_s", "tpot_ms_p50"), strict=True):
            line, = ax.plot(xs, [r.get(key) or 0 for r in rows], "o-", label=series)
            runs = [r.get("output_tok_s_runs") for r in rows]
            if key == "output_tok_s" and all(runs):  # repeated points: the runs' range
                ys = [r[key] for r in rows]
                ax.errorbar(xs, ys, yerr=[[y - min(rs) for y, rs in zip(ys, runs, strict=True)],
                                          [max(rs) - y for y, rs in zip(ys, runs, strict=True)]],
                            fmt="none", ecolor=line.get_color(), capsize=3)
            if key == "output_tok_s":
                for x, r in zip(xs, rows, strict=True):
                    if "mismatches" in r:
                        ax.annotate(f"m={r['mismatches']}", (x, r[key]), fontsize=7,
                                    textcoords="offset points", xytext=(0, 5), ha="center")
    for ax, label in zip(axes, ("output tokens/s", "TPOT p50 (ms)"), strict=True):
        ax.set_xticks(range(len(values)), values, fontsize=8)
        ax.set_xlabel(axis)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"ablation: {axis} (m = fingerprint mismatches of the audit)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
