"""Offline GEMM tuning on a card -> kernels/tuned/gemm_<card>.json (data the policy reads there).

For every GEMM (N, K) of the real named models (``gemm_shapes``: read off a meta-device build of
each model in ``TUNED_MODELS``, LM heads included) and M in ``M_VALUES`` it times a bounded
candidate set (``experiments.gemm_candidates.candidates``: M-range tiles, with split-K variants
where the tiles alone leave SMs idle; fixed pools so the number of compiled kernels stays small),
keeps the median-fastest config that also matches cuBLAS numerically (the fastest few of one
pass are timed twice more, each time on fresh copies of the operands, and ranked by their
medians: ``FINALISTS``), and records cuBLAS's time beside it (the median of the same three
placements), and the fastest candidate without split-K (``no_split_config``: what the
``batch_invariant_tuned`` policy runs at that point). The portable batch-invariant baseline gets
ONE config: the member of ``BATCH_INVARIANT_POOL`` with the lowest geometric-mean time over the
points of ``POOL_MODEL`` (the whole pool is timed at each of them).

The file is rewritten after every point, so a cut run keeps what it measured; a wall-clock budget
bounds the sweep, points past it are left to the policy's literal fallback and the header says
``complete: false``; ``--resume`` tunes only the points the file lacks (its ``runs`` list each
run's header), and ``--retune-m 64,128,256`` with it tunes those M values again (after the
candidate set grew, e.g. by the TMA-fed tiles), keeping the file's other points; ``--repick``
with it tunes again the points not picked by the finalists' rounds as they run now (on one timing
each, or with the rounds on one placement of the operands: ``picked_over_placements``).

``--models`` and ``--m-values`` narrow what one run tunes (with ``--resume`` the file keeps its
other points; without it they need an ``--out`` outside ``kernels/tuned/``, e.g. a results file).

Each card writes its own table (``kernels.gemm.tuned_path``; ``--out`` defaults to the card's):
the H200's is every card's base, and another card's file holds the points tuned on it, which the
policy overlays on the H200's. ``--merge-from FILE...`` folds tuned entries timed on one card
(results files of narrowed runs) into ``--out`` without timing anything.

    python -m experiments.tune_gemm [--budget-s 300] [--resume [--retune-m M,M] [--repick]]
        [--models deepseek-v3] [--m-values 512,2048] [--out kernels/tuned/gemm_<card>.json]
    python -m experiments.tune_gemm --out kernels/tuned/gemm_h100.json --merge-from FILE...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gemm_candidates import (  # noqa: E402
    BATCH_INVARIANT_POOL,
    DTYPE,
    candidate_set,
    candidates,
)
from experiments.gemm_shapes import (  # noqa: E402
    M_VALUES,
    POOL_MODEL,
    TUNED_MODELS,
    gemm_shapes,
    models_shapes,
)
from experiments.harness import bench_us, header, timed_rounds  # noqa: E402
from kernels.gemm import (  # noqa: E402
    GemmConfig,
    gemm,
    tuned_path,
    with_row_mask,
)
from kernels.gemm_tuned import TUNED_DIR  # noqa: E402
from kernels.utils import device_card  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run sweeps and how it times: the GPU run, or a CPU dry run (``--dry-run``: two
    tiny shapes through the Triton interpreter, wall-clock timing; only the logic is exercised)."""

    shapes: tuple[tuple[str, int, int], ...]
    m_values: tuple[int, ...]
    device: str
    dtype: torch.dtype
    rep_ms: int
    max_candidates: int | None = None  # the dry run times the first few only

    def bench(self, fn: Callable[[], object]) -> float:
        if self.device == "cpu":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        return bench_us(fn, warmup_ms=5, rep_ms=self.rep_ms)


def gpu_setup(rep_ms: int) -> Setup:
    return Setup(tuple(gemm_shapes()), M_VALUES, "cuda", DTYPE, rep_ms)


def dry_run_setup() -> Setup:
    # fp32: the interpreter's bf16 dot is wrong (kernels.utils.upcast_dot_operands)
    return Setup(((f"{POOL_MODEL}.tiny_qkv", 48, 64), ("tiny.o", 32, 48)), (1, 128, 512), "cpu",
                 torch.float32, 1, max_candidates=3)


