"""The routed-MoE layer on the H200: router + fused_moe against a torch per-expert loop and against
the memory bound of the touched experts' weights; bitwise invariance at the real shapes.

Models (NAMED_CONFIGS): Qwen3-30B-A3B (128 experts, top-8, H 2048, I 768, softmax router),
DeepSeek-V3 (256 experts, top-8, 8 groups keep 4, H 7168, I 2048, sigmoid router) and Hy3
(192 experts, top-8, one group, H 4096, I 1536, sigmoid router), at 64 (decode) and 2048
(prefill) tokens, bf16. The router GEMM (x @ gate.T) is not timed: logits are
inputs. ``us`` = our softmax_topk/grouped_topk + fused_moe; peer = the faster of two, both with
the torch reference router: a loop of bf16 matmuls per expert over the tokens routed to it (HF
eager style, ``torch_expert_loop_us``) and the vendor grouped GEMM, ``torch._grouped_mm`` over the
expert-sorted tokens (``torch_grouped_mm_us``; ``grouped_mm_error`` where this torch lacks it);
bound_us = (distinct experts hit) x (w13 + w2 bytes) / the copy bandwidth (4.3 TB/s on the H200);
bw_fraction = bound_us / us.
The ``default`` MoE policy equals ``corun`` (both pick tiles from the total token count), so
``corun`` and ``batch_invariant`` are timed.

    python -m experiments.bench_moe [--quick]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from experiments import harness

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "hy3")
TOKEN_COUNTS = (64, 2048)
DTYPE = torch.bfloat16


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("experiments/bench_moe.py needs a CUDA device (H200); none is visible")


def _shapes(model: str) -> dict:
    from models.config import NAMED_CONFIGS

    cfg = NAMED_CONFIGS[model]
    return {
        "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
        "hidden": cfg.hidden_size, "inter": cfg.moe_intermediate_size,
        "grouped": cfg.has_expert_bias, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "renormalize": cfg.norm_topk_prob, "scale": cfg.routed_scaling_factor,
    }


def _expert_weights(shapes: dict, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """w13 [E, 2I, H], w2 [E, H, I] bf16 ~ N(0, 1/fan_in), filled in place: DeepSeek-V3's 22.5 GB
    is allocated once, never staged through an fp32 copy. Plus the router's correction bias."""
    torch.manual_seed(seed)
    e, h, i = shapes["num_experts"], shapes["hidden"], shapes["inter"]
    w13 = torch.empty((e, 2 * i, h), dtype=DTYPE, device="cuda").normal_(0.0, h**-0.5)
    w2 = torch.empty((e, h, i), dtype=DTYPE, device="cuda").normal_(0.0, i**-0.5)
    bias = torch.randn(e, device="cuda") * 0.01
    return w13, w2, bias


def _inputs(shapes: dict, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, shapes["hidden"], generator=gen, device="cuda").to(DTYPE)
    logits = torch.randn(num_tokens, shapes["num_experts"], generator=gen, device="cuda")
    # Qwen3-MoE's gate is a bf16 Linear; DeepSeek-V3 and Hy3 compute router logits in fp32
    return x, (logits if shapes["grouped"] else logits.to(DTYPE))


def _route(shapes, logits, bias, mode, reference: bool = False):
    from kernels import moe
    from kernels import reference as ref

    k = shapes["top_k"]
    if shapes["grouped"]:
        args = (logits, bias, k, shapes["n_group"], shapes["topk_group"], shapes["renormalize"],
                shapes["scale"])
        if reference:
            return ref.grouped_topk_reference(*args)
        return moe.grouped_topk(*args, mode=mode)
    if reference:
        return ref.softmax_topk_reference(logits, k, shapes["renormalize"])
    return moe.softmax_topk(logits, k, shapes["renormalize"], mode=mode)


