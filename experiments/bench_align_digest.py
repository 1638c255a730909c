"""The MoE token sort and the logits digest on the H200 vs the torch versions they replace.

- ``moe_align`` (kernels/moe_align.py, one launch at decode sizes, two past them) vs
  ``moe_align_block_size_reference`` (the ~25-op torch sort), at Qwen3-30B-A3B (E = 128) and
  DeepSeek-V3 (E = 256) routings, k = 8, T from decode to an 8192-token prefill, BLOCK_M 16
  and 64.
- ``logits_digest`` (kernels/logits_digest.py) vs the torch form of corun's ``LogitsDigest``
  (``LogitsDigest.torch_form``, weights built once, as the engine holds them), fp32 [N, 151936].
  Not ``LogitsDigest.__call__``: on CUDA that dispatches to this kernel, so timing it would time
  the kernel against itself (run14 of kernels-h200.json did, before this was fixed).
Both sides are timed as CUDA-graph replays (harness.bench_us). The checks compare the kernels
bit for bit with the torch versions at those shapes (with a token mask and out-of-range ids for
the sort), and a negative control shows the comparison sees a one-token change.

    python -m experiments.bench_align_digest [--quick]
        -> experiments/results/align_digest-h200.json
    (or inside bench_kernels: --families ...,align_digest)
"""

from __future__ import annotations

import itertools
import sys
from functools import partial
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corun.fingerprint import LogitsDigest  # noqa: E402
from experiments.harness import bench_us, family_main, kernel_record, memory_bound_us  # noqa: E402
from kernels.logits_digest import logits_digest  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.moe_align import (  # noqa: E402
    FUSED_MAX_PAIRS,
    MoEAlignConfig,
    moe_align,
    moe_align_config,
)
from kernels.reference import moe_align_block_size_reference  # noqa: E402

ROUTINGS = (("qwen3-30b-a3b", 128, 8), ("deepseek-v3", 256, 8))  # (label, experts, top_k)
TOKENS = (1, 32, 128, 256, 2048, 8192)
QUICK_TOKENS = (128, 8192)
BLOCK_MS = (16, 64)
DIGEST_ROWS = (1, 64, 256)
CHECK_TOKENS = (256, 8192)
# The sort's config sweep at decode and prefill sizes (qwen3-30b-a3b routing, BLOCK_M 16):
# (BLOCK_P, QB, num_warps), one launch and two, beside the policy's pick, and each launch's own
# GPU time.
VARIANT_TOKENS = (128, 512, 2048, 8192)
VARIANTS = ((64, 16, 4), (128, 16, 4), (128, 32, 4), (256, 16, 4), (256, 32, 4), (512, 16, 8),
            (512, 64, 8))
VOCAB = 151936
DEVICE = "cuda"


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_align_digest needs a CUDA device (H200); none is available here")


def _routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Distinct experts per token, skewed toward low ids (uneven expert loads, some empty)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(tokens, experts, device=DEVICE, generator=gen)
    scores = scores * torch.linspace(2.0, 0.5, experts, device=DEVICE)
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


def collect(quick: bool = False) -> list[dict]:
    _require_cuda()
    warmup_ms, rep_ms = (5, 20) if quick else (10, 30)
    bench = lambda fn: bench_us(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)  # noqa: E731
    records = []
    for label, experts, top_k in ROUTINGS:
        for tokens in QUICK_TOKENS if quick else TOKENS:
            ids = _routing(tokens, experts, top_k)
            for block_m in BLOCK_MS[:1] if quick else BLOCK_MS:
                run = partial(moe_align, ids, experts, block_m)
                us = bench(run)
                peer = bench(partial(moe_align_block_size_reference, ids, experts, block_m))
                records.append(kernel_record(
                    "moe_align", str(Mode.CORUN), tokens, experts, top_k, torch.int32, us,
                    "torch-sort (moe_align_block_size_reference)", peer,
                    shape=label, block_m=block_m,
                    fused=moe_align_config(tokens * top_k, experts, block_m).fused,
                    launches_us=_launch_us(run)))
    if not quick:
        records += _align_variants(bench)
    peer_digest = torch_digest_peer(LogitsDigest(VOCAB, DEVICE))
    for rows in DIGEST_ROWS:
        logits = torch.randn(rows, VOCAB, device=DEVICE)
        us = bench(partial(logits_digest, logits))
        peer = bench(partial(peer_digest, logits))
        bound = memory_bound_us(rows * VOCAB * 4)
        records.append(kernel_record(
            "logits_digest", str(Mode.CORUN), rows, VOCAB, 0, torch.float32, us,
            PEER_DIGEST_NAME, peer, bound_us=round(bound, 3),
            bw_fraction=round(bound / us, 4)))
    return records


PEER_DIGEST_NAME = "torch LogitsDigest.torch_form"


