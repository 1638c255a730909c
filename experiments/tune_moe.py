"""Offline MoE tuning on the H200 -> kernels/tuned/moe_h200.json (data ``moe_config`` reads).

For the expert shapes of the benchmarked models (Qwen3-30B-A3B, DeepSeek-V3) and every total token
count T in ``TOKEN_COUNTS`` it times the two grouped GEMMs *separately* (they share only BLOCK_M,
the alignment's padding): for each BLOCK_M in ``block_m_options(T)`` the gate_up tiles of
``GATE_UP_TILES`` and the down tiles of ``DOWN_TILES``, each checked against the literal policy's
output (max abs error <= 2e-2 of the max, bf16) and skipped when it fails to compile or run (out
of shared memory). Per T the fastest (BLOCK_M, gate_up tile, down tile) by
align + gate_up + down time becomes the corun/default entry; ``batch_invariant`` gets ONE config
per expert shape: the combination with the lowest geometric mean of that sum over every tuned T.
The printout breaks a layer down into router, align, gate_up, down and combine times, and gives
the whole layer (router + fused_moe) with the literal and the tuned config against the memory
bound of the touched experts.

Points run in ``PRIORITY`` order (the benchmarked T first) until ``--budget-s`` is spent; a T
that was cut short is dropped, the header says ``complete: false`` and which T were tuned.

    python -m experiments.tune_moe [--budget-s 60] [--rep-ms 5] [--out kernels/tuned/moe_h200.json]
    TRITON_INTERPRET=1 python -m experiments.tune_moe --dry-run   # CPU logic check, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_moe import _route, _shapes  # noqa: E402
from experiments.harness import bench_us, header, memory_bound_us  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.moe import (  # noqa: E402
    TUNED_PATH,
    MoEConfig,
    fallback_moe_config,
    fused_moe,
    load_moe_tuned_table,
    moe_align_block_size,
    moe_combine,
    moe_down,
    moe_gate_up,
)

MODELS = ("qwen3-30b-a3b", "deepseek-v3")
TOKEN_COUNTS = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
# The benchmark's points first, so a short budget still tunes what bench_moe measures.
PRIORITY_TOKENS = (64, 2048, 1, 8, 32, 128, 256, 512, 8192)
DTYPE = torch.bfloat16
# (block_n, block_k, num_warps, num_stages); gate_up's block_n is per half (two accumulators).
GATE_UP_TILES = ((64, 128, 4, 3), (64, 64, 4, 4), (32, 128, 4, 4), (128, 64, 8, 3),
                 (64, 256, 4, 3), (128, 128, 8, 3))
DOWN_TILES = ((64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 4), (32, 256, 4, 3),
              (128, 128, 8, 3), (256, 64, 8, 3))
# Per-CTA shared memory the software pipeline may take (H200: 227 KB per block).
SMEM_BUDGET_BYTES = 220 * 1024
MAX_REL_ERR = 2e-2

Tile = tuple[int, int, int, int]


@dataclass(frozen=True)
class Tiles:
    """The candidate tiles of each GEMM (the dry run swaps in tiny ones)."""

    gate_up: tuple[Tile, ...] = GATE_UP_TILES
    down: tuple[Tile, ...] = DOWN_TILES


def block_m_options(num_tokens: int, num_experts: int, top_k: int) -> tuple[int, ...]:
    """16/32/64 at every T (the batch-invariant pick needs each at every T), plus 128 once the
    expected rows per expert reach 64 (prefill)."""
    rows_per_expert = num_tokens * top_k / num_experts
    return (16, 32, 64, 128) if rows_per_expert >= 64 else (16, 32, 64)


def fits_smem(block_m: int, tile: Tile, num_b_tiles: int, itemsize: int = 2) -> bool:
    """Whether ``num_stages`` copies of the A tile and ``num_b_tiles`` weight tiles fit."""
    block_n, block_k, _, stages = tile
    return (block_m + num_b_tiles * block_n) * block_k * itemsize * stages <= SMEM_BUDGET_BYTES


def gate_up_config(block_m: int, tile: Tile, block_h: int) -> MoEConfig:
    block_n, block_k, warps, stages = tile
    return MoEConfig(block_m, block_n, block_k, warps, stages, block_h)


def down_config(block_m: int, tile: Tile, gate_up: Tile, block_h: int) -> MoEConfig:
    g_n, g_k, g_warps, g_stages = gate_up
    block_n, block_k, warps, stages = tile
    return MoEConfig(block_m, g_n, g_k, g_warps, g_stages, block_h, down_block_n=block_n,
                     down_block_k=block_k, down_num_warps=warps, down_num_stages=stages)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    err = (actual.float() - expected).abs().max().item()
    return err / max(expected.abs().max().item(), 1e-6)


def _timed(fn: Callable[[], torch.Tensor], expected: torch.Tensor | None, label: str,
           timer: Callable[[Callable[[], object]], float]) -> float | None:
    """Median us of ``fn``, or None if it fails (compile, resources) or disagrees with
    ``expected``; one candidate's failure never stops the sweep."""
    try:
        out = fn()
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as err:  # out of shared memory / registers: not a candidate here
        print(f"    skip {label}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        return None
    if expected is not None:
        err = _rel_err(out, expected)
        if not math.isfinite(err) or err > MAX_REL_ERR:
            print(f"    reject {label}: rel err {err:.3g} vs the literal config", file=sys.stderr)
            return None
    return timer(fn)


def _point_inputs(shapes: dict, num_tokens: int, bias: torch.Tensor, device: str) -> tuple:
    """(x, router logits, routing weights, expert ids) of one point, seeded by T."""
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, shapes["hidden"], generator=gen, device=device).to(DTYPE)
    logits = torch.randn(num_tokens, shapes["num_experts"], generator=gen, device=device)
    logits = logits if shapes["grouped"] else logits.to(DTYPE)  # Qwen3's gate is a bf16 Linear
    weights, ids = _route(shapes, logits, bias, Mode.CORUN)
    return x, logits, weights, ids


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() > self.deadline


