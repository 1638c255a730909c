"""Routers of the routed-expert layer: a token's router logits -> (weights, expert ids).

Layouts: router_logits [T, E] (E <= MAX_EXPERTS); returns routing weights fp32 [T, k] and expert
ids int32 [T, k], rank 0 the best expert, as ``fused_moe`` in ``kernels/moe.py`` takes them.
Numerics are those of ``softmax_topk_reference`` and ``grouped_topk_reference`` in
``kernels/reference.py``; the jit kernels are in ``kernels/moe_kernels.py``.

Invariance. One token per program, top-k by iterative argmax (lowest id on ties): a token's
(weights, ids) are a function of its own logits only, so they are position- and batch-invariant
in every mode (``mode`` is accepted for the uniform launcher API and changes nothing).
"""

from __future__ import annotations

import torch

from kernels.mode import Mode
from kernels.moe_kernels import _grouped_topk_kernel, _softmax_topk_kernel
from kernels.utils import (
    FLOAT_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
    next_power_of_2,
)

__all__ = ["MAX_EXPERTS", "grouped_topk", "softmax_topk"]

MAX_EXPERTS = 256  # routers hold a token's whole expert row in one block


def _check_router_logits(router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES,
                 last_dim_contiguous=True)
    num_tokens, num_experts = router_logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"router_logits: expected 1..{MAX_EXPERTS} experts, got {num_experts}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in 1..{num_experts} (experts), got {top_k!r}")
    return num_tokens, num_experts


def _empty_routing(
    num_tokens: int, top_k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' outputs: weights fp32 [T, k] and expert ids int32 [T, k]."""
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    return weights, ids


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, mode: Mode = Mode.CORUN
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: fp32 softmax over E, top-k (lowest id on ties), optional renorm.

    Returns (weights fp32 [T, k], ids int32 [T, k]). One token per program: invariant to the
    batch in every mode (``mode`` is accepted for the uniform launcher API).
    """
    Mode.parse(mode)
    num_tokens, num_experts = _check_router_logits(router_logits, top_k)
    weights, ids = _empty_routing(num_tokens, top_k, router_logits.device)
    if num_tokens == 0:
        return weights, ids
    _softmax_topk_kernel[(num_tokens,)](
        router_logits, weights, ids,
        num_experts,
        router_logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(top_k),
    )
    return weights, ids


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    *,
    mode: Mode = Mode.CORUN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (noaux_tc): sigmoid, biased choice, best ``topk_group`` of ``n_group``
    groups by top-2 sum, top-k experts there, weights from unbiased scores, renorm (+1e-20),
    times ``routed_scaling_factor``. Returns (weights fp32 [T, k], ids int32 [T, k]).

    One token per program: invariant to the batch in every mode.
    """
    Mode.parse(mode)
    num_tokens, num_experts = _check_router_logits(router_logits, top_k)
    check_tensor("correction_bias", correction_bias, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
    check_shape("correction_bias", correction_bias, (num_experts,))
    check_same_device(router_logits=router_logits, correction_bias=correction_bias)
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group: expected a positive divisor of {num_experts}, got {n_group!r}")
    group_size = num_experts // n_group
    if group_size < 2:
        raise ValueError(f"n_group: groups need >= 2 experts (top-2 score), got {group_size}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: expected an int in 1..{n_group}, got {topk_group!r}")
    if topk_group * group_size < top_k:
        raise ValueError(f"top_k: {top_k} exceeds the {topk_group * group_size} experts "
                         f"of the kept groups")
    weights, ids = _empty_routing(num_tokens, top_k, router_logits.device)
    if num_tokens == 0:
        return weights, ids
    _grouped_topk_kernel[(num_tokens,)](
        router_logits, correction_bias, weights, ids,
        n_group, group_size, float(routed_scaling_factor),
        router_logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, TOPK_GROUP=topk_group, RENORMALIZE=bool(renormalize),
        BLOCK_G=next_power_of_2(n_group), BLOCK_GS=next_power_of_2(group_size),
        BLOCK_K=next_power_of_2(top_k),
    )
    return weights, ids