def torch_digest_peer(digest: LogitsDigest):
    """The torch digest the kernel replaced, on any device. ``digest`` itself (``__call__``)
    runs ``kernels.logits_digest`` on CUDA: as a peer it would be the kernel against itself."""
    return digest.torch_form


def _launch_us(fn, iters: int = 50) -> dict[str, float]:
    """Mean GPU time of each kernel fn launches (torch.profiler's CUDA activity), by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / iters, 3) for e in prof.key_averages()
            if e.device_time_total > 0}


def _config_label(cfg: MoEAlignConfig) -> str:
    launches = "one launch" if cfg.fused else "two launches"
    return f"BLOCK_P {cfg.BLOCK_P}, QB {cfg.QB}, {cfg.num_warps} warps, {launches}"


def _align_variants(bench) -> list[dict]:
    """moe_align at each VARIANTS config (same layout: any config gives the same bits), timed
    against the policy's config, with the per-launch split of each; up to FUSED_MAX_PAIRS pairs
    each config both as one launch and as two."""
    label, experts, top_k = ROUTINGS[0]
    records = []
    for tokens in VARIANT_TOKENS:
        ids = _routing(tokens, experts, top_k)
        policy = moe_align_config(tokens * top_k, experts, 16)
        policy_us = bench(partial(moe_align, ids, experts, 16))
        fused_choices = (False, True) if tokens * top_k <= FUSED_MAX_PAIRS else (False,)
        for (block_p, qb, warps), fused in itertools.product(VARIANTS, fused_choices):
            if block_p > max(16, tokens * top_k):
                continue
            cfg = MoEAlignConfig(BLOCK_P=block_p, BINS=policy.BINS, ROWS=policy.ROWS,
                                 FILL=policy.FILL, QB=qb, num_warps=warps, fused=fused,
                                 HIST_P=policy.HIST_P)
            run = partial(moe_align, ids, experts, 16, config=cfg)
            records.append(kernel_record(
                "moe_align_variant", str(Mode.CORUN), tokens, experts, top_k, torch.int32,
                bench(run), f"policy config ({_config_label(policy)})", policy_us, shape=label,
                block_m=16,
                variant=[block_p, qb, warps, fused], launches_us=_launch_us(run)))
    return records


def _check(op: str, check: str, shape: list, passed: bool, detail: str = "") -> dict:
    return {"op": op, "check": check, "mode": str(Mode.CORUN), "shape": shape,
            "passed": bool(passed), "detail": detail}


def check_invariance_gpu() -> list[dict]:
    """Bitwise equality with the torch versions at the real shapes; a negative control each."""
    _require_cuda()
    out = []
    for label, experts, top_k in ROUTINGS:
        for tokens in CHECK_TOKENS:
            ids = _routing(tokens, experts, top_k, seed=1)
            ids[::17, 0] = experts  # out of range: dropped
            mask = torch.rand(tokens, device=DEVICE) < 0.9
            for block_m in BLOCK_MS:
                got = moe_align(ids, experts, block_m, mask)
                ref = moe_align_block_size_reference(ids, experts, block_m, mask)
                same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                out.append(_check("moe_align", "equals_torch_reference",
                                  [tokens, experts, top_k, block_m], same, label))
        ids = _routing(256, experts, top_k, seed=2)
        moved = ids.clone()
        moved[[0, 1]] = ids[[1, 0]]
        out.append(_check("moe_align", "negative_control_token_order_changes_layout",
                          [256, experts, top_k, 16],
                          not torch.equal(moe_align(ids, experts, 16)[0],
                                          moe_align(moved, experts, 16)[0]),
                          "passed = swapping two tokens' routings moves pairs"))
    digest = torch_digest_peer(LogitsDigest(VOCAB, DEVICE))
    logits = torch.randn(256, VOCAB, device=DEVICE)
    logits.view(torch.int32)[0, :1000] = torch.randint(
        -(2**31), 2**31 - 1, (1000,), device=DEVICE, dtype=torch.int32)  # NaNs, infs, negatives
    out.append(_check("logits_digest", "equals_torch_digest", [256, VOCAB],
                      torch.equal(logits_digest(logits), digest(logits))))
    alone = logits_digest(logits[5:6])
    out.append(_check("logits_digest", "batch", [256, VOCAB],
                      torch.equal(alone[0], logits_digest(logits)[5])))
    flipped = logits.clone()
    flipped.view(torch.int32)[5, 77] ^= 1
    out.append(_check("logits_digest", "negative_control_one_bit_changes_digest", [256, VOCAB],
                      not torch.equal(logits_digest(flipped)[5], logits_digest(logits)[5]),
                      "passed = a one-bit change of one logit changes its row's digest"))
    return out


def main(argv: list[str] | None = None) -> int:
    return family_main("align_digest", collect, check_invariance_gpu, argv,
                       __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
