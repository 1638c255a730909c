"""Sampling on the H200: ``kernels.sampling.sample`` vs a torch peer at V = 151936, plus bitwise
invariance checks (a row's token and logprob alone vs inside a batch, moved to another slot).

The peer is the usual torch sampler without torch.multinomial: softmax(logits / T), top-k by
torch.topk, top-p by sort + cumsum, then an exponential race argmax(p / E) with E ~ Exp(1) from a
seeded generator. ``bound_us`` is one read of the fp32 logits at 4.3 TB/s (ours sweeps the row
several times while bisecting, so bw_fraction < 1 with top-k/top-p is expected).

    python -m experiments.bench_sampling [--quick]   -> experiments/results/sampling-h200.json
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import bench_us, family_main, kernel_record, memory_bound_us  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.sampling import sample, token_logprobs  # noqa: E402

VOCAB = 151936  # Qwen3
BATCH_SIZES = (1, 64, 256)
# (label, temperature, top_k, top_p)
CONFIGS = (
    ("greedy", 0.0, 0, 1.0),
    ("plain", 0.8, 0, 1.0),
    ("top-k-50", 0.8, 50, 1.0),
    ("top-p-0.9", 0.8, 0, 0.9),
    ("top-k-50-top-p-0.9", 0.8, 50, 0.9),
)
DEVICE = "cuda"


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_sampling needs a CUDA device (H200); none is available here")


def _args(batch: int, temperature: float, top_k: int, top_p: float, seed: int = 0) -> list:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = 4 * torch.randn(batch, VOCAB, device=DEVICE, generator=gen)
    return [
        logits,
        torch.full((batch,), temperature, device=DEVICE),
        torch.full((batch,), top_k, device=DEVICE, dtype=torch.int64),
        torch.full((batch,), top_p, device=DEVICE),
        torch.randint(0, 2**62, (batch,), device=DEVICE, generator=gen),
        torch.zeros(batch, device=DEVICE, dtype=torch.int64),
        torch.randint(0, 32768, (batch,), device=DEVICE, generator=gen),
    ]


def torch_peer(logits, temperature, top_k, top_p, generator: torch.Generator) -> torch.Tensor:
    """softmax + top-k + top-p (sort, cumsum) + exponential race; per-batch scalars for brevity."""
    t, k, p = float(temperature[0]), int(top_k[0]), float(top_p[0])
    if t == 0:
        return logits.argmax(dim=-1)
    scaled = logits / t
    if k > 0:
        kth = torch.topk(scaled, k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs_sorted = sorted_logits.softmax(dim=-1)
        drop = probs_sorted.cumsum(dim=-1) - probs_sorted >= p
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _log_softmax_gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])


def collect(quick: bool = False) -> list[dict]:
    """Timing records: one per (config, B), the torch peer timed at the same point."""
    _require_cuda()
    torch.manual_seed(0)
    configs = CONFIGS[1::3] if quick else CONFIGS
    warmup_ms, rep_ms = (5, 20) if quick else (10, 40)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    records = []
    for label, temperature, top_k, top_p in configs:
        for batch in BATCH_SIZES:
            args = _args(batch, temperature, top_k, top_p)
            us = bench_us(partial(sample, *args), warmup_ms=warmup_ms, rep_ms=rep_ms)
            peer = bench_us(
                partial(torch_peer, *args[:4], generator), warmup_ms=warmup_ms, rep_ms=rep_ms
            )
            bound = memory_bound_us(batch * VOCAB * 4)
            records.append(
                kernel_record(
                    "sample",
                    str(Mode.CORUN),
                    batch,
                    VOCAB,
                    0,
                    torch.float32,
                    us,
                    "torch-softmax-exp-race",
                    peer,
                    config=label,
                    bound_us=round(bound, 3),
                    bw_fraction=round(bound / us, 4),
                )
            )
    for batch in BATCH_SIZES:
        args = _args(batch, 1.0, 0, 1.0)
        ids = args[0].argmax(dim=-1)
        us = bench_us(partial(token_logprobs, args[0], ids), warmup_ms=warmup_ms, rep_ms=rep_ms)
        peer = bench_us(
            partial(_log_softmax_gather, args[0], ids),
            warmup_ms=warmup_ms,
            rep_ms=rep_ms,
        )
        bound = memory_bound_us(batch * VOCAB * 4)
        records.append(
            kernel_record(
                "token_logprobs",
                str(Mode.CORUN),
                batch,
                VOCAB,
                0,
                torch.float32,
                us,
                "torch-log-softmax",
                peer,
                bound_us=round(bound, 3),
                bw_fraction=round(bound / us, 4),
            )
        )
    return records


def check_invariance_gpu() -> list[dict]:
    """Per config and mode: row 3's token (and logprob) alone, in a batch of 256, and moved to
    slot 200 of a batch with fresh neighbours; plus a control that its own position matters."""
    _require_cuda()
    out = []
    batch, row, slot = 256, 3, 200
    for mode in Mode:
        for label, temperature, top_k, top_p in CONFIGS:
            args = _args(batch, temperature, top_k, top_p, seed=1)
            others = _args(batch, temperature, top_k, top_p, seed=2)
            full = sample(*args, mode=mode)
            alone = sample(*[a[row : row + 1] for a in args], mode=mode)
            moved = [o.clone() for o in others]
            for m, a in zip(moved, args, strict=True):
                m[slot] = a[row]
            moved_tok = sample(*moved, mode=mode)
            lp_full = token_logprobs(args[0], full, mode=mode)
            lp_alone = token_logprobs(args[0][row : row + 1], full[row : row + 1], mode=mode)
            shape = [batch, VOCAB]
            detail = f"{label}: token {int(full[row])}"
            out.append(
                {
                    "op": "sample",
                    "check": "batch",
                    "mode": str(mode),
                    "shape": shape,
                    "passed": bool(alone[0] == full[row]),
                    "detail": detail,
                }
            )
            out.append(
                {
                    "op": "sample",
                    "check": "position",
                    "mode": str(mode),
                    "shape": shape,
                    "passed": bool(moved_tok[slot] == full[row]),
                    "detail": detail,
                }
            )
            out.append(
                {
                    "op": "token_logprobs",
                    "check": "batch",
                    "mode": str(mode),
                    "shape": shape,
                    "passed": bool(torch.equal(lp_alone[0], lp_full[row])),
                    "detail": label,
                }
            )
    args = _args(batch, 1.0, 0, 1.0, seed=3)
    shifted = sample(*args[:6], args[6] + 1)
    out.append(
        {
            "op": "sample",
            "check": "negative_control_own_position_changes_draws",
            "mode": str(Mode.CORUN),
            "shape": [batch, VOCAB],
            "passed": bool(not torch.equal(shifted, sample(*args))),
            "detail": "passed = the check detects a change of the row's own noise counter",
        }
    )
    return out


def main(argv: list[str] | None = None) -> int:
    return family_main("sampling", collect, check_invariance_gpu, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
