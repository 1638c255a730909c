"""CoRun's Triton kernels: one op a file, each with its config policy and a torch reference.

The public launchers are exported lazily, so ``import kernels.mode`` (the scheduler's only need)
does not import triton or compile anything.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Mode": "kernels.mode",
    "gemm": "kernels.gemm",
    "gemm_config": "kernels.gemm",
    "GemmConfig": "kernels.gemm",
    "rmsnorm": "kernels.norm",
    "rope": "kernels.rope",
    "build_rope_cache": "kernels.rope",
    "silu_mul": "kernels.activation",
    "sample": "kernels.sampling",
    "token_logprobs": "kernels.sampling",
    "store_kv": "kernels.kv_store",
    "prefill_attention": "kernels.attention",
    "decode_attention": "kernels.attention",
    "store_mla_kv": "kernels.kv_store",
    "mla_decode": "kernels.mla",
    "mla_prefill_attention": "kernels.mla",
    "softmax_topk": "kernels.moe_routing",
    "grouped_topk": "kernels.moe_routing",
    "fused_moe": "kernels.moe",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
