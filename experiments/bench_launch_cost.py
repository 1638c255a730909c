"""Host cost of one launch of every op in ``kernels/``: the Python launcher's microseconds with
the GPU work excluded, at the shapes of a decode step (B = 128) and a 512-token prefill.

Two modes, both recorded when available:
- ``stub`` (any machine, CPU-only included): every Triton kernel object in ``kernels.*`` is
  replaced by a no-op launcher and the op runs on CPU tensors, so what is timed is exactly the
  launcher's own work: argument checks, config policy, allocations (CPU ones here), grid,
  argument packing. The data-dependent host checks the launchers run on CPU tensors only
  (``is_host_checkable``) are switched off, as they are on a GPU.
- ``native`` (with CUDA): real launches on CUDA tensors; host time per call over a short burst
  (the GPU runs behind, asynchronously), i.e. the stub cost plus Triton's own dispatch and the
  CUDA launch calls. Beside it the op's GPU time at the same shape, timed as the kernel tables
  time it (``harness.bench_us``: the median of CUDA-graph replays, L2 not flushed; ``do_bench``
  where an op cannot be captured), so ``host_over_gpu`` > 1 says that an eager launch of the op
  waits on the host, not the GPU.

Each record: ``{"op", "shape", "mode", "host_us"(median of repeats), "calls"}`` (native adds
``gpu_us`` and ``host_over_gpu``), and an estimate of one eager Qwen3-8B forward's launch overhead
(the ops of a decoder layer x 36 + sampling).

    python -m experiments.bench_launch_cost [--calls N] [--modes stub,native]
        -> experiments/results/launch-cost-<machine>.json (machine: h200, or the CPU's name)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import bench_us, card_tag, kernels_replaced, write_results  # noqa: E402
from models.config import NAMED_CONFIGS  # noqa: E402

DECODE_B = 128
PREFILL_T = 512
CONTEXT = 1024  # decode context length (tokens per sequence)
BLOCK_SIZE = 16  # KV cache block size
DTYPE = torch.bfloat16


def _kernel_modules() -> list:
    import kernels

    return [importlib.import_module(f"kernels.{m.name}")
            for m in pkgutil.iter_modules(kernels.__path__) if not m.name.startswith("_")]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return self._launch

    @staticmethod
    def _launch(*args: object, **kwargs: object) -> None:
        return None


def _never(tensor: torch.Tensor) -> bool:
    return False


@contextlib.contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Replace every Triton kernel object bound in a ``kernels.*`` module by ``_NoLaunch``, and
    ``is_host_checkable`` by "never" (the GPU behaviour)."""
    modules = _kernel_modules()
    checks = [(module, module.is_host_checkable) for module in modules
              if "is_host_checkable" in vars(module)]
    with kernels_replaced(modules, lambda _: _NoLaunch()):
        try:
            for module, _ in checks:
                module.is_host_checkable = _never
            yield
        finally:
            for module, check in checks:
                module.is_host_checkable = check


