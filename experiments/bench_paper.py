"""The paper's table, measured: its three model families, every mode, the offline workload.

The paper (DESIGN.md) claims 15-324% more throughput than batch-invariant kernels, TTFT -51.8%
and TPOT -48.6% on average, on Qwen3-235B-A22B, DeepSeek-V3 and Hy3. This script runs those
families on one H200 and every mode (``default``, both batch-invariant peers, ``corun``) on the
workload of ``bench_offline`` (input lengths uniform in [256, 2048], 256 output tokens with EOS
ignored, all requests at t=0, a per-request sampling seed), reusing its warm-up, per-step
profile and fingerprint audit (reschedule + alone). Random bf16 weights, seeded.

The full models do not fit one 141 GB H200 (235 B / 671 B / 295 B parameters), so each family
runs depth-truncated with its real per-layer shapes (``models.config.NAMED_CONFIGS``):
qwen3-235b-a22b-l12, deepseek-v3-l6 (3 dense + 3 MoE layers) and hy3-l14 (the dense layer 0 +
13 MoE layers), 62 / 76 / 99 GB of weights, leaving room for the KV cache. The header records
each one's layers, parameters and the reason. Per-token work per layer is the real one; what
truncation changes is the ratio of per-layer to per-model costs (embedding, LM head, sampling,
host work per step), which weighs more at 6-14 layers than at 61-94.

Writes ``experiments/results/<--name>.json`` (header + one record per (model, mode), rewritten
after each, so a cut run keeps what it measured) and a PNG beside it (``--replot PATH`` redraws
it from a results file). ``--dry-run``: the tiny configs of the same
families on the CPU in seconds (CI runs it).

    python -m experiments.bench_paper --models hy3        # H200, ~3-4 min per model
    python -m experiments.bench_paper --models hy3 --num-requests 100
    python -m experiments.bench_paper --dry-run           # CPU, tiny-*, seconds
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from experiments import bench_offline
from experiments.harness import write_results
from experiments.offline_workload import make_workload

# Paper family -> (the config run on one H200, its tiny CPU twin for --dry-run).
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3-235b-a22b": ("qwen3-235b-a22b-l12", "tiny-qwen3-moe"),
    "deepseek-v3": ("deepseek-v3-l6", "tiny-deepseek-v3"),
    "hy3": ("hy3-l14", "tiny-hy3"),
}
# The dynamic peers first, corun last: each model's ratios need its peers, and a cut run keeps
# whole peers rather than a corun figure with nothing to compare it with.
MODES = ("default", "batch_invariant", "batch_invariant_tuned", "corun")
# The paper's claims (DESIGN.md), rendered beside the measured figures by experiments.report.
PAPER_CLAIMS = {"throughput_gain_over_batch_invariant_pct": [15, 324],
                "ttft_change_pct_mean": -51.8, "tpot_change_pct_mean": -48.6}
H200_BYTES = 141e9
DRY_RUN_ARGS = dict(device="cpu", dtype="float32", num_requests=6, input_len=(8, 40),
                    output_len=3, max_num_seqs=4, max_num_batched_tokens=64, audit_requests=3,
                    alone_sample=2, warmup_burst=4, name="paper-cpu-dry-run",
                    corun_set=["prefill_step_tokens=64", "prefill_chunk_size=32",
                               "prefill_token_budget=64"])


def truncation(family: str, config_name: str) -> dict:
    """How deep the run is and why, from the named configs."""
    from models.config import NAMED_CONFIGS, num_parameters

    full, run = NAMED_CONFIGS[family], NAMED_CONFIGS[config_name]
    params = num_parameters(run)
    moe_layers = sum(run.is_moe_layer(i) for i in range(run.num_hidden_layers))
    return {"config": config_name, "layers": run.num_hidden_layers,
            "moe_layers": moe_layers, "full_layers": full.num_hidden_layers,
            "parameters": params, "full_parameters": num_parameters(full),
            "bf16_weight_gb": round(params * 2 / 1e9, 1),
            "why": "the tiny CPU twin of the family (--dry-run)" if config_name.startswith(
                "tiny-") else
            f"{num_parameters(full) * 2 / 1e9:.0f} GB of bf16 weights in full do not fit "
                   f"one {H200_BYTES / 1e9:.0f} GB H200; {run.num_hidden_layers} layers of the "
                   f"real shapes ({params * 2 / 1e9:.0f} GB) leave room for the KV cache"}


def add_paper_ratios(records: list[dict]) -> None:
    """Per model: corun's throughput, TTFT and TPOT against each peer, as ratios (for
    bench_offline's fields) and as percent changes (the paper's form)."""
    for family in {r["model"] for r in records}:
        group = [r for r in records if r["model"] == family and "output_tok_s" in r]
        bench_offline.add_ratios(group)
        by_mode = {r["mode"]: r for r in group}
        corun = by_mode.get("corun")
        if corun is None:
            continue
        for peer in ("default", "batch_invariant", "batch_invariant_tuned"):
            other = by_mode.get(peer)
            if other is None:
                continue
            for key, short in (("output_tok_s", "throughput"), ("ttft_ms_mean", "ttft"),
                               ("tpot_ms_mean", "tpot")):
                if corun.get(key) and other.get(key):
                    corun[f"{short}_change_pct_vs_{peer}"] = round(
                        100 * (corun[key] / other[key] - 1), 1)


PLOT_METRICS = (("output_tok_s", "output tokens/s", "throughput"),
                ("ttft_ms_mean", "TTFT mean (ms)", "ttft"),
                ("tpot_ms_mean", "TPOT mean (ms)", "tpot"))
MODE_COLORS = {"default": "#999999", "batch_invariant": "#cc6666",
               "batch_invariant_tuned": "#aa3333", "corun": "#3366cc"}


def plot(records: list[dict], path: Path) -> None:
    """Throughput, TTFT and TPOT (means, the paper's statistics) per family and mode, corun's
    bars labelled with its change against the portable batch-invariant peer; each panel's title
    gives the paper's claim for that metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if "output_tok_s" in r]
    if not measured:  # every mode so far failed: nothing to draw
        return
    families = list(dict.fromkeys(r["model"] for r in measured))
    modes = [m for m in MODES if any(r["mode"] == m for r in measured)]
    claims = {"throughput": "paper: +{}% to +{}%".format(
                  *PAPER_CLAIMS["throughput_gain_over_batch_invariant_pct"]),
              "ttft": f"paper: {PAPER_CLAIMS['ttft_change_pct_mean']:+}% mean",
              "tpot": f"paper: {PAPER_CLAIMS['tpot_change_pct_mean']:+}% mean"}
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(1, len(PLOT_METRICS), figsize=(14, 4))
    for ax, (key, label, short) in zip(axes, PLOT_METRICS, strict=True):
        for i, mode in enumerate(modes):
            by_family = {r["model"]: r for r in measured if r["mode"] == mode}
            xs = [f + (i - (len(modes) - 1) / 2) * width for f in range(len(families))]
            # A family this mode did not measure gets no bar (NaN), not a zero-height one.
            values = [by_family.get(f, {}).get(key) or math.nan for f in families]
            ax.bar(xs, values, width, label=mode, color=MODE_COLORS.get(mode, "#666666"))
            if mode != "corun":
                continue
            for x, family, value in zip(xs, families, values, strict=True):
                change = by_family.get(family, {}).get(f"{short}_change_pct_vs_batch_invariant")
                if change is not None:
                    ax.text(x, value, f"{change:+.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(families)), families, fontsize=8)
        against = ("corun vs batch_invariant; " if {"corun", "batch_invariant"} <= set(modes)
                   else "")
        ax.set_title(f"{label}\n{against}{claims[short]}", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(modes), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def earlier_records(path: str | None, rerun: set[str]) -> tuple[list[dict], dict, dict]:
    """(records, truncation, command per family) of an earlier results file, less the models
    run again now."""
    if path is None or not Path(path).exists():
        return [], {}, {}
    head, *records = json.loads(Path(path).read_text())
    kept = [r for r in records if r.get("model") not in rerun]
    trunc = {f: t for f, t in head.get("truncation", {}).items() if f not in rerun}
    commands = {f: c for f, c in head.get("commands", {}).items() if f not in rerun}
    return kept, trunc, commands


def build_parser() -> argparse.ArgumentParser:
    parser = bench_offline.build_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--models", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--dry-run", action="store_true",
                        help="the tiny configs on the CPU (CI smoke)")
    parser.add_argument("--replot", default=None, metavar="PATH",
                        help="only redraw the PNG beside this results file (no run)")
    parser.add_argument("--merge", default=None, metavar="PATH",
                        help="keep the records of the models not run now from this earlier "
                             "results file (one model per device call; ignored if missing)")
    # ~3-4 min per model on the H200 with four modes (an estimate); bench_offline's
    # headline uses 1000 requests on an 8 B model.
    parser.set_defaults(modes=list(MODES), num_requests=200, max_num_seqs=128,
                        audit_requests=32, alone_sample=2, name="paper-h200")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        plot(json.loads(path.read_text())[1:], path.with_suffix(".png"))
        return
    if args.dry_run:  # the dry run's sizes, unless given explicitly on the command line
        parser.set_defaults(**DRY_RUN_ARGS)
        args = parser.parse_args(argv)
    args.input_len = tuple(args.input_len)
    args.corun_overrides = bench_offline.parse_overrides(args.corun_set)
    args.audit_max_num_seqs = args.audit_max_num_seqs or max(1, args.max_num_seqs // 2)
    t0 = time.perf_counter()
    from models import build_model

    runs = [(family, FAMILIES[family][1 if args.dry_run else 0]) for family in args.models]
    extra = {"dtype": args.dtype, "paper_claims": PAPER_CLAIMS,
             "truncation": {f: truncation(f, name) for f, name in runs},
             "workload": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                          "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                          "arrivals": "all at t=0", "corun_overrides": args.corun_overrides},
             "timing": "wall clock of each mode's main run after its warm-up; TTFT from the "
                       "common arrival time (all requests at t=0, so it includes queueing)"}
    # An earlier file's records of a family stay until this run has measured every mode of it:
    # a run its time limit cuts mid-family leaves that family as it was, not half of it. A
    # family the earlier file lacks is written mode by mode (half of it beats none).
    earlier, kept_truncation, kept_commands = earlier_records(args.merge, set())
    new_truncation = extra["truncation"]
    # A merged file holds several device calls: the header's command is this one, and
    # ``commands`` names the call that measured each family.
    this_command = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "experiments.bench_paper",
        *(sys.argv[1:] if argv is None else argv)])
    finished: dict[str, list[dict]] = {}  # family -> this run's records, once all modes ran

    def current(family: str | None = None, partial: list[dict] | None = None
                ) -> tuple[list[dict], dict]:
        records = [r for r in earlier if r.get("model") not in finished]
        records += [r for family_records in finished.values() for r in family_records]
        if partial and not any(r.get("model") == family for r in records):
            records += partial
        header = {**extra,
                  "truncation": {**kept_truncation, **{f: new_truncation[f] for f in finished}},
                  "commands": {**kept_commands, **{f: this_command for f in finished}}}
        return records, header

    path = None
    bar = tqdm(total=len(runs) * len(args.modes), desc="paper", unit="run")
    for family, config_name in runs:
        args.model = config_name
        probe = bench_offline.engine_config(args.modes[0], args)
        build = time.perf_counter()
        model = build_model(config_name, dtype=probe.torch_dtype, device=probe.resolved_device,
                            seed=args.seed)
        build_s = round(time.perf_counter() - build, 1)
        work = make_workload(args.num_requests, args.input_len, args.output_len,
                                           model[1].vocab_size, args.seed)
        family_records: list[dict] = []
        for mode in args.modes:
            bar.set_postfix_str(f"{family} {mode}")
            base = {"model": family, "model_config": config_name,
                    "layers": model[1].num_hidden_layers, "model_build_s": build_s,
                    "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds")}  # merged files mix runs: each record its date
            try:
                record = {**base, **bench_offline.bench_variant(mode, model, args, work)[0]}
            except Exception as exc:  # one mode failing (e.g. out of memory) keeps the others
                record = {**base, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]}
            family_records.append(record)
            print(json.dumps(record), flush=True)
            gc.collect()
            if probe.is_cuda:
                torch.cuda.empty_cache()
            bar.update(1)
            if len(family_records) == len(args.modes):
                finished[family] = family_records
            records, header = current(family, family_records)
            add_paper_ratios(records)
            path = write_results(args.name, records, **header)  # written after every mode
            plot(records, path.with_suffix(".png"))
        del model
        gc.collect()
        if probe.is_cuda:
            torch.cuda.empty_cache()
    bar.close()
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
