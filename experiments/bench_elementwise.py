"""Row ops on the H200: rmsnorm (+ fused residual), rope, silu_mul vs torch eager, against the
memory bound, plus bitwise invariance checks at the real shapes in bf16.

``collect()`` times each op at M (tokens) in {1 ... 8192} against its peers measured in the same
call, the same way (CUDA-graph replay): torch eager (the reference math of
``kernels/reference.py``), ``torch.compile`` of that math (dynamic shapes) and Liger-Kernel
(``LigerRMSNormFunction``, ``LigerFusedAddRMSNormFunction``, ``LigerRopeFunction`` for the
neox layout, ``LigerFusedGateUpSiLUMulFunction``; its wheel travels in ``.whl``). A row's ``peer``
is the fastest of them, each one's time is kept as ``<peer>_us``. ``bound_us`` is bytes moved /
the card's copy bandwidth (4.3 TB/s on the H200) and ``bw_fraction`` = bound_us / us (the target is
>= 0.9 where launch overhead does not dominate, i.e. at M >= 2048; below that a few-microsecond
launch is most of the time). The RoPE rows of issue 13's target shape (``ROPE_TARGET_SHAPE``)
also carry ``copy_us``: torch's device copy of the same bytes, timed the same way
(``harness.copy_reference_us``), and its ``copy_bw_fraction`` of the bound.

    python -m experiments.bench_elementwise [--quick]   -> experiments/results/elementwise-h200.json
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (  # noqa: E402
    bench_us,
    copy_reference_us,
    family_main,
    kernel_record,
    memory_bound_us,
)
from experiments.report_kernels import ROPE_TARGET_SHAPE  # noqa: E402
from kernels.activation import silu_mul  # noqa: E402
from kernels.mode import Mode  # noqa: E402
from kernels.norm import RmsNormConfig, rmsnorm  # noqa: E402
from kernels.reference import rmsnorm_reference, rope_reference, silu_mul_reference  # noqa: E402
from kernels.rope import RopeConfig, build_rope_cache, rope, rope_config  # noqa: E402

M_VALUES = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
QUICK_M = (1, 256, 8192)
HIDDEN_SIZES = (4096, 2048, 7168)  # Qwen3-8B, Qwen3-30B-A3B, DeepSeek-V3
INTERMEDIATE_SIZES = (12288, 768, 18432)  # Qwen3-8B dense, Qwen3-MoE expert, DeepSeek-V3 dense
# (label, q heads, k heads, rotary dim, q head width (rope part is the tail), is_neox)
ROPE_SHAPES = (("qwen3-8b", 32, 8, 128, 128, True), ("deepseek-v3", 128, 1, 64, 192, False))
# Other tilings timed beside the policy's at a decode and a prefill token count, so one run shows
# whether the policy picked the best (BLOCK_D, BLOCK_H, BLOCK_T, num_warps); same bits for all.
ROPE_VARIANTS = {
    "deepseek-v3": ((32, 32, 1, 4), (32, 32, 4, 4), (32, 64, 1, 8), (32, 64, 8, 8),
                    (32, 128, 1, 8), (32, 128, 2, 8)),
    "qwen3-8b": ((64, 16, 1, 4), (64, 32, 1, 8), (64, 32, 4, 8)),
}
ROPE_VARIANT_M = (128, 8192)
DTYPE = torch.bfloat16
DEVICE = "cuda"
ELEM = 2  # bytes per bf16 element


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench_elementwise needs a CUDA device (H200); none is available here")


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def _record(op, m, n, k, us, peers: dict[str, float], num_bytes, **extra) -> dict:
    """One timing row against the fastest of ``peers`` (name -> us; every peer's time is kept as
    ``<name>_us``, so the row also shows where each one stands)."""
    bound = memory_bound_us(num_bytes)
    best = min(peers, key=peers.__getitem__)
    return kernel_record(
        op,
        str(Mode.CORUN),
        m,
        n,
        k,
        DTYPE,
        us,
        best,
        peers[best],
        bound_us=round(bound, 3),
        bw_fraction=round(bound / us, 4),
        peer_bw_fraction=round(bound / peers[best], 4),
        **{f"{name.replace('-', '_')}_us": round(t, 3) for name, t in peers.items()},
        **extra,
    )


class Peers:
    """The peers of each row op: torch eager (the reference math), ``torch.compile`` of the same
    math (dynamic shapes: one compile per op serves every M) and Liger-Kernel where its wheel is
    installed (``liger_unavailable`` says why not). Timed like ours (``bench``)."""

    def __init__(self, bench) -> None:
        self.bench = bench
        self.compiled = {name: torch.compile(fn, dynamic=True) for name, fn in (
            ("rmsnorm", rmsnorm_reference), ("rope", rope_reference),
            ("silu_mul", silu_mul_reference))}
        try:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            from liger_kernel.ops.rope import LigerRopeFunction
            from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

            self.liger = dict(rmsnorm=LigerRMSNormFunction,
                              add_rmsnorm=LigerFusedAddRMSNormFunction, rope=LigerRopeFunction,
                              silu_mul=LigerFusedGateUpSiLUMulFunction)
            self.liger_unavailable = ""
        except Exception as exc:  # recorded in the header of the run, never hidden
            self.liger, self.liger_unavailable = {}, repr(exc)

    def _time(self, peers: dict, name: str, fn) -> None:
        try:
            peers[name] = self.bench(fn)
        except Exception as exc:  # a peer that fails at a shape is left out of that row only
            print(f"peer {name} failed: {exc!r}", flush=True)

    def rmsnorm(self, x, weight, residual=None) -> dict[str, float]:
        peers = {"torch-eager": self.bench(partial(rmsnorm_reference, x, weight, 1e-6, residual))}
        self._time(peers, "torch-compile",
                   partial(self.compiled["rmsnorm"], x, weight, 1e-6, residual))
        if self.liger and residual is None:
            self._time(peers, "liger", lambda: self.liger["rmsnorm"].apply(
                x, weight, 1e-6, 0.0, "llama", False))
        elif self.liger:
            self._time(peers, "liger", lambda: self.liger["add_rmsnorm"].apply(
                x, residual, weight, 1e-6, 0.0, "llama", False))
        return peers

    def rope(self, q, k, positions, cache, is_neox: bool) -> dict[str, float]:
        eager = partial(rope_reference, q, k, positions, cache, is_neox)
        peers = {"torch-eager": self.bench(eager)}
        self._time(peers, "torch-compile",
                   partial(self.compiled["rope"], q, k, positions, cache, is_neox))
        if self.liger and is_neox and q.is_contiguous():
            # Liger takes cos/sin already gathered at the positions (gathered outside the timing:
            # a small advantage to the peer) and q, k as [1, heads, tokens, dim] views.
            cos, sin = _gathered_cos_sin(cache, positions, q.shape[-1])
            q4, k4 = q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2)
            self._time(peers, "liger", lambda: self.liger["rope"].apply(q4, k4, cos, sin))
        return peers

    def silu_mul(self, x) -> dict[str, float]:
        peers = {"torch-eager": self.bench(partial(silu_mul_reference, x))}
        self._time(peers, "torch-compile", partial(self.compiled["silu_mul"], x))
        if self.liger:
            self._time(peers, "liger", lambda: self.liger["silu_mul"].apply(x))
        return peers


def _gathered_cos_sin(cache: torch.Tensor, positions: torch.Tensor, dim: int):
    """cos, sin [tokens, dim] (halves duplicated, the HF layout Liger reads) from our cache."""
    half = cache.shape[-1] // 2
    cos, sin = cache[positions, :half], cache[positions, half:]
    return (torch.cat([cos, cos], -1).to(DTYPE).contiguous(),
            torch.cat([sin, sin], -1).to(DTYPE).contiguous())


def collect(quick: bool = False) -> list[dict]:
    """Timing records: one per (op, shape, M), every peer timed at the same point."""
    _require_cuda()
    torch.manual_seed(0)
    m_values = QUICK_M if quick else M_VALUES
    warmup_ms, rep_ms = (5, 20) if quick else (10, 30)
    bench = lambda fn: bench_us(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)  # noqa: E731
    records = []
    peers = Peers(bench)
    for hidden in HIDDEN_SIZES[:1] if quick else HIDDEN_SIZES:
        weight = 1 + 0.1 * _randn(hidden)
        for m in m_values:
            x, residual = _randn(m, hidden), _randn(m, hidden)
            us = bench(partial(rmsnorm, x, weight, 1e-6))
            peer = peers.rmsnorm(x, weight)
            records.append(_record("rmsnorm", m, hidden, 0, us, peer, (2 * m + 1) * hidden * ELEM))
            us = bench(partial(rmsnorm, x, weight, 1e-6, residual))
            peer = peers.rmsnorm(x, weight, residual)
            records.append(
                _record("rmsnorm_residual", m, hidden, 0, us, peer, (4 * m + 1) * hidden * ELEM)
            )
    for label, q_heads, k_heads, rotary_dim, q_width, is_neox in ROPE_SHAPES:
        cache = build_rope_cache(rotary_dim, 8192, 10000.0, device=DEVICE)
        for m in m_values:
            q = _randn(m, q_heads, q_width)[..., q_width - rotary_dim :]
            k = _randn(m, k_heads, rotary_dim)
            positions = torch.randint(0, 8192, (m,), device=DEVICE)
            us = bench(partial(rope, q, k, positions, cache, is_neox, inplace=True))
            peer = peers.rope(q, k, positions, cache, is_neox)
            num_bytes = 2 * m * (q_heads + k_heads) * rotary_dim * ELEM + m * rotary_dim * 4
            policy = rope_config(m, q_heads, k_heads, rotary_dim, DTYPE)
            # The device copy of the same bytes, timed the same way: a reference for what one
            # launch moving them takes in practice (issue 13's RoPE row reports it).
            copy = {}
            if label == ROPE_TARGET_SHAPE:
                copy_us = copy_reference_us(num_bytes, warmup_ms=warmup_ms, rep_ms=rep_ms)
                copy = {"copy_us": round(copy_us, 3),
                        "copy_bw_fraction": round(memory_bound_us(num_bytes) / copy_us, 4)}
            records.append(
                _record(
                    "rope",
                    m,
                    q_heads * rotary_dim,
                    k_heads * rotary_dim,
                    us,
                    peer,
                    num_bytes,
                    shape=label,
                    is_neox=is_neox,
                    config=list(policy.__dict__.values()),
                    **copy,
                )
            )
            if quick or m not in ROPE_VARIANT_M:
                continue
            for variant in ROPE_VARIANTS[label]:
                cfg = RopeConfig(*variant)
                v_us = bench(partial(rope, q, k, positions, cache, is_neox, inplace=True,
                                     config=cfg))
                records.append(
                    _record("rope_variant", m, q_heads * rotary_dim, k_heads * rotary_dim, v_us,
                            peer, num_bytes, shape=label, is_neox=is_neox,
                            config=list(variant), policy_us=round(us, 3))
                )
    for inter in INTERMEDIATE_SIZES[:1] if quick else INTERMEDIATE_SIZES:
        for m in m_values:
            x = _randn(m, 2 * inter)
            us = bench(partial(silu_mul, x))
            peer = peers.silu_mul(x)
            records.append(_record("silu_mul", m, inter, 0, us, peer, 3 * m * inter * ELEM))
    return records


def _check(op: str, check: str, mode: Mode, shape: tuple, passed: bool, detail: str = "") -> dict:
    return {
        "op": op,
        "check": check,
        "mode": str(mode),
        "shape": list(shape),
        "passed": bool(passed),
        "detail": detail,
    }


def check_invariance_gpu() -> list[dict]:
    """Row 0 alone vs inside a batch of 256 (batch invariance) and under a row permutation
    (position invariance), bf16, real shapes, every mode; plus the rmsnorm tiling control."""
    _require_cuda()
    torch.manual_seed(1)
    batch = 256
    perm = torch.randperm(batch, device=DEVICE)
    out = []
    for mode in Mode:
        for hidden in HIDDEN_SIZES:
            x, residual, weight = _randn(batch, hidden), _randn(batch, hidden), _randn(hidden)
            full, full_res = rmsnorm(x, weight, 1e-6, residual, mode=mode)
            alone, _ = rmsnorm(x[:1], weight, 1e-6, residual[:1], mode=mode)
            permuted, _ = rmsnorm(x[perm], weight, 1e-6, residual[perm], mode=mode)
            out.append(
                _check("rmsnorm", "batch", mode, (batch, hidden), torch.equal(alone[0], full[0]))
            )
            out.append(
                _check(
                    "rmsnorm", "position", mode, (batch, hidden), torch.equal(permuted, full[perm])
                )
            )
        for label, q_heads, k_heads, rotary_dim, q_width, is_neox in ROPE_SHAPES:
            cache = build_rope_cache(rotary_dim, 8192, 10000.0, device=DEVICE)
            q = _randn(batch, q_heads, q_width)[..., q_width - rotary_dim :]
            k = _randn(batch, k_heads, rotary_dim)
            positions = torch.randint(0, 8192, (batch,), device=DEVICE)
            fq, fk = rope(q, k, positions, cache, is_neox, mode=mode)
            aq, ak = rope(q[:1], k[:1], positions[:1], cache, is_neox, mode=mode)
            pq, pk = rope(q[perm], k[perm], positions[perm], cache, is_neox, mode=mode)
            shape = (batch, q_heads, k_heads, rotary_dim)
            out.append(
                _check(
                    "rope",
                    "batch",
                    mode,
                    shape,
                    torch.equal(aq[0], fq[0]) and torch.equal(ak[0], fk[0]),
                    label,
                )
            )
            out.append(
                _check(
                    "rope",
                    "position",
                    mode,
                    shape,
                    torch.equal(pq, fq[perm]) and torch.equal(pk, fk[perm]),
                    label,
                )
            )
        for inter in INTERMEDIATE_SIZES:
            x = _randn(batch, 2 * inter)
            full = silu_mul(x, mode=mode)
            out.append(
                _check(
                    "silu_mul",
                    "batch",
                    mode,
                    (batch, inter),
                    torch.equal(silu_mul(x[:1], mode=mode)[0], full[0]),
                )
            )
            out.append(
                _check(
                    "silu_mul",
                    "position",
                    mode,
                    (batch, inter),
                    torch.equal(silu_mul(x[perm], mode=mode), full[perm]),
                )
            )
    # Negative control: a tiled sweep (what an M-dependent policy could pick) changes bits.
    x, weight = _randn(batch, 4096), _randn(4096)
    tiled = rmsnorm(x, weight, 1e-6, config=RmsNormConfig(BLOCK_SIZE=1024, num_warps=4))
    out.append(
        _check(
            "rmsnorm",
            "negative_control_tiling_changes_bits",
            Mode.CORUN,
            (batch, 4096),
            not torch.equal(tiled, rmsnorm(x, weight, 1e-6)),
            "passed = the bitwise check detects another reduction order",
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    return family_main("elementwise", collect, check_invariance_gpu, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
