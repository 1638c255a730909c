"""Whether a GEMM config's time depends on the graph capture or the operands' addresses.

Between two H100 runs of the GEMM family, DeepSeek-V3's shared down at M 128 went from 8.90 to
11.07 us with its config unchanged while cuBLAS moved 3% (kernels-h100-gemm-run13.json against
kernels-h100-gemm-run14.json), and q_a at M 256 was 14.29 us in the tuner and 17.65 in the
benchmark. ``bench_us`` captures one graph per point, so a time that depends on the capture, or
on where the allocator put the operands, rides into every row. This times each point's pick and
cuBLAS over ``ROUNDS`` captures, interleaved, in two conditions: the same operands each round
(only the capture changes) and fresh operands each round (the addresses change too), and keeps
every capture's time beside the operands' addresses, so the spread of ours can be read against
cuBLAS's under the same card state.

``--survey`` asks whether the placement effect is widespread: every GEMM of the kernels table
(``gemm_shapes(BENCH_MODELS)``) at M 128 and 256, fresh operands only.

    python -m experiments.probe_capture_spread  # -> results/probe-capture-spread-<card>.json
    python -m experiments.probe_capture_spread --survey  # -> ...-capture-spread-survey-<card>.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gemm_candidates import DTYPE  # noqa: E402
from experiments.gemm_shapes import BENCH_MODELS, gemm_shapes  # noqa: E402
from experiments.harness import bench_us, probe_main  # noqa: E402
from kernels.gemm import gemm, gemm_config  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.utils import device_card  # noqa: E402

# (layer, N, K, M): the two points whose times swung between runs, and a steady one beside them
POINTS = (("deepseek-v3.shared.down", 7168, 2048, 128),
          ("deepseek-v3.q_a", 1536, 7168, 256),
          ("qwen3-8b.qkv", 6144, 4096, 128))
ROUNDS = 6
CONDITIONS = ("same_operands", "fresh_operands")
SURVEY_M = (128, 256)


def spread(times: list[float]) -> dict:
    """Median, extremes and max / min of one series of per-capture times."""
    return {"median_us": round(statistics.median(times), 3), "min_us": round(min(times), 3),
            "max_us": round(max(times), 3), "max_over_min": round(max(times) / min(times), 4)}


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE, generator=generator) / math.sqrt(k)
    x = torch.randn(m, k, device="cuda", dtype=DTYPE, generator=generator)
    return x, w


def _point(label: str, n: int, k: int, m: int, conditions: tuple[str, ...] = CONDITIONS,
           rep_ms: int = 30) -> dict:
    pick = gemm_config(m, n, k, DTYPE, Mode.CORUN, card=device_card(torch.device("cuda")))
    record = {"layer": label, "M": m, "N": n, "K": k, "pick": pick.to_dict(), "rounds": ROUNDS}
    for condition in conditions:
        held = _operands(m, n, k, seed=0) if condition == "same_operands" else None
        kept = []
        ours, cublas, addresses = [], [], []
        for round_index in range(ROUNDS):
            # fresh operands are allocated while every earlier round's are still alive, so the
            # caching allocator hands out new addresses each round
            x, w = held if held is not None else _operands(m, n, k, round_index)
            addresses.append({"x": x.data_ptr(), "w": w.data_ptr()})
            # alternate which runs first, so a card warming up between the two favours neither
            pair = [("ours", lambda x=x, w=w: gemm(x, w, mode=Mode.CORUN)),
                    ("cublas", lambda x=x, w=w: F.linear(x, w))]
            for name, fn in pair if round_index % 2 == 0 else pair[::-1]:
                (ours if name == "ours" else cublas).append(bench_us(fn, 10, rep_ms))
            kept.append((x, w))
        ratios = [c / o for c, o in zip(cublas, ours, strict=True)]
        record[condition] = {
            "ours_us": [round(t, 3) for t in ours], "cublas_us": [round(t, 3) for t in cublas],
            "ratios": [round(r, 4) for r in ratios], "ours": spread(ours),
            "cublas": spread(cublas), "ratio_median": round(statistics.median(ratios), 4),
            "addresses": addresses}
        print(f"{label} M={m} {condition}: ours {spread(ours)}, cuBLAS {spread(cublas)}",
              flush=True)
    return record


def collect() -> list[dict]:
    return [_point(label, n, k, m) for label, n, k, m in POINTS]


def collect_survey(budget_s: float, state: dict) -> list[dict]:
    """The survey's points until ``budget_s`` of wall time is spent (checked before each point;
    ``state["complete"]`` says whether every point ran), each at 20 ms of replays a timing: 456
    timings, about 0.3 s each on an H100."""
    start = time.monotonic()
    records = []
    for label, n, k in gemm_shapes(BENCH_MODELS):
        for m in SURVEY_M:
            if time.monotonic() - start > budget_s:
                state["complete"] = False
                print(f"survey: budget of {budget_s:.0f} s spent after {len(records)} points",
                      flush=True)
                return records
            records.append(_point(label, n, k, m, conditions=("fresh_operands",), rep_ms=20))
            torch.cuda.empty_cache()  # an LM head's six weight copies are gigabytes
    state["complete"] = True
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--survey", action="store_true",
                        help=f"every GEMM of the kernels table at M {SURVEY_M}, fresh operands "
                             "only (probe-capture-spread-survey-<card>.json)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="the survey's wall-time budget, checked before each point")
    args = parser.parse_args(argv)
    if args.survey:
        state = {"complete": False}
        return probe_main("capture-spread-survey", lambda: collect_survey(args.budget_s, state),
                          header_extra=lambda: {**state, "budget_s": args.budget_s,
                                                "expected_points": 2 * len(
                                                    gemm_shapes(BENCH_MODELS))})
    return probe_main("capture-spread", collect)


if __name__ == "__main__":
    raise SystemExit(main())