def tune_point(shapes: dict, tensors: tuple, num_tokens: int, device: str, budget: _Budget,
               timer: Callable, tiles: Tiles) -> dict | None:
    """All candidates at one (expert shape, T). Returns the point's timings, or None if the
    budget ran out before it finished (a partial point would bias the choice)."""
    w13, w2, bias = tensors
    num_experts, top_k, hidden, inter = (shapes["num_experts"], shapes["top_k"], shapes["hidden"],
                                         shapes["inter"])
    x, logits, weights, ids = _point_inputs(shapes, num_tokens, bias, device)

    base = fallback_moe_config(num_tokens, num_experts, top_k, hidden, inter, Mode.CORUN)
    sorted_ids, block_ids = moe_align_block_size(ids, num_experts, base.block_m)
    act_ref = moe_gate_up(x, w13, sorted_ids, block_ids, top_k, base)
    y_ref = moe_down(act_ref, w2, sorted_ids, block_ids, base)

    point = {"num_tokens": num_tokens, "align": {}, "gate_up": {}, "down": {}}
    point["router_us"] = timer(lambda: _route(shapes, logits, bias, Mode.CORUN))
    point["combine_us"] = timer(lambda: moe_combine(y_ref, weights, ids, num_experts, base))
    point["base_layer_us"] = timer(lambda: fused_moe(x, w13, w2, weights, ids, config=base,
                                                     check_ids=False))
    point["base_config"] = base
    for block_m in block_m_options(num_tokens, num_experts, top_k):
        if budget.spent():
            return None
        sorted_ids, block_ids = moe_align_block_size(ids, num_experts, block_m)
        point["align"][block_m] = timer(
            lambda bm=block_m: moe_align_block_size(ids, num_experts, bm)[0])
        for tile in tiles.gate_up:
            if budget.spent():
                return None
            if not fits_smem(block_m, tile, 2):
                continue
            cfg = gate_up_config(block_m, tile, base.block_h)
            point["gate_up"][block_m, tile] = _timed(
                lambda c=cfg, s=sorted_ids, b=block_ids: moe_gate_up(x, w13, s, b, top_k, c),
                act_ref, f"gate_up bm={block_m} {tile}", timer)
        for tile in tiles.down:
            if budget.spent():
                return None
            if not fits_smem(block_m, tile, 1):
                continue
            cfg = down_config(block_m, tile, tiles.gate_up[0], base.block_h)
            point["down"][block_m, tile] = _timed(
                lambda c=cfg, s=sorted_ids, b=block_ids: moe_down(act_ref, w2, s, b, c),
                y_ref, f"down bm={block_m} {tile}", timer)
    return point