def moe_layer(shapes, x, logits, w13, w2, bias, mode, config=None) -> torch.Tensor:
    """Ours: Triton router + fused_moe."""
    from kernels.moe import fused_moe

    weights, ids = _route(shapes, logits, bias, mode)
    # ids from our router are in range: skip the host-side check (a sync), as a model layer does
    return fused_moe(x, w13, w2, weights, ids, mode=mode, config=config, check_ids=False)


def torch_moe_layer(shapes, x, logits, w13, w2, bias) -> torch.Tensor:
    """The peer: torch router, then per expert one bf16 gate_up matmul, SiLU-mul, one down matmul
    over the tokens routed to it, accumulated in fp32 with index_add_."""
    weights, ids = _route(shapes, logits, bias, None, reference=True)
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    flat_ids = ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = x[tokens] @ w13[expert].T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].T
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(x.dtype)


def grouped_mm_moe_layer(shapes, x, logits, w13, w2, bias) -> torch.Tensor:
    """The vendor peer: torch router, tokens sorted by expert, then the two expert GEMMs as
    ``torch._grouped_mm`` (CUTLASS grouped GEMM on sm90) over the per-expert row groups; counts by
    scatter_add so nothing syncs with the host and the layer can be captured like ours."""
    weights, ids = _route(shapes, logits, bias, None, reference=True)
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    flat_ids = ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tokens = order // top_k
    gate_up = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def _experts_hit(shapes, logits, bias) -> int:
    _, ids = _route(shapes, logits, bias, None, reference=True)
    return int(torch.unique(ids).numel())


def _time_token_count(model, shapes, w13, w2, bias, num_tokens, modes) -> list[dict]:
    """Records for one (model, token count): the peer once, ours per mode, same inputs."""
    from kernels.moe import fused_moe, moe_config

    x, logits = _inputs(shapes, num_tokens, seed=num_tokens)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    hit = _experts_hit(shapes, logits, bias)
    bound_us = harness.memory_bound_us(hit * expert_bytes)
    loop_us = harness.bench_us(lambda: torch_moe_layer(shapes, x, logits, w13, w2, bias))
    peer, peer_us, grouped_us, grouped_error = "torch_expert_loop", loop_us, None, None
    try:
        grouped_us = harness.bench_us(
            lambda: grouped_mm_moe_layer(shapes, x, logits, w13, w2, bias))
        if grouped_us < loop_us:
            peer, peer_us = "torch_grouped_mm", grouped_us
    except Exception as exc:  # recorded in the row: an op this torch lacks is not a silent miss
        grouped_error = repr(exc)[:200]
    records = []
    for mode in modes:
        us = harness.bench_us(lambda m=mode: moe_layer(shapes, x, logits, w13, w2, bias, m))
        weights, ids = _route(shapes, logits, bias, mode)
        fused_us = harness.bench_us(
            lambda m=mode, w=weights, i=ids: fused_moe(x, w13, w2, w, i, mode=m, check_ids=False))
        cfg = moe_config(num_tokens, shapes["num_experts"], shapes["top_k"], shapes["hidden"],
                         shapes["inter"], DTYPE, mode)
        records.append(harness.kernel_record(
            "moe_layer", str(mode), num_tokens, shapes["hidden"], shapes["inter"], DTYPE,
            us, peer, peer_us, model=model, torch_expert_loop_us=round(loop_us, 3),
            torch_grouped_mm_us=None if grouped_us is None else round(grouped_us, 3),
            grouped_mm_error=grouped_error,
            num_experts=shapes["num_experts"], top_k=shapes["top_k"], experts_hit=hit,
            fused_moe_us=round(fused_us, 3), bound_us=round(bound_us, 3),
            bw_fraction=round(bound_us / us, 4), config=cfg.to_dict(),
        ))
        print(f"[moe] {model} T={num_tokens} {mode}: {us:.1f} us (fused_moe {fused_us:.1f}), "
              f"peer {peer} {peer_us:.1f} us, bound {bound_us:.1f} us", flush=True)
    return records


