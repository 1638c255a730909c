"""Offline MLA tuning on the H200 -> kernels/tuned/mla_h200.json (data the policies read).

At the shapes of experiments/bench_mla.py, which are those of the one MLA family among the named
configs (DeepSeek-V3 and its layer-count variants: 128 heads, latent 512, rope 64, qk 192, v 128;
bf16; batch {1, 8, 32, 64, 128} x context {1024, 4096, 16384}; prefill 512 .. 4096 tokens), it
times a small candidate set of decode tiles and of prefill tiles, keeps only candidates whose
output is close to the literal tile's output (a compile error, out of shared memory or a wrong
result rejects the candidate at that shape), and picks:

- ``decode_fixed`` (corun / batch_invariant; split 256, the engine's 512, 1024 and 16384, the
  benchmark's corun policies): per context, ONE tile for every batch size, the lowest
  geometric-mean time over the tuned batches (the policy never reads B); the split count stays
  ceil(len / split_size).
- ``decode_default``: the fastest tile per (batch, context); splits from the default heuristic.
  Picked at one point, with no geometric mean to damp a lucky timing, so its ``DEFAULT_FINALISTS``
  fastest tiles are timed ``FINALIST_REPEATS`` more times, interleaved, and ranked by median
  (the entry keeps the pick's rounds, ``us_rounds``).
- ``prefill``: one tile for every length and mode, the lowest geometric mean over the lengths.

Decode candidates (``python -m experiments.ptxas_report mla-decode`` compiles each for sm_90a
offline and writes ``experiments/results/ptxas-mla-decode-sm90.json``): BLOCK_H 64 on 8 warps
(two warp groups) in 16- or 32-token steps at 2 or 3 stages with the whole [64, 512] fp32
accumulator in one program, the shipped literal tile first (32-token steps at 3 stages: the
table's pick at every point it tuned on the H200, 2026-12-04), although with Triton 3.6 all four
spill (24-320 bytes a thread); 64-token steps at 2 stages (3 need more than the 227 KB of shared
memory a block may have); and the 16- and 32-token steps with the latent output columns split
over 2 programs (8 warps) or 4 (4 warps), which shrinks the accumulator and spills nothing
(205-232 registers). BLOCK_H 32 has no wgmma tile and spills kilobytes. Prefill 128 x 64 /
128 x 32 on 8 warps or 64 x 64 on 4 (128 x 128 needs more shared memory than an SM has at 3
stages), and 64 x 64 at 2 stages or 64 x 32 at 3 on 4 warps, small enough for two programs an
SM; each also TMA-fed (``MLATile.tma``). The prefill entry keeps every candidate's times and
the peer's (causal SDPA, v padded, as experiments/bench_mla.py times it) beside the pick;
``--no-decode --out FILE`` runs the prefill sweep alone (on any card, into a results file).
Fixed and default decode share one compiled kernel (the split rule is a run-time argument), so the
sweep compiles each candidate once. A wall-clock budget bounds it (checked before each shape):
shapes past it are left to the literal policies and the header says ``complete: false``. The set is
sized so that 260 s covered every shape (the H200 took 148 s on 2026-12-04, with three decode
tiles fewer than now: the two reload_values tiles are newer; the header's ``complete`` says
whether a run did).

    python -m experiments.tune_mla [--budget-s 260] [--out kernels/tuned/mla_h200.json]
    python -m experiments.tune_mla --no-decode --out experiments/results/tune-mla-prefill-h100.json
    TRITON_INTERPRET=1 python -m experiments.tune_mla --dry-run --out /tmp/mla_tuned.json
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

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import bench_mla, harness  # noqa: E402
from kernels.mla import (  # noqa: E402
    TUNED_PATH,
    MLATile,
    literal_decode_tile,
    mla_decode,
    mla_prefill_attention,
    mla_prefill_config,
)
from kernels.mode import Mode  # noqa: E402

DTYPE = torch.bfloat16
# The benchmark's corun policies: 256, the engine's default split (512: what an engine's decode
# step runs, so its tile comes from this table), 1024 and 16384.
FIXED_SPLITS = tuple(dict.fromkeys(
    split for _, mode, split in bench_mla.DECODE_POLICIES if mode is Mode.CORUN))
# The current literal decode tile first: the reference output and the never-worse fallback.
LITERAL_DECODE = literal_decode_tile(128, DTYPE)  # DeepSeek-V3's 128 heads
DECODE_CANDIDATES = (
    LITERAL_DECODE,
    MLATile(64, 32, num_warps=8, num_stages=2),
    # 64-token steps: half the online-softmax rescales a token; 2 stages just fit shared memory
    # (229376 of 232448 bytes a block, compiled offline) and spill, as the literal does.
    MLATile(64, 64, num_warps=8, num_stages=2),
    MLATile(64, 16, num_warps=8, num_stages=2),
    MLATile(64, 16, num_warps=8, num_stages=3),
    MLATile(64, 32, num_warps=8, num_stages=2, dv_parts=2),
    MLATile(64, 32, num_warps=8, num_stages=3, dv_parts=2),
    MLATile(64, 16, num_warps=8, num_stages=2, dv_parts=2),
    MLATile(64, 16, num_warps=8, num_stages=3, dv_parts=2),
    MLATile(64, 32, num_warps=4, num_stages=2, dv_parts=4),
    MLATile(64, 16, num_warps=4, num_stages=3, dv_parts=4),
    # P.V's latent rows loaded again a step late instead of carried in registers and written
    # back to shared memory every step (the same bits): offline, the literal tile's spills drop
    # from 160 to 48 bytes and the 16-token tiles' to none. The split's block ids preloaded
    # (MLATile.preload_pages) took 1.27-1.39x as long on an H100 (2026-12-06) and is not a
    # candidate.
    dataclasses.replace(LITERAL_DECODE, reload_values=True),
    MLATile(64, 16, num_warps=8, num_stages=3, reload_values=True),
)
LITERAL_PREFILL = MLATile(128, 64, num_warps=8, num_stages=3)
_PREFILL_TILES = (
    LITERAL_PREFILL,
    MLATile(128, 64, num_warps=8, num_stages=2),
    MLATile(128, 32, num_warps=8, num_stages=3),
    MLATile(64, 64, num_warps=4, num_stages=3),
    # One warp group a program in little enough shared memory and registers for two programs an
    # SM (offline: 106 KB and 254 registers, 86 KB and 226): one program's softmax can run under
    # the other's products, as FlashAttention-3's two ping-pong warp groups do.
    MLATile(64, 64, num_warps=4, num_stages=2),
    MLATile(64, 32, num_warps=4, num_stages=3),
)
# Each also with its key and value tiles through TMA descriptors (the same bits).
PREFILL_CANDIDATES = _PREFILL_TILES + tuple(
    dataclasses.replace(tile, tma=True) for tile in _PREFILL_TILES)
MAX_REL_ERR = 2e-2  # bf16 output rounding is ~4e-3; a wrong tile is off by O(1)


@dataclasses.dataclass
class Sweep:
    """What one run measures: shapes, candidates, and how to time (CPU dry run vs H200)."""

    dims: dict
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    decode_candidates: tuple[MLATile, ...]
    prefill_candidates: tuple[MLATile, ...]
    fixed_splits: tuple[int, ...]
    bench: Callable[[Callable[[], object]], float]


def _wall_us(fn: Callable[[], object]) -> float:
    """Dry-run timer (CPU interpreter): median of three calls; only the logic is exercised."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_candidate(run, expected: torch.Tensor, label: str, bench) -> float | None:
    """Median us of ``run``, or None if it fails to compile/run or disagrees with ``expected``."""
    try:
        out = run()
        _sync()
    except Exception as err:  # out of shared memory / registers: not a candidate here
        print(f"    skip {label}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        return None
    scale = max(expected.float().abs().max().item(), 1e-6)
    err = (out.float() - expected.float()).abs().max().item() / scale
    if not math.isfinite(err) or err > MAX_REL_ERR:
        print(f"    reject {label}: rel err {err:.3g} vs the literal tile", file=sys.stderr)
        return None
    return bench(run)


def _geomean_best(times: dict[MLATile, list[float]], points: int) -> MLATile | None:
    """The tile with the lowest geometric mean among those measured at every one of ``points``."""
    full = {t: v for t, v in times.items() if len(v) == points and points > 0}
    if not full:
        return None
    return min(full, key=lambda t: sum(math.log(x) for x in full[t]))


# decode_default's finalists: a pick is fast in at least two of its three timings, not once
DEFAULT_FINALISTS = 3
FINALIST_REPEATS = 2


def _retime_finalists(timed: dict[MLATile, float],
                      time_tile: Callable[[MLATile], float | None]) -> dict[MLATile, list[float]]:
    """The ``DEFAULT_FINALISTS`` fastest of ``timed`` (one pass) with FINALIST_REPEATS more
    rounds each, interleaved; a finalist that fails a later round is dropped."""
    finalists = sorted(timed, key=timed.get)[:DEFAULT_FINALISTS]
    return harness.timed_rounds(timed, finalists, FINALIST_REPEATS, lambda: time_tile)


def _decode_point(sweep: Sweep, batch: int, ctx: int
                  ) -> tuple[dict[int, dict[MLATile, float]], dict[MLATile, float],
                             dict[MLATile, list[float]]]:
    """Every candidate timed at one (batch, ctx): decode_fixed's times per split ({split: {tile:
    us}}), decode_default's first pass ({tile: us}) and its finalists' rounds ({tile: [us]})."""
    dims = sweep.dims
    x = bench_mla.decode_inputs(dims, [ctx] * batch, ctx, seed=batch * 100003 + ctx)
    policies = [("decode_fixed", Mode.CORUN, s) for s in sweep.fixed_splits]
    policies.append(("decode_default", Mode.DEFAULT, sweep.fixed_splits[0]))
    fixed: dict[int, dict[MLATile, float]] = {}
    default: dict[MLATile, float] = {}
    rounds: dict[MLATile, list[float]] = {}
    for kind, mode, split in policies:

        def run(tile: MLATile, mode=mode, split=split):
            return mla_decode(**x, scale=dims["scale"], max_seq_len=ctx, mode=mode,
                              split_size=split, tile=tile)  # fmt: skip

        expected = run(LITERAL_DECODE)

        def time_tile(tile: MLATile, kind=kind, run=run, expected=expected) -> float | None:
            return _time_candidate(lambda: run(tile), expected, f"{kind} {tile}", sweep.bench)

        timed = {}
        for tile in sweep.decode_candidates:
            us = time_tile(tile)
            if us is not None:
                timed[tile] = us
        if kind == "decode_fixed":
            fixed[split] = timed
            best = min(timed, key=timed.get) if timed else None
        else:
            default = timed
            rounds = _retime_finalists(timed, time_tile) if timed else {}
            best = _median_best(rounds)
        base = timed.get(LITERAL_DECODE)
        if best is not None:
            best_us = statistics.median(rounds[best]) if kind == "decode_default" else timed[best]
            print(f"  {kind:14s} split {split:5d} B={batch:4d} ctx={ctx:6d} best "
                  f"{best_us:9.1f} us  literal {base or float('nan'):9.1f} us  {best}",
                  flush=True)  # fmt: skip
    return fixed, default, rounds


def _median_best(rounds: dict[MLATile, list[float]]) -> MLATile | None:
    return min(rounds, key=lambda tile: statistics.median(rounds[tile]), default=None)


def tune_decode(sweep: Sweep, deadline: float) -> tuple[list[dict], bool]:
    """Entries for decode_fixed (per split, ctx) and decode_default (per batch, ctx)."""
    dims = sweep.dims
    base = {"heads": dims["heads"], "latent": dims["latent"], "rope": dims["rope"]}
    entries: list[dict] = []
    complete = True
    for ctx in sweep.contexts:
        fixed: dict[int, dict[MLATile, list[float]]] = {s: {} for s in sweep.fixed_splits}
        done = 0
        for batch in sweep.batches:
            if time.monotonic() > deadline:
                complete = False
                break
            point_fixed, default, rounds = _decode_point(sweep, batch, ctx)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the point's multi-GB cache is garbage now
            done += 1
            for split, timed in point_fixed.items():
                for tile, us in timed.items():
                    fixed[split].setdefault(tile, []).append(us)
            best = _median_best(rounds)
            if best is not None:
                entries.append({**base, "kind": "decode_default", "batch": batch, "ctx": ctx,
                                "config": best.to_dict(),
                                "us": round(statistics.median(rounds[best]), 3),
                                "us_rounds": _rounds(rounds[best]),
                                "literal_us": _round(default.get(LITERAL_DECODE))})  # fmt: skip
        for split, times in fixed.items():
            best = _geomean_best(times, done)
            if best is None:
                continue
            entries.append({**base, "kind": "decode_fixed", "split_size": split, "ctx": ctx,
                            "batches": list(sweep.batches[:done]), "config": best.to_dict(),
                            "us": _rounds(times[best]),
                            "literal_us": _rounds(times.get(LITERAL_DECODE, []))})  # fmt: skip
            print(f"  decode_fixed split {split} ctx {ctx}: {best} over B={sweep.batches[:done]}")
        if not complete:
            break
    return entries, complete


def tune_prefill(sweep: Sweep, deadline: float) -> tuple[list[dict], bool]:
    """One prefill tile (every length, every mode): the lowest geometric mean over the lengths."""
    dims = sweep.dims
    times: dict[MLATile, list[float]] = {}
    peer_us: list[float] = []
    done, complete = 0, True
    for length in sweep.prefill_lens:
        if time.monotonic() > deadline:
            complete = False
            break
        x = bench_mla.prefill_inputs(dims, length, seed=length)
        cu = bench_mla._cu([length])

        def run(tile: MLATile, x=x, cu=cu, length=length):
            cfg = mla_prefill_config(dims["qk_dim"], dims["v_dim"], DTYPE, Mode.CORUN,
                                     tile=tile)  # fmt: skip
            return mla_prefill_attention(x["q"], x["k"], x["v"], cu, cu, dims["scale"],
                                         max_q_len=length, config=cfg)  # fmt: skip

        expected = run(LITERAL_PREFILL)
        peer_us.append(sweep.bench(bench_mla.sdpa_prefill(x, dims)))
        for tile in sweep.prefill_candidates:
            us = _time_candidate(lambda t=tile: run(t), expected, f"prefill {tile}", sweep.bench)
            if us is not None:
                times.setdefault(tile, []).append(us)
        done += 1
        best = min((t for t in times if len(times[t]) == done), key=lambda t: times[t][-1],
                   default=None)  # fmt: skip
        if best is not None:
            literal_us = _round(times.get(LITERAL_PREFILL, [None])[-1])
            print(f"  prefill len {length:5d} best {times[best][-1]:9.1f} us  literal "
                  f"{literal_us} us  sdpa {peer_us[-1]:.1f} us  {best}", flush=True)  # fmt: skip
    best = _geomean_best(times, done)
    if best is None:
        return [], complete
    entry = {"kind": "prefill", "qk_dim": dims["qk_dim"], "v_dim": dims["v_dim"],
             "lengths": list(sweep.prefill_lens[:done]), "config": best.to_dict(),
             "us": _rounds(times[best]),
             "literal_us": _rounds(times.get(LITERAL_PREFILL, [])),
             # the peer (bench_mla's causal SDPA, v padded) and every tile that ran at every
             # length, timed the same way in the same run: how far the pick is from the others
             "sdpa_us": _rounds(peer_us[:done]),
             "candidates": [{"config": tile.to_dict(), "us": _rounds(us)}
                            for tile, us in times.items() if len(us) == done]}  # fmt: skip
    print(f"  prefill: {best} over lengths {sweep.prefill_lens[:done]}")
    return [entry], complete


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _rounds(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


def h200_sweep(rep_ms: int) -> Sweep:
    return Sweep(
        dims=bench_mla.v3_dims(), batches=bench_mla.BATCHES, contexts=bench_mla.CONTEXTS,
        prefill_lens=bench_mla.PREFILL_LENS, decode_candidates=DECODE_CANDIDATES,
        prefill_candidates=PREFILL_CANDIDATES, fixed_splits=FIXED_SPLITS,
        bench=lambda fn: harness.bench_us(fn, warmup_ms=3, rep_ms=rep_ms),
    )  # fmt: skip


def dry_run_sweep() -> Sweep:
    """Tiny shapes on the CPU interpreter: exercises every branch of the logic in seconds."""
    bench_mla.DEVICE = "cpu"
    dims = {"heads": 20, "latent": 32, "rope": 16, "qk_dim": 24, "v_dim": 16, "scale": 0.2}
    return Sweep(
        dims=dims, batches=(1, 2), contexts=(40, 64), prefill_lens=(20, 70),
        decode_candidates=(LITERAL_DECODE, MLATile(32, 16, num_warps=4, num_stages=1),
                           MLATile(16, 16, num_warps=4, num_stages=2, dv_parts=2)),
        prefill_candidates=(LITERAL_PREFILL, MLATile(64, 32, num_warps=4, num_stages=1),
                            MLATile(64, 32, num_warps=4, num_stages=1, tma=True)),
        fixed_splits=(32, 64, 1024), bench=_wall_us,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=260.0, help="sweep wall-clock budget")
    parser.add_argument("--rep-ms", type=int, default=10, help="timing rep per candidate")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output (default {TUNED_PATH}; required with --dry-run)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU interpreter (logic check only)")  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="decode only")
    parser.add_argument("--no-decode", action="store_true",
                        help="prefill only (needs --out: the table's decode entries would be lost)")
    args = parser.parse_args(argv)
    if args.no_decode and (args.no_prefill or args.out is None
                           or args.out.resolve() == TUNED_PATH.resolve()):
        parser.error("--no-decode needs an --out other than the checked-in table (its decode "
                     "entries would be lost) and no --no-prefill")
    if args.dry_run:
        if args.out is None:
            parser.error("--dry-run needs --out (never overwrite the checked-in table)")
        sweep = dry_run_sweep()
    else:
        if not torch.cuda.is_available():
            print("tune_mla: needs a CUDA device (the table is H200 timing data); nothing written.",
                  file=sys.stderr)  # fmt: skip
            return 1
        if "H200" not in torch.cuda.get_device_name():
            print(f"tune_mla: warning: tuning on {torch.cuda.get_device_name()}, not an H200",
                  file=sys.stderr)  # fmt: skip
        sweep = h200_sweep(args.rep_ms)
    out = args.out or TUNED_PATH
    t0 = time.monotonic()
    # Decode gets most of the budget (it is the 0.07-of-bound kernel); prefill the rest.
    decode_deadline = t0 + args.budget_s * (1.0 if args.no_prefill else 0.75)
    entries, complete = ([], True) if args.no_decode else tune_decode(sweep, decode_deadline)
    if not args.no_prefill:
        prefill, prefill_complete = tune_prefill(sweep, t0 + args.budget_s)
        entries += prefill
        complete = complete and prefill_complete
    record = {
        "header": harness.header(
            complete=complete,
            tuned_dtype="bfloat16",
            dry_run=args.dry_run,
            batches=list(sweep.batches),
            contexts=list(sweep.contexts),
            decode_candidates=[t.to_dict() for t in sweep.decode_candidates],
            prefill_candidates=[t.to_dict() for t in sweep.prefill_candidates],
            wall_s=round(time.monotonic() - t0, 1),
        ),  # fmt: skip
        "entries": entries,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(entries)} entries to {out} (complete={complete}) in "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
