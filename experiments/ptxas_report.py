"""Registers, spills and shared memory of a launch as the H200 would build it, on a machine with no
GPU: the launcher runs on CPU tensors with its Triton kernels replaced by recorders, each recorded
launch is specialised the way Triton's own launcher does it (its binder and ``_pack_args``: ints
of 1 become constants, 16-divisible ints and 16-byte aligned pointers are marked so), compiled for
``cuda:90`` and assembled by the ``ptxas`` that ships with Triton (``-v``, ``sm_90a``).

It answers, before a device call, what a tile costs in registers and whether it spills, whether
its loads became ``cp.async`` copies (software pipelining) and how many ``wgmma`` it issues, so a
tuning sweep spends device time only on tiles that can win. Compile-time facts, not timings: the
H200 still decides. The device's Triton (3.6) is what counts; `pip download triton==3.6.0` into a
side venv and run this module with it to match the device bit for bit (the header names the
Triton and ptxas that made a results file).

    python -m experiments.ptxas_report mla-decode            # tune_mla's decode candidates
    python -m experiments.ptxas_report mla-prefill           # tune_mla's prefill candidates
    python -m experiments.ptxas_report moe-align|gemm        # the policies' picks
    python -m experiments.ptxas_report gemm-tail             # kv_a's picks beside tail tiles
    python -m experiments.ptxas_report decode-attention      # two launches, and fused
    python -m experiments.ptxas_report gemm --out experiments/results
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from experiments import harness  # noqa: E402

SHARED_MEMORY_LIMIT = 232_448  # bytes of shared memory one H200 (sm_90) block may use (227 KB)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the JIT function, its grid, positional and keyword arguments."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JIT function in a launcher module: ``kernel[grid](...)`` is recorded."""

    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))

        return record


def capture_launches(module: ModuleType, call: Callable[[], object]) -> list[Launch]:
    """Run ``call`` with every Triton kernel that ``module`` names replaced by a recorder; the
    launches it would have made, in order (nothing runs)."""
    launches: list[Launch] = []
    with harness.kernels_replaced([module], lambda k: _Recorder(k, launches)) as kernels:
        # Under TRITON_INTERPRET=1 the kernels are interpreted functions: nothing to compile.
        if not kernels or not all(isinstance(k, triton.runtime.jit.JITFunction) for k in kernels):
            raise RuntimeError(f"{module.__name__} names no compiled Triton kernel to capture "
                               "(run without TRITON_INTERPRET)")
        call()
    return launches