def _time_config(setup: Setup, x, w, expected, config: GemmConfig) -> float | None:
    """Median us of one config, or None if it fails to compile/run or disagrees with cuBLAS."""
    try:
        out = gemm(x, w, config=config)
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as err:  # out of shared memory / registers: not a candidate here
        print(f"    skip {config}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        return None
    err = (out.float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
    if not math.isfinite(err) or err > 2e-2:
        print(f"    reject {config}: rel err {err:.3g} vs cuBLAS", file=sys.stderr)
        return None
    return setup.bench(lambda: gemm(x, w, config=config))


# A re-tune keeps the previous portable config unless another pool member's geometric mean is
# this much faster: on the H200 the top two were 0.06% apart over the 45 pool points, so timing
# noise alone flipped the peer's one config (and with it every batch_invariant figure) when only
# the M 64-256 points were re-tuned.
POOL_KEEP_MARGIN = 0.01


def _pool_choice(entries: list[dict], previous: GemmConfig | None = None) -> GemmConfig | None:
    """The portable batch-invariant config: the pool member with the lowest geometric-mean time
    over the points where the whole pool was timed (``pool_us``, in BATCH_INVARIANT_POOL order);
    ``previous`` (the table's earlier choice) stays unless beaten by ``POOL_KEEP_MARGIN``."""
    size = len(BATCH_INVARIANT_POOL)
    timed = [e["pool_us"] for e in entries if len(e.get("pool_us") or ()) == size]
    if not timed:
        return None
    log_means = [sum(math.log(t[i]) for t in timed) / len(timed) for i in range(size)]
    best = log_means.index(min(log_means))
    if previous in BATCH_INVARIANT_POOL:
        kept = BATCH_INVARIANT_POOL.index(previous)
        if log_means[kept] - log_means[best] <= math.log1p(POOL_KEEP_MARGIN):
            return previous
    return BATCH_INVARIANT_POOL[best]


# The sweep times each candidate once, and one capture's time can be far off the config's: on
# the H100, the seventeenth session's sweep timed DeepSeek-V3's q_a at M 256 with a split-4 tail
# tile at 14.3 us (0.98 of cuBLAS) and picked it; probe_gemm_tail and bench_gemm then timed the
# same config at 17.7 and 17.9 us, cuBLAS at 14.2 and 14.1 (probe-gemm-tail-h100.json,
# kernels-h100-gemm-run14.json). The fastest few (and the fastest few that keep K whole,
# batch_invariant_tuned's pool) are timed FINALIST_REPEATS more times, interleaved, and each
# finalist's median is its time: a pick is fast in at least two of its three timings.
FINALISTS = 4
FINALISTS_NO_SPLIT = 2
FINALIST_REPEATS = 2


def _retime_finalists(setup: Setup, x, w, expected, m: int, timed: dict[GemmConfig, float],
                      cublas_us: float) -> tuple[dict[GemmConfig, list[float]], list[float]]:
    """The finalists of ``timed`` (the first pass) and their times: the first pass's and
    FINALIST_REPEATS more rounds'; and cuBLAS's time in each round. The pick is the finalist of
    least median, never a candidate timed once. A finalist that fails a later round is dropped.

    Each later round runs on fresh copies of x and w, allocated while the earlier rounds' are
    alive, so the three timings see three placements: over six placements DeepSeek-V3's shared
    down at M 128 took 8.88-11.49 us with one config, cuBLAS 8.00-8.18
    (probe-capture-spread-h100.json), and the same operands recaptured moved 1.02x at most."""
    ranked = sorted(timed, key=timed.get)
    whole = [c for c in ranked if c.keeps_k_whole]
    finalists = list(dict.fromkeys(ranked[:FINALISTS] + whole[:FINALISTS_NO_SPLIT]))
    placements, cublas_rounds = [(x, w)], [cublas_us]

    def next_round() -> Callable[[GemmConfig], float | None]:
        x_copy, w_copy = x.clone(), w.clone()
        placements.append((x_copy, w_copy))
        cublas_rounds.append(setup.bench(lambda: torch.nn.functional.linear(x_copy, w_copy)))
        return lambda config: _time_config(setup, x_copy, w_copy, expected,
                                           with_row_mask(config, m))

    return timed_rounds(timed, finalists, FINALIST_REPEATS, next_round), cublas_rounds


def _tune_point(setup: Setup, label: str, m: int, n: int, k: int, w: torch.Tensor) -> dict | None:
    """One (shape, M): every candidate timed; the entry the table records, or None."""
    x = torch.randn(m, k, device=setup.device, dtype=setup.dtype)
    expected = torch.nn.functional.linear(x, w).float()
    cublas_us = setup.bench(lambda: torch.nn.functional.linear(x, w))
    with_pool = label.startswith(POOL_MODEL + ".")
    configs = candidates(m, n, k, with_pool=with_pool)
    if setup.max_candidates is not None:
        configs = configs[: setup.max_candidates] + list(BATCH_INVARIANT_POOL if with_pool else ())
        configs = list(dict.fromkeys(configs))
    # Each candidate timed as the M-dependent policies run it (rows past M masked where M leaves
    # the row tile part empty); the batch_invariant pool as that mode runs it, never masked.
    timed = {c: _time_config(setup, x, w, expected, with_row_mask(c, m)) for c in configs}
    pool_timed = {c: timed.get(c) if not with_row_mask(c, m).mask_rows
                  else _time_config(setup, x, w, expected, c)
                  for c in BATCH_INVARIANT_POOL if with_pool and c in timed}
    timed = {c: t for c, t in timed.items() if t is not None}
    if not timed:
        print(f"  {label} M={m}: no candidate ran", file=sys.stderr)
        return None
    first_pass = timed
    samples, cublas_rounds = _retime_finalists(setup, x, w, expected, m, first_pass, cublas_us)
    cublas_us = statistics.median(cublas_rounds)
    if not samples:
        print(f"  {label} M={m}: no finalist ran in every round", file=sys.stderr)
        return None
    timed = {c: statistics.median(t) for c, t in samples.items()}
    # batch_invariant_tuned's entry: the fastest candidate that keeps K whole in one program
    # (stream-K cuts it too, where the programs' shares end).
    no_split = {c: t for c, t in timed.items() if c.keeps_k_whole}
    best = min(timed, key=timed.get)
    best_no_split = min(no_split, key=no_split.get) if no_split else None
    entry = {"m": m, "n": n, "k": k, "layer": label,
             "dtype": str(setup.dtype).removeprefix("torch."),
             "config": best.to_dict(), "us": round(timed[best], 3),
             **({"no_split_config": best_no_split.to_dict(),
                 "no_split_us": round(no_split[best_no_split], 3)} if best_no_split else {}),
             # The fastest stream-K candidate, picked or not: how close it came.
             **({"stream_k_us": round(min(t for c, t in first_pass.items()
                                          if c.stream_k_programs), 3)}
                if any(c.stream_k_programs for c in first_pass) else {}),
             # the pick's every timing (first pass, then the rounds): how steady it was
             "us_rounds": [round(t, 3) for t in samples[best]],
             "cublas_us": round(cublas_us, 3),
             "cublas_us_rounds": [round(t, 3) for t in cublas_rounds],
             "ratio_vs_cublas": round(cublas_us / timed[best], 4),
             "candidates": len(first_pass), "candidate_set": candidate_set(m, n)}
    if with_pool and all(pool_timed.get(c) is not None for c in BATCH_INVARIANT_POOL):
        entry["pool_us"] = [round(pool_timed[c], 3) for c in BATCH_INVARIANT_POOL]
    print(f"  {label:28s} M={m:5d} best {timed[best]:9.2f} us  cuBLAS {cublas_us:9.2f} us"
          f"  ratio {cublas_us / timed[best]:.3f}  {best}", flush=True)
    return entry


def tune(setup: Setup, budget_s: float, done: list[dict],
         on_progress: Callable[[list[dict], bool], object],
         stale: frozenset[tuple[int, int, int]] = frozenset()) -> tuple[list[dict], bool]:
    """Sweep every (shape, M) not in ``done`` (entries of an earlier, cut run) or in ``stale``
    ((m, n, k) points of ``done`` to tune again: each keeps its old entry until the new one
    replaces it, so a cut run leaves a whole table); ``on_progress`` gets the entries so far
    after each point. The budget is checked before each point once this run has tuned one.
    Returns (entries, completed)."""
    start = time.monotonic()
    entries = list(done)
    have = {(e["m"], e["n"], e["k"]) for e in done} - stale
    slot = {(e["m"], e["n"], e["k"]): i for i, e in enumerate(entries)}
    tuned = 0
    torch.manual_seed(0)
    for label, n, k in tqdm(setup.shapes, desc="tune_gemm shapes"):
        todo = [m for m in setup.m_values if (m, n, k) not in have]
        if not todo:
            continue
        w = torch.randn(n, k, device=setup.device, dtype=setup.dtype) / math.sqrt(k)
        for m in todo:
            if tuned and time.monotonic() - start > budget_s:
                return entries, False
            entry = _tune_point(setup, label, m, n, k, w)
            tuned += 1
            if entry is not None:
                if (m, n, k) in slot:
                    entries[slot[(m, n, k)]] = entry
                else:
                    entries.append(entry)
                on_progress(entries, False)
    return entries, True


def picked_over_placements(entry: dict) -> bool:
    """Whether an entry's pick came from the finalists' rounds on three placements of the
    operands. Entries before the finalists have no ``us_rounds``; the first finalists' entries
    (the nineteenth session's H100 re-pick) have rounds on one placement and no
    ``cublas_us_rounds``."""
    return "us_rounds" in entry and "cublas_us_rounds" in entry


def _needs_retune(entry: dict, retune: set[int]) -> bool:
    """An entry at an M to re-tune that another candidate set produced."""
    return entry["m"] in retune and entry.get("candidate_set") != candidate_set(entry["m"],
                                                                               entry.get("n"))


_TIMING_KEYS = ("machine", "host", "torch", "triton", "cuda", "python",
                "copy_bandwidth_bytes_per_s", "copy_bandwidth_card")


def merge_tables(out: Path, sources: list[Path]) -> int:
    """``--merge-from``: ``out``'s entries (if it exists) and each source's, a later file's entry
    replacing an earlier one at the same (M, N, K); every file timed on one machine. Its header
    lists every file's runs. The portable batch-invariant config stays ``out``'s (none if new):
    it is picked over the pool model's points at every M, which narrowed runs do not time."""
    tables = ([out] if out.exists() else []) + list(sources)
    loaded = [json.loads(path.read_text()) for path in tables]
    machines = {data["header"]["machine"] for data in loaded}
    if len(machines) != 1:
        raise ValueError(f"--merge-from: expected files timed on one machine, got "
                         f"{sorted(machines)}")
    entries: dict[tuple[int, int, int], dict] = {}
    for data in loaded:
        entries.update({(e["m"], e["n"], e["k"]): e for e in data["entries"] if "candidates" in e})
    merged = sorted(entries.values(), key=lambda e: (e["layer"], e["m"]))
    expected = len(gemm_shapes()) * len(M_VALUES)
    # each run once: a source merged again into its table brings runs the table already lists
    runs = list({json.dumps(run, sort_keys=True): run
                 for data in loaded for run in data["header"].get("runs", [])}.values())
    first = loaded[0]["header"]
    head = header(complete=False, points=len(merged), expected_points=expected,
                  m_values=list(M_VALUES), models=list(TUNED_MODELS), runs=runs,
                  retune_pending_m=[], merged_from=[str(path) for path in sources],
                  note="merged by --merge-from: the machine and versions above are the timing "
                       "runs' (each run's own in runs), the date and command the merge's")
    # the card and versions that timed the entries, not this merge's machine
    head.update({key: first[key] for key in _TIMING_KEYS if key in first})
    record = {"header": head,
              "batch_invariant": loaded[0]["batch_invariant"] if out.exists() else None,
              "entries": merged}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(merged)} entries of {expected} to {out} from {len(tables)} files")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=300.0, help="sweep wall-clock budget")
    parser.add_argument("--rep-ms", type=int, default=8, help="do_bench_cudagraph rep per config")
    parser.add_argument("--out", type=Path, default=None,
                        help="the table to write (default: this card's, kernels/tuned/)")
    parser.add_argument("--resume", action="store_true",
                        help="keep --out's entries and tune only the points it lacks")
    parser.add_argument("--retune-m", default="", metavar="M,M",
                        help="with --resume: tune these M values again (new candidates), every "
                             "shape, keeping the file's other points")
    parser.add_argument("--repick", action="store_true",
                        help="with --resume: tune again this run's points (--models / "
                             "--m-values narrow them) not picked over three placements (timed "
                             "once, or re-timed on one placement); a cut run goes on where it "
                             "stopped")
    parser.add_argument("--models", default="", metavar="NAME,NAME",
                        help=f"tune only these models' shapes (of {', '.join(TUNED_MODELS)})")
    parser.add_argument("--m-values", default="", metavar="M,M",
                        help=f"tune only these M (of {', '.join(map(str, M_VALUES))})")
    parser.add_argument("--dry-run", action="store_true",
                        help="two tiny shapes on the CPU interpreter (the logic only)")
    parser.add_argument("--merge-from", type=Path, nargs="+", default=None, metavar="FILE",
                        help="fold these files' entries (timed on one card) into --out; no "
                             "timing")
    args = parser.parse_args(argv)
    if args.merge_from:
        if args.out is None:
            parser.error("--merge-from needs --out (the table the entries go into)")
        return merge_tables(args.out, args.merge_from)
    if args.out is None:
        if args.dry_run or not torch.cuda.is_available():
            parser.error("--out: expected a path (without a GPU there is no card to name the "
                         "table after)")
        args.out = tuned_path(device_card(torch.device("cuda")))
    if (args.retune_m or args.repick) and not args.resume:
        parser.error("--retune-m / --repick need --resume (they re-tune points of the existing "
                     "file)")
    models = [v for v in args.models.split(",") if v]
    m_values = [int(v) for v in args.m_values.split(",") if v.strip()]
    if set(models) - set(TUNED_MODELS) or set(m_values) - set(M_VALUES):
        parser.error(f"--models / --m-values: expected some of {list(TUNED_MODELS)} / "
                     f"{list(M_VALUES)}, got {models} / {m_values}")
    if (models or m_values) and not args.resume and args.out.resolve().parent == TUNED_DIR:
        parser.error("--models / --m-values without --resume need an --out outside "
                     "kernels/tuned/ (the table's other points would be dropped)")
    if args.dry_run:
        setup = dry_run_setup()
    elif not torch.cuda.is_available():
        print("tune_gemm: needs a CUDA device (a table is its card's timings); nothing written.",
              file=sys.stderr)
        return 1
    else:
        setup = gpu_setup(args.rep_ms)
        print(f"tune_gemm: tuning on {torch.cuda.get_device_name()} into {args.out}",
              file=sys.stderr)
    full = setup  # the whole table's points, which its header counts
    if models:
        setup = dataclasses.replace(setup, shapes=models_shapes(setup.shapes, models,
                                                                by_label=args.dry_run))
    if m_values:
        setup = dataclasses.replace(setup, m_values=tuple(m for m in setup.m_values
                                                          if m in m_values))
    if not setup.shapes or not setup.m_values:
        parser.error(f"--models / --m-values: no point of {models or 'all'} at "
                     f"{m_values or 'all'} M to tune")
    done: list[dict] = []
    stale: frozenset[tuple[int, int, int]] = frozenset()
    retune = {int(v) for v in args.retune_m.split(",") if v.strip()}
    runs: list[dict] = []
    previous_choice: GemmConfig | None = None
    if args.resume and args.out.exists():
        previous = json.loads(args.out.read_text())
        # A cut --retune-m run left these M to finish: a plain --resume goes on with them.
        retune |= set(previous["header"].get("retune_pending_m", []))
        # Entries of this sweep's candidate sets only (they record their candidate count).
        done = [e for e in previous["entries"] if "candidates" in e]
        stale = frozenset((e["m"], e["n"], e["k"]) for e in done if _needs_retune(e, retune))
        if args.repick:
            covered = {(m, n, k) for _, n, k in setup.shapes for m in setup.m_values}
            stale |= {(e["m"], e["n"], e["k"]) for e in done
                      if not picked_over_placements(e)} & covered
        runs = previous["header"].get("runs", [])
        if previous.get("batch_invariant"):
            previous_choice = GemmConfig.from_dict(previous["batch_invariant"])
    t0 = time.monotonic()
    this_run = header(wall_s=0.0)

    def write(entries: list[dict], complete: bool) -> GemmConfig | None:
        """Rewrite the table; returns its portable batch-invariant choice."""
        this_run["wall_s"] = round(time.monotonic() - t0, 1)
        bi_choice = _pool_choice(entries, previous_choice)
        pending = sorted({e["m"] for e in entries if _needs_retune(e, retune)})
        expected = len(full.shapes) * len(full.m_values)
        record = {
            "header": header(complete=complete and not pending and len(entries) >= expected,
                             retune_pending_m=pending,
                             tuned_dtype=str(setup.dtype).removeprefix("torch."),
                             m_values=list(full.m_values), models=list(TUNED_MODELS),
                             tuned_this_run={"models": models or "all",
                                             "m_values": m_values or "all"},
                             points=len(entries), expected_points=expected,
                             runs=[*runs, this_run], pool_model=POOL_MODEL, rep_ms=setup.rep_ms,
                             dry_run=args.dry_run),
            "batch_invariant": bi_choice.to_dict() if bi_choice else None,
            "entries": entries,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        return bi_choice

    entries, complete = tune(setup, args.budget_s, done, write, stale)
    choice = write(entries, complete)
    print(f"wrote {len(entries)} entries to {args.out} (complete={complete}, "
          f"batch_invariant={choice}) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