def _op_calls(device: str) -> dict[str, Callable[[], object]]:
    """One zero-argument call per (op, shape), its tensors built once on ``device``."""
    from kernels.activation import silu_mul
    from kernels.attention import decode_attention, prefill_attention
    from kernels.gemm import gemm
    from kernels.kv_store import store_kv, store_mla_kv
    from kernels.logits_digest import logits_digest
    from kernels.mla import mla_decode, mla_prefill_attention
    from kernels.moe import fused_moe
    from kernels.moe_align import moe_align
    from kernels.moe_routing import grouped_topk, softmax_topk
    from kernels.norm import rmsnorm
    from kernels.rope import build_rope_cache, rope
    from kernels.sampling import sample, token_logprobs

    qwen, moe, ds = NAMED_CONFIGS["qwen3-8b"], NAMED_CONFIGS["qwen3-30b-a3b"], \
        NAMED_CONFIGS["deepseek-v3"]

    def t(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        # Uninitialised: never read in stub mode; harmless garbage for native launches (every
        # index tensor below is filled).
        return torch.empty(shape, dtype=dtype, device=device)

    def ints(*shape: int, value: int = 0, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype, device=device)

    b, h, d = DECODE_B, qwen.hidden_size, qwen.head_dim
    hq, hk = qwen.num_attention_heads, qwen.num_key_value_heads
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    num_blocks = b * blocks_per_seq
    k_cache, v_cache = t(num_blocks, BLOCK_SIZE, hk, d), t(num_blocks, BLOCK_SIZE, hk, d)
    block_tables = ints(b, blocks_per_seq)
    cache = build_rope_cache(d, 8192, 1e6, device=device)
    calls: dict[str, Callable[[], object]] = {}
    for label, m in (("decode", b), ("prefill", PREFILL_T)):
        x, w_qkv = t(m, h), t((hq + 2 * hk) * d, h)
        calls[f"gemm qkv {label}"] = lambda x=x, w=w_qkv: gemm(x, w)
        norm_w = t(h)
        calls[f"rmsnorm+residual {label}"] = lambda x=x, w=norm_w: rmsnorm(x, w, 1e-6, x)
        q, k = t(m, hq, d), t(m, hk, d)
        pos = ints(m, dtype=torch.int64)
        calls[f"rope qwen3 {label}"] = lambda q=q, k=k, p=pos: rope(q, k, p, cache, True)
        gate_up = t(m, 2 * qwen.intermediate_size)
        calls[f"silu_mul {label}"] = lambda x=gate_up: silu_mul(x)
        slots = ints(m, value=-1)
        calls[f"store_kv {label}"] = lambda k=k, s=slots: store_kv(k, k, k_cache, v_cache, s)
    q = t(b, hq, d)
    seq_lens = ints(b, value=CONTEXT)
    calls["decode_attention decode"] = lambda: decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, d**-0.5, max_seq_len=CONTEXT)
    qp = t(PREFILL_T, hq, d)
    cu = torch.tensor([0, PREFILL_T], dtype=torch.int32, device=device)
    table_1, ctx_1 = block_tables[:1], ints(1, value=PREFILL_T)
    calls["prefill_attention prefill"] = lambda: prefill_attention(
        qp, k_cache, v_cache, table_1, cu, ctx_1, d**-0.5, max_q_len=PREFILL_T)
    # MoE (Qwen3-30B-A3B decode)
    e, k_top, hm, im = moe.num_experts, moe.num_experts_per_tok, moe.hidden_size, \
        moe.moe_intermediate_size
    xm, logits_r = t(b, hm), t(b, e, dtype=torch.float32)
    w13, w2 = t(e, 2 * im, hm), t(e, hm, im)
    # Routed ids spread over the experts, as a router gives them (all on expert 0 would time a
    # degenerate sort and MoE layer).
    ids = torch.randint(0, e, (b, k_top), dtype=torch.int32, device=device)
    weights = t(b, k_top, dtype=torch.float32)
    calls["softmax_topk decode"] = lambda: softmax_topk(logits_r, k_top, True)
    calls["moe_align decode"] = lambda: moe_align(ids, e, 16)
    calls["fused_moe decode"] = lambda: fused_moe(xm, w13, w2, weights, ids, check_ids=False)
    ds_router, ds_bias = t(b, ds.num_experts, dtype=torch.float32), t(ds.num_experts,
                                                                       dtype=torch.float32)
    calls["grouped_topk decode"] = lambda: grouped_topk(
        ds_router, ds_bias, ds.num_experts_per_tok, ds.n_group, ds.topk_group, True, 2.5)
    # MLA (DeepSeek-V3 decode / prefill)
    lkv, rd, hds = ds.kv_lora_rank, ds.qk_rope_head_dim, ds.num_attention_heads
    mla_cache = t(num_blocks, BLOCK_SIZE, lkv + rd)
    latent, k_pe, mla_slots = t(b, lkv), t(b, rd), ints(b, value=-1)
    calls["store_mla_kv decode"] = lambda: store_mla_kv(latent, k_pe, mla_cache, mla_slots)
    q_latent, q_pe = t(b, hds, lkv), t(b, hds, rd)
    calls["mla_decode decode"] = lambda: mla_decode(
        q_latent, q_pe, mla_cache, block_tables, seq_lens, 0.1, max_seq_len=CONTEXT)
    qk = ds.qk_nope_head_dim + rd
    cu_p = torch.tensor([0, PREFILL_T], dtype=torch.int32, device=device)
    mq, mk, mv = t(PREFILL_T, hds, qk), t(PREFILL_T, hds, qk), t(PREFILL_T, hds, ds.v_head_dim)
    calls["mla_prefill_attention prefill"] = lambda: mla_prefill_attention(
        mq, mk, mv, cu_p, cu_p, 0.1, max_q_len=PREFILL_T)
    ds_q, ds_k = t(b, hds, ds.qk_nope_head_dim + rd)[..., ds.qk_nope_head_dim:], t(b, 1, rd)
    ds_cache = build_rope_cache(rd, 8192, 1e4, device=device)
    ds_pos = ints(b, dtype=torch.int64)
    calls["rope deepseek-v3 decode"] = lambda: rope(ds_q, ds_k, ds_pos, ds_cache, False)
    # Sampling (Qwen3 vocab, decode)
    # Logits of a peaked distribution: top-k 50 is then decided by the candidate lists, as for a
    # real model (uninitialised memory can hold NaNs, which send rows to the whole-row sweeps).
    logits = 4.0 * torch.randn(b, qwen.vocab_size, dtype=torch.float32, device=device)
    params = (torch.ones(b, device=device), ints(b, value=50, dtype=torch.int64),
              torch.full((b,), 0.9, device=device), ints(b, dtype=torch.int64),
              ints(b, dtype=torch.int64), ints(b, dtype=torch.int64))
    calls["sample decode"] = lambda: sample(logits, *params)
    calls["token_logprobs decode"] = lambda: token_logprobs(logits, params[3])
    calls["logits_digest decode"] = lambda: logits_digest(logits)
    return calls