def _combo_us(point: dict, block_m: int, gate_up: Tile, down: Tile) -> float | None:
    parts = (point["align"].get(block_m), point["gate_up"].get((block_m, gate_up)),
             point["down"].get((block_m, down)))
    return None if any(p is None for p in parts) else sum(parts)


def best_combo(point: dict) -> tuple[tuple[int, Tile, Tile], float] | None:
    """Fastest (block_m, gate_up tile, down tile) at one point by align + gate_up + down."""
    best = None
    for block_m in point["align"]:
        gate_ups = {t: us for (bm, t), us in point["gate_up"].items() if bm == block_m and us}
        downs = {t: us for (bm, t), us in point["down"].items() if bm == block_m and us}
        if not gate_ups or not downs:
            continue
        g = min(gate_ups, key=gate_ups.get)
        d = min(downs, key=downs.get)
        us = point["align"][block_m] + gate_ups[g] + downs[d]
        if best is None or us < best[1]:
            best = ((block_m, g, d), us)
    return best


def batch_invariant_combo(points: list[dict], tiles: Tiles) -> tuple[int, Tile, Tile] | None:
    """The one combination with the lowest geometric mean of align + gate_up + down over every
    tuned T (only combinations that ran at every T qualify)."""
    best, best_log = None, math.inf
    for block_m, g, d in itertools.product((16, 32, 64), tiles.gate_up, tiles.down):
        times = [_combo_us(p, block_m, g, d) for p in points]
        if not times or any(t is None for t in times):
            continue
        log_mean = sum(math.log(t) for t in times) / len(times)
        if log_mean < best_log:
            best, best_log = (block_m, g, d), log_mean
    return best


def combo_config(combo: tuple[int, Tile, Tile], block_h: int) -> MoEConfig:
    block_m, g, d = combo
    return down_config(block_m, d, g, block_h)


def _shape_fields(shapes: dict) -> dict:
    return {"num_experts": shapes["num_experts"], "top_k": shapes["top_k"],
            "hidden": shapes["hidden"], "intermediate": shapes["inter"]}


def _make_tensors(shapes: dict, device: str) -> tuple[torch.Tensor, ...]:
    """w13, w2 bf16 ~ N(0, 1/fan_in), filled in place (DeepSeek-V3's 22.5 GB never in fp32)."""
    torch.manual_seed(0)
    e, h, i = shapes["num_experts"], shapes["hidden"], shapes["inter"]
    w13 = torch.empty((e, 2 * i, h), dtype=DTYPE, device=device).normal_(0.0, h**-0.5)
    w2 = torch.empty((e, h, i), dtype=DTYPE, device=device).normal_(0.0, i**-0.5)
    return w13, w2, torch.randn(e, device=device) * 0.01