def collect(quick: bool = False) -> list[dict]:
    """Timing records (harness.kernel_record), one per (model, token count, mode)."""
    from kernels.mode import Mode

    _require_cuda()
    records = []
    token_counts = TOKEN_COUNTS[:1] if quick else TOKEN_COUNTS
    modes = (Mode.CORUN,) if quick else (Mode.CORUN, Mode.BATCH_INVARIANT)
    for model in MODELS:
        shapes = _shapes(model)
        w13, w2, bias = _expert_weights(shapes)
        for num_tokens in token_counts:
            records += _time_token_count(model, shapes, w13, w2, bias, num_tokens, modes)
        del w13, w2, bias  # DeepSeek-V3's 22.5 GB go before the next model
        torch.cuda.empty_cache()
    return records


def _check(model, check, mode, shape, same: bool, expect_equal: bool, detail: str) -> dict:
    return {"op": "moe_layer", "check": check, "mode": str(mode), "shape": shape,
            "passed": same == expect_equal, "detail": detail, "model": model}


def check_invariance_gpu() -> list[dict]:
    """Token 0's output bits at the real shapes in bf16: with other co-running tokens at a fixed
    T under corun (and default); across T under batch_invariant; plus a negative control (another
    implementation must give other bits, else the check could not fail)."""
    from kernels.mode import Mode

    _require_cuda()
    records = []
    num_tokens = 64
    for model in MODELS:
        shapes = _shapes(model)
        w13, w2, bias = _expert_weights(shapes)
        shape = f"T={num_tokens} E={shapes['num_experts']} k={shapes['top_k']} " \
                f"H={shapes['hidden']} I={shapes['inter']}"
        x_a, logits_a = _inputs(shapes, num_tokens, seed=1)
        x_b, logits_b = _inputs(shapes, num_tokens, seed=2)
        x_b[0], logits_b[0] = x_a[0], logits_a[0]  # token 0 shared, its co-runners all differ
        for mode in (Mode.CORUN, Mode.DEFAULT):
            out_a = moe_layer(shapes, x_a, logits_a, w13, w2, bias, mode)
            out_b = moe_layer(shapes, x_b, logits_b, w13, w2, bias, mode)
            same = torch.equal(out_a[0], out_b[0])
            detail = f"{int((out_a[0] != out_b[0]).sum())} of {shapes['hidden']} differ"
            records.append(_check(model, "token0_vs_other_tokens_fixed_T", mode, shape, same, True,
                                  detail))
        mode = Mode.BATCH_INVARIANT
        x_big, logits_big = _inputs(shapes, 2048, seed=3)
        x_big[0], logits_big[0] = x_a[0], logits_a[0]
        out_small = moe_layer(shapes, x_a, logits_a, w13, w2, bias, mode)
        out_big = moe_layer(shapes, x_big, logits_big, w13, w2, bias, mode)
        same = torch.equal(out_small[0], out_big[0])
        records.append(_check(model, "token0_T64_vs_T2048", mode, shape, same, True,
                              f"{int((out_small[0] != out_big[0]).sum())} differ"))
        # negative control: the same check against another implementation (cuBLAS per-expert
        # matmuls, expert-order combine) must see different bits, else it could never fail
        out_ours = moe_layer(shapes, x_a, logits_a, w13, w2, bias, Mode.CORUN)
        out_peer = torch_moe_layer(shapes, x_a, logits_a, w13, w2, bias)
        same = torch.equal(out_ours[0], out_peer[0])
        records.append(_check(model, "negative_control_token0_vs_torch_loop", Mode.CORUN, shape,
                              same, False,
                              f"{int((out_ours[0] != out_peer[0]).sum())} differ (expected > 0)"))
        del w13, w2, bias, x_big, logits_big
        torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    return harness.family_main("moe", collect, check_invariance_gpu, argv,
                               __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