# One Qwen3-8B decoder layer's launches (q/k norms are two rmsnorm calls on head views).
LAYER_OPS = {"rmsnorm+residual": 4, "gemm qkv": 4, "rope qwen3": 1, "store_kv": 1,
             "silu_mul": 1}


def _time_calls(fn: Callable[[], object], calls: int, repeats: int, sync: bool) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if sync:
            torch.cuda.synchronize()
    return statistics.median(samples)


def measure(modes: list[str], calls: int = 200, repeats: int = 5) -> list[dict]:
    records = []
    for mode in modes:
        if mode == "native" and not torch.cuda.is_available():
            print("native: no CUDA device, skipped", file=sys.stderr)
            continue
        device = "cpu" if mode == "stub" else "cuda"
        ctx = stubbed_kernels() if mode == "stub" else contextlib.nullcontext()
        with ctx:
            ops = _op_calls(device)
            per_op = {}
            for name, fn in ops.items():
                try:
                    us = _time_calls(fn, calls if mode == "stub" else min(calls, 50), repeats,
                                     sync=mode == "native")
                except Exception as exc:  # a launcher that cannot run in this mode is recorded
                    records.append({"op": name, "mode": mode, "error": repr(exc)})
                    continue
                op, _, shape = name.rpartition(" ")
                per_op[name] = us
                record = {"op": op, "shape": shape, "mode": mode, "host_us": round(us, 2),
                          "calls": calls}
                if mode == "native":
                    try:
                        gpu = bench_us(fn)
                        record.update(gpu_us=round(gpu, 2), host_over_gpu=round(us / gpu, 2))
                    except Exception as exc:  # an op that cannot be captured keeps its host time
                        record["gpu_error"] = repr(exc)[:300]
                records.append(record)
                print(f"{mode:6s} {name:34s} {us:8.1f} us host  {record.get('gpu_us', '-')} us gpu")
        layer = sum(n * per_op.get(f"{op} decode", 0.0) for op, n in LAYER_OPS.items())
        layer += 3 * per_op.get("gemm qkv decode", 0.0)  # o_proj, gate_up, down: ~ one gemm each
        layer += per_op.get("decode_attention decode", 0.0)
        forward = 36 * layer + per_op.get("gemm qkv decode", 0.0) + per_op.get("sample decode", 0)
        records.append({"op": "qwen3-8b eager decode forward (estimate)", "mode": mode,
                        "host_us": round(forward, 1),
                        "detail": "36 x (4 rmsnorm, 7 gemm, rope, store_kv, attention, "
                                  "silu_mul) + lm_head gemm + sample"})
        print(f"{mode:6s} qwen3-8b eager decode forward ~ {forward / 1000:.2f} ms of launch work")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timing repeat")
    parser.add_argument("--modes", default="stub,native", help="stub and/or native")
    parser.add_argument("--out", default=None, help="results folder (default experiments/results)")
    args = parser.parse_args(argv)
    records = measure(args.modes.split(","), calls=args.calls)
    path = write_results(f"launch-cost-{card_tag()}", records, args.out,
                         timing="host perf_counter per call; stub = kernels replaced by no-ops "
                                "on CPU tensors, native = real CUDA launches; gpu_us = "
                                "harness.bench_us: CUDA-graph replay medians (L2 not flushed), "
                                "do_bench where not capturable")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