def tune(models: dict[str, dict], token_counts: tuple[int, ...], device: str, budget_s: float,
         timer: Callable, tiles: Tiles | None = None) -> tuple[list[dict], list[dict], bool]:
    """Sweep (model, T) in priority order; returns (entries, batch_invariant, complete)."""
    tiles = tiles or Tiles()
    budget = _Budget(budget_s)
    tensors = {name: _make_tensors(shapes, device) for name, shapes in models.items()}
    order = sorted(itertools.product(models, token_counts),
                   key=lambda p: (PRIORITY_TOKENS.index(p[1]) if p[1] in PRIORITY_TOKENS
                                  else len(PRIORITY_TOKENS), list(models).index(p[0])))
    points: dict[str, list[dict]] = {name: [] for name in models}
    entries, complete = [], True
    for name, num_tokens in order:
        shapes = models[name]
        point = None if budget.spent() else tune_point(shapes, tensors[name], num_tokens, device,
                                                       budget, timer, tiles)
        best = best_combo(point) if point else None
        if point is None or best is None:
            complete = False
            print(f"  {name} T={num_tokens}: not tuned (budget or no candidate ran)", flush=True)
            continue
        points[name].append(point)
        base = point["base_config"]
        config = combo_config(best[0], base.block_h)
        w13, w2, bias = tensors[name]
        x, _, weights, ids = _point_inputs(shapes, num_tokens, bias, device)
        layer_us = timer(functools.partial(fused_moe, x, w13, w2, weights, ids, config=config,
                                           check_ids=False)) + point["router_us"]
        base_us = point["base_layer_us"] + point["router_us"]
        hit = int(torch.unique(ids).numel())
        bound_us = memory_bound_us(hit * (w13[0].numel() + w2[0].numel()) * w13.element_size())
        block_m, g, d = best[0]
        entry = {**_shape_fields(shapes), "model": name, "num_tokens": num_tokens,
                 "config": config.to_dict(), "layer_us": round(layer_us, 3),
                 "literal_layer_us": round(base_us, 3), "bound_us": round(bound_us, 3),
                 "bw_fraction": round(bound_us / layer_us, 4),
                 "router_us": round(point["router_us"], 3),
                 "align_us": round(point["align"][block_m], 3),
                 "gate_up_us": round(point["gate_up"][block_m, g], 3),
                 "down_us": round(point["down"][block_m, d], 3),
                 "combine_us": round(point["combine_us"], 3)}
        entries.append(entry)
        print(f"  {name:14s} T={num_tokens:5d} layer {layer_us:8.1f} us (literal {base_us:8.1f})"
              f" bound {bound_us:7.1f} bw {bound_us / layer_us:5.2f} | router "
              f"{entry['router_us']:6.1f} align {entry['align_us']:6.1f} gate_up "
              f"{entry['gate_up_us']:7.1f} down {entry['down_us']:7.1f} combine "
              f"{entry['combine_us']:6.1f} | bm={block_m} gu={g} dn={d}", flush=True)
    fixed = []
    for name, shapes in models.items():
        combo = batch_invariant_combo(points[name], tiles) if points[name] else None
        if combo is None:
            continue
        block_h = points[name][0]["base_config"].block_h
        fixed.append({**_shape_fields(shapes), "model": name,
                      "tuned_tokens": sorted(p["num_tokens"] for p in points[name]),
                      "config": combo_config(combo, block_h).to_dict()})
        print(f"  {name:14s} batch_invariant: bm={combo[0]} gu={combo[1]} dn={combo[2]} "
              f"(geomean over T={fixed[-1]['tuned_tokens']})", flush=True)
    entries.sort(key=lambda e: (e["model"], e["num_tokens"]))
    return entries, fixed, complete


def _wall_timer(fn: Callable[[], object]) -> float:
    """Dry run (CPU, interpreter): one call's wall time; exercises the logic, not the numbers."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=60.0, help="sweep wall-clock budget")
    parser.add_argument("--rep-ms", type=int, default=5, help="timing rep per candidate")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default {TUNED_PATH} (dry run: a temporary file)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1; checks the logic")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    if args.dry_run:
        # tiny tiles keep the interpreter fast
        tiles = Tiles(gate_up=((16, 32, 4, 3), (32, 16, 4, 4)),
                      down=((16, 16, 4, 3), (32, 32, 4, 4)))
        base = dict(grouped=False, n_group=1, topk_group=1, renormalize=True, scale=1.0)
        models = {"dry-qwen": {**base, "num_experts": 8, "top_k": 2, "hidden": 64, "inter": 32},
                  "dry-deepseek": {**base, "num_experts": 16, "top_k": 4, "hidden": 32,
                                   "inter": 48, "grouped": True, "n_group": 4, "topk_group": 2,
                                   "scale": 2.5}}
        device, token_counts, timer = "cpu", (1, 8, 64), _wall_timer
        out = args.out or Path(tempfile.gettempdir()) / "moe_tuned_dry_run.json"
    else:
        if not torch.cuda.is_available():
            print("tune_moe: needs a CUDA device (the table is H200 timing data); nothing written.",
                  file=sys.stderr)
            return 1
        if "H200" not in torch.cuda.get_device_name():
            print(f"tune_moe: warning: tuning on {torch.cuda.get_device_name()}, not an H200",
                  file=sys.stderr)
        models = {name: _shapes(name) for name in MODELS}
        device, token_counts, tiles = "cuda", TOKEN_COUNTS, Tiles()
        out = args.out or TUNED_PATH

        def timer(fn: Callable[[], object]) -> float:
            return bench_us(fn, warmup_ms=2, rep_ms=args.rep_ms)

    entries, fixed, complete = tune(models, token_counts, device, args.budget_s, timer, tiles)
    record = {
        "header": header(complete=complete, tuned_dtype="bfloat16", dry_run=args.dry_run,
                         token_counts=list(token_counts), wall_s=round(time.monotonic() - t0, 1)),
        "entries": entries,
        "batch_invariant": fixed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    load_moe_tuned_table(out)  # what the policy will read must parse
    print(f"wrote {len(entries)} entries, {len(fixed)} batch_invariant to {out} "
          f"(complete={complete}) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