def _ptxas() -> list[str]:
    """Triton's bundled ptxas binaries, the plain one first (ptxas-blackwell reads newer PTX)."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return [str(folder / name) for name in ("ptxas", "ptxas-blackwell")
            if (folder / name).exists()]


def _assemble(ptx: str, arch: str) -> tuple[str, str]:
    """(ptxas -v report, the ptxas that accepted the PTX's version)."""
    errors = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        Path(path).write_text(ptx)
        for exe in _ptxas():
            done = subprocess.run([exe, "-v", "--gpu-name", arch, path, "-o", path + ".cubin"],
                                  capture_output=True, text=True, check=False)
            if done.returncode == 0:
                return done.stderr, exe
            errors.append(f"{Path(exe).name}: {done.stderr.strip()[-300:]}")
    raise RuntimeError("no bundled ptxas assembled the kernel: " + " | ".join(errors))


def compile_report(launch: Launch, capability: int = 90) -> dict:
    """Compile ``launch`` for ``cuda:<capability>`` as Triton's launcher would, assemble it, and
    report registers, spills, shared memory and the instructions that matter for the tile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    ptx = compiled.asm["ptx"]
    report, exe = _assemble(ptx, f"sm_{capability}a" if capability == 90 else f"sm_{capability}")
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    shared = int(compiled.metadata.shared)
    return {
        "kernel": fn.__name__,
        "grid": list(launch.grid),
        "num_warps": options.num_warps,
        "num_stages": options.num_stages,
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else None,
        "spill_load_bytes": int(spills.group(2)) if spills else None,
        "shared_bytes": shared,
        "fits_shared": shared <= SHARED_MEMORY_LIMIT,
        "wgmma": ptx.count("wgmma.mma_async"),
        "wgmma_deferred_waits": deferred_wgmma_waits(ptx),
        "mma_sync": ptx.count("mma.sync"),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "ld_global": ptx.count("ld.global"),
        "ptxas": Path(exe).name,
    }


def deferred_wgmma_waits(ptx: str) -> int:
    """The waits that leave some ``wgmma`` in flight (``wgmma.wait_group N``, N > 0): what lets a
    product overlap the instructions after it. 0: every product is waited for before the next
    instruction that reads a result."""
    return len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+[1-9]\d*\s*;", ptx))


def ptxas_version() -> str:
    done = subprocess.run([_ptxas()[0], "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip().splitlines()[-1] if done.stdout else "unknown"


# ----------------------------------------------------------------------------------------------
# MLA decode at DeepSeek-V3's shape: the tiles experiments/tune_mla.py sweeps
# ----------------------------------------------------------------------------------------------


def _report(launch: Launch) -> dict:
    try:
        return compile_report(launch)
    except Exception as err:  # a config that does not compile is a finding, not a crash
        return {"kernel": launch.kernel.__name__, "error": f"{type(err).__name__}: {err}"[:300]}


def mla_decode_reports(tiles: list, batch: int = 8, ctx: int = 4096,
                       split_size: int = 256) -> list[dict]:
    """One report per tile: mla_decode's split kernel at 128 heads, latent 512, rope 64, bf16, the
    engine's 16-token blocks, corun's fixed splits (the combine kernel is tile-independent)."""
    from experiments.bench_mla import BLOCK_SIZE
    from kernels import mla
    from kernels.mode import Mode

    heads, latent, rope = 128, 512, 64
    blocks = -(-ctx // BLOCK_SIZE)
    q_latent = torch.empty(batch, heads, latent, dtype=torch.bfloat16)
    q_pe = torch.empty(batch, heads, rope, dtype=torch.bfloat16)
    cache = torch.empty(batch * blocks, BLOCK_SIZE, latent + rope, dtype=torch.bfloat16)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    rows = []
    for tile in tiles:
        launches = capture_launches(mla, lambda tile=tile: mla.mla_decode(
            q_latent, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx, mode=Mode.CORUN,
            split_size=split_size, tile=tile))
        split = next(x for x in launches if x.kernel.__name__ == "_mla_decode_kernel")
        rows.append({"case": tile.label, "tile": tile.to_dict(), **_report(split)})
    return rows


def mla_prefill_reports(tiles: list, length: int = 4096) -> list[dict]:
    """One report per prefill tile: DeepSeek-V3's expanded prefill (128 heads, qk 192 = 128 + 64,
    v 128, bf16), one sequence of ``length`` tokens."""
    from kernels import mla
    from kernels.mode import Mode

    heads, qk_dim, v_dim = 128, 192, 128
    q = torch.empty(length, heads, qk_dim, dtype=torch.bfloat16)
    k = torch.empty(length, heads, qk_dim, dtype=torch.bfloat16)
    v = torch.empty(length, heads, v_dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, length], dtype=torch.int32)
    rows = []
    for tile in tiles:
        cfg = mla.mla_prefill_config(qk_dim, v_dim, torch.bfloat16, Mode.CORUN, tile=tile)
        launch = capture_launches(mla, lambda cfg=cfg: mla.mla_prefill_attention(
            q, k, v, cu, cu, 0.1, max_q_len=length, config=cfg))[0]
        rows.append({"case": tile.label, "tile": tile.to_dict(), **_report(launch)})
    return rows


def moe_align_reports(experts: tuple[int, ...] = (128, 192, 256), top_k: int = 8,
                      tokens: tuple[int, ...] = (1, 128, 2048, 8192),
                      block_ms: tuple[int, ...] = (16, 64)) -> list[dict]:
    """The launches (one fused, or two) of every distinct moe_align policy pick over the named
    MoE models' expert counts (Qwen3 128, Hy3 192, DeepSeek-V3 256), decode to prefill token
    counts, both block_m."""
    from kernels import moe_align

    rows, seen = [], set()
    for num_experts in experts:
        for block_m in block_ms:
            for num_tokens in tokens:
                cfg = moe_align.moe_align_config(num_tokens * top_k, num_experts, block_m)
                if cfg in seen:
                    continue
                seen.add(cfg)
                ids = torch.zeros(num_tokens, top_k, dtype=torch.int32)
                for launch in capture_launches(moe_align, lambda ids=ids, e=num_experts,
                                               b=block_m: moe_align.moe_align(ids, e, b)):
                    rows.append({"case": f"E {num_experts}, block_m {block_m}, T {num_tokens} "
                                         f"x k {top_k}: BLOCK_P {cfg.BLOCK_P}, BINS {cfg.BINS}, "
                                         f"QB {cfg.QB}, FILL {cfg.FILL}, ROWS {cfg.ROWS}, "
                                         f"{cfg.num_warps} warps"
                                         + (f", fused (HIST_P {cfg.HIST_P})" if cfg.fused
                                            else ""),
                                 **_report(launch)})
    return rows


def gemm_reports(ms: tuple[int, ...] = (128, 256)) -> list[dict]:
    """The corun policy's GEMM launch at the decode M of issue 13 for every GEMM shape of the
    kernel benchmark (experiments/gemm_shapes.py's BENCH_MODELS), and its twin: the same tile
    TMA-fed where the pick loads with cp.async, or cp.async-fed where the pick is TMA-fed."""
    from experiments.gemm_shapes import BENCH_MODELS, gemm_shapes
    from kernels import gemm
    from kernels.mode import Mode

    rows = []
    for label, n, k in gemm_shapes(BENCH_MODELS):
        for m in ms:
            x = torch.empty(m, k, dtype=torch.bfloat16)
            w = torch.empty(n, k, dtype=torch.bfloat16)
            pick = gemm.gemm_config(m, n, k, torch.bfloat16, Mode.CORUN)
            for cfg in (pick, dataclasses.replace(pick, tma=not pick.tma)):
                launch = capture_launches(
                    gemm, lambda x=x, w=w, cfg=cfg: gemm.gemm(x, w, config=cfg))[0]
                extras = (", persistent" * cfg.persistent
                          + (", TMA-fed" if cfg.tma else ", cp.async-fed")
                          + " (not the pick)" * (cfg is not pick))
                rows.append({"case": f"{label} M {m} (N {n}, K {k}): {cfg.block_m} x "
                                     f"{cfg.block_n} x {cfg.block_k}, split_k {cfg.split_k}, "
                                     f"{cfg.num_warps} warps, {cfg.num_stages} stages{extras}",
                             **_report(launch)})
    return rows


def gemm_tail_reports(ms: tuple[int, ...] = (128, 512, 2048, 8192)) -> list[dict]:
    """DeepSeek-V3's kv_a (N 576, K 7168): each card's corun pick (the H200's and the H100's
    tables) beside the unsplit tail configs experiments/probe_gemm_tail.py times
    (``GemmConfig.block_n_tail``: 128 + 64 columns from one x tile)."""
    from experiments.probe_gemm_tail import tail_configs
    from kernels import gemm
    from kernels.mode import Mode

    n, k = 576, 7168
    rows = []
    for m in ms:
        x = torch.empty(m, k, dtype=torch.bfloat16)
        w = torch.empty(n, k, dtype=torch.bfloat16)
        picks = {f"the {card} pick": gemm.gemm_config(m, n, k, torch.bfloat16, Mode.CORUN,
                                                      card=card) for card in ("h200", "h100")}
        tails = {name: cfg for name, cfg in tail_configs(m, n, k).items() if cfg.split_k == 1}
        for name, cfg in {**picks, **tails}.items():
            launch = capture_launches(
                gemm, lambda x=x, w=w, cfg=cfg: gemm.gemm(x, w, config=cfg))[0]
            rows.append({"case": f"kv_a M {m}: {cfg.label} ({name})", **_report(launch)})
    return rows


def decode_attention_reports(batches: tuple[int, ...] = (1, 8), ctx: int = 4096) -> list[dict]:
    """decode_attention's launches at Qwen3-8B's heads (32 q / 8 kv of 128, bf16, 16-token
    blocks) under corun's 256-token splits: the two-launch path, the fused combine, which is
    built as on a GPU (its fence included; the capture runs on CPU tensors), and the lanes'
    block ids loaded tile by tile at 2 stages and preloaded at 3, where the policy differs."""
    from kernels import attention
    from kernels.mode import Mode

    q_heads, kv_heads, head_dim, block = 32, 8, 128, 16
    rows = []
    for batch in batches:
        blocks = -(-ctx // block)
        q = torch.empty(batch, q_heads, head_dim, dtype=torch.bfloat16)
        cache = torch.empty(batch * blocks, block, kv_heads, head_dim, dtype=torch.bfloat16)
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        policy = attention.decode_attention_config(batch, q_heads, kv_heads, head_dim, ctx,
                                                   torch.bfloat16, Mode.CORUN)
        variants = dict.fromkeys((
            policy, dataclasses.replace(policy, fused_combine=True),
            dataclasses.replace(policy, preload_pages=False, num_stages=2),
            dataclasses.replace(policy, preload_pages=True, num_stages=3)))
        for cfg in variants:
            args = (q, cache, cache, tables, lens, 0.1)
            launches = capture_launches(attention, lambda args=args, cfg=cfg: (
                attention.decode_attention(*args, max_seq_len=ctx, config=cfg)))
            for launch in launches:
                if "GPU_FENCE" in launch.kwargs:
                    launch = dataclasses.replace(launch, kwargs={**launch.kwargs,
                                                                 "GPU_FENCE": True})
                ids = "ids preloaded" if cfg.preload_pages else "ids tile by tile"
                rows.append({"case": f"B {batch}, ctx {ctx}: {policy.num_split_programs} lanes, "
                                     f"{ids}, {cfg.num_stages} stages"
                                     f"{', fused combine' if cfg.fused_combine else ''}"
                                     f"{' (the policy)' if cfg == policy else ''}",
                             **_report(launch)})
    return rows


def _mla_decode_target() -> tuple[str, list[dict]]:
    from experiments.tune_mla import DECODE_CANDIDATES

    return ("mla_decode split kernel, experiments/tune_mla.py's decode candidates: B 8, ctx 4096, "
            "128 heads, latent 512, rope 64, bf16, 16-token blocks, corun split 256",
            mla_decode_reports(list(DECODE_CANDIDATES)))


def _mla_prefill_target() -> tuple[str, list[dict]]:
    from experiments.tune_mla import PREFILL_CANDIDATES

    return ("mla_prefill_attention, experiments/tune_mla.py's prefill candidates: one 4096-token "
            "sequence, 128 heads, qk 192 = 128 + 64, v 128, bf16",
            mla_prefill_reports(list(PREFILL_CANDIDATES)))


TARGETS: dict[str, Callable[[], tuple[str, list[dict]]]] = {
    "mla-decode": _mla_decode_target,
    "mla-prefill": _mla_prefill_target,
    "moe-align": lambda: ("moe_align's launches (fused, or count and scatter) at every "
                          "distinct policy pick",
                          moe_align_reports()),
    "gemm": lambda: ("the corun GEMM policy's launch (bf16) at M 128 and 256, and its tile "
                     "TMA-fed", gemm_reports()),
    "gemm-tail": lambda: ("DeepSeek-V3's kv_a GEMM (N 576, K 7168, bf16): the H200's and the "
                          "H100's corun picks beside the unsplit tail tiles of "
                          "experiments/probe_gemm_tail.py", gemm_tail_reports()),
    "decode-attention": lambda: ("decode_attention at Qwen3-8B's heads, corun splits of 256: "
                                 "the split and combine launches, the fused combine, and the "
                                 "block ids preloaded",
                                 decode_attention_reports()),
}


def _print(rows: list[dict]) -> None:
    keys = ("registers", "spill_store_bytes", "spill_load_bytes", "shared_bytes", "wgmma",
            "cp_async")
    print(" ".join(f"{k[:12]:>12s}" for k in keys) + "  case")
    for row in rows:
        cells = " ".join(f"{str(row.get(k, '-')):>12s}" for k in keys)
        print(f"{cells}  {row['case']} [{row['kernel']}] {row.get('error', '')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for ptxas-<target>-sm90.json (default: print only)")
    args = parser.parse_args(argv)
    shape, rows = TARGETS[args.target]()
    _print(rows)
    if args.out is not None:
        path = harness.write_results(
            f"ptxas-{args.target}-sm90", rows, args.out,
            machine="offline (no GPU): triton.compile for cuda:90, ptxas sm_90a",
            ptxas=ptxas_version(), shape=shape, shared_limit_bytes=SHARED_MEMORY_LIMIT,
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
