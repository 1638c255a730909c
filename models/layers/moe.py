"""Mixture-of-experts blocks: fused expert weights, Qwen3-MoE's softmax router and DeepSeek-V3's
grouped sigmoid router with shared experts (also Hy3's: one group, so a plain sigmoid + bias
top-k, and optionally the fp32 routed + shared combine).

Expert weights are stacked as vLLM and transformers v5 hold them: ``gate_up_proj`` [E, 2I, H]
(gate rows first) and ``down_proj`` [E, H, I]; the loader fills them from per-expert Hub keys or
from the fused v5 keys. Routing and the expert GEMMs go through ``models.ops`` (the triton path's
grouped GEMM uses an expert-count-independent tile config under corun and batch_invariant; the
combine sums the top-k in rank order), so a token's output does not depend on how many tokens
the other requests sent to its experts. Dummy tokens (``token_mask`` False) give zeros.

Tensor parallel *within* experts (vLLM's default for TP): every rank holds every expert, with
gate|up split on the intermediate dim I ([E, 2I/W, H]) and down on I ([E, H, I/W]); the router is
replicated, so every rank routes every token identically, computes a partial sum over its slice
of I, combines the top-k in rank order, and one all-reduce (shared experts' partial included)
finishes the layer. Not expert parallel: that sends each token to the ranks owning its experts,
so which rank computes a token, and how many rows share its grouped GEMM there, would depend on
the other tokens' routing; here a token's reduction order is fixed by the layer alone, and the
load is balanced whatever the routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models import ops
from models.config import ModelConfig
from models.forward_batch import OpsConfig
from models.layers.linear import Linear
from models.layers.mlp import GatedMLP
from models.parallel import SINGLE, ParallelContext
from models.weights import ShardLayout


class FusedExperts(nn.Module):
    """All experts' weights; under TP this rank's slice [i_start, i_stop) of every expert's
    intermediate dim. ``intermediate_size`` is the full I (the checkpoint's)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.i_start, self.i_stop = parallel.shard(intermediate_size, "moe_intermediate_size")
        local = self.i_stop - self.i_start
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, local), requires_grad=False)

    def shard_layout(self, leaf: str) -> ShardLayout:
        e, h, inter = self.num_experts, self.hidden_size, self.intermediate_size
        start, stop, local = self.i_start, self.i_stop, self.i_stop - self.i_start
        every = slice(None)
        if leaf == "gate_up_proj":  # gate rows then up rows, each sliced on I
            return ShardLayout((e, 2 * inter, h), (
                ((every, slice(0, local)), (every, slice(start, stop))),
                ((every, slice(local, 2 * local)), (every, slice(inter + start, inter + stop)))))
        return ShardLayout((e, h, inter),
                           (((every, every, slice(0, local)), (every, every, slice(start, stop))),))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                ops_config: OpsConfig, token_mask: torch.Tensor | None) -> torch.Tensor:
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             ops_config, token_mask)


class SoftmaxTopKMoE(nn.Module):
    """Qwen3-MoE sparse block: softmax over E router logits, top-k, optionally renormalised
    (``norm_topk_prob``), no shared expert."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.parallel = parallel
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = FusedExperts(config.num_experts, config.hidden_size,
                                    config.moe_intermediate_size, parallel)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig,
                token_mask: torch.Tensor | None = None,
                on_routing: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``on_routing(ids [T, k])``: told the chosen experts (routing replay)."""
        router_logits = self.gate(x, ops_config)
        weights, ids = ops.softmax_topk(router_logits, self.top_k, self.norm_topk_prob, ops_config)
        if on_routing is not None:
            on_routing(ids)
        out = self.experts(x, weights, ids, ops_config, token_mask)
        return self.parallel.all_reduce(out, ops_config.mode)


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3 ``mlp.gate``: fp32 logits, and the fp32 ``e_score_correction_bias`` that
    biases the expert choice only (loaded from the checkpoint; zeros for random weights)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def init_buffers(self) -> None:
        """Back to fp32 zeros after materialisation (the model-wide dtype cast narrowed it)."""
        self.e_score_correction_bias = torch.zeros(
            self.weight.shape[0], dtype=torch.float32, device=self.weight.device)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig) -> torch.Tensor:
        # HF computes the router in fp32 (x and W both widened): routing is sensitive to ties.
        return ops.linear(x.float(), self.weight.float(), ops_config)


class GroupedTopKMoE(nn.Module):
    """DeepSeek-V3 MoE: sigmoid scores, group-limited top-k (noaux_tc), weights renormalised and
    times routed_scaling_factor, plus the always-on shared experts.

    Hy3 is the case n_group = topk_group = 1 (the one group is always kept, so the choice is the
    top-k of sigmoid + bias over all experts, as HF's HYV3TopKRouter), with
    ``enable_moe_fp32_combine``: routed + shared added in fp32 and cast back, as HF's HYV3MoE
    writes it. Both operands are already in the activation dtype, so for bf16 this is bitwise the
    plain add (torch adds bf16 in fp32 and rounds once); it is kept for fp16 and for the record.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.fp32_combine = config.enable_moe_fp32_combine
        self.gate = GroupedTopKRouter(config.num_experts, config.hidden_size)
        self.experts = FusedExperts(config.num_experts, config.hidden_size,
                                    config.moe_intermediate_size, parallel)
        # Partial sums: added to the routed partial before the layer's one all-reduce.
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                     parallel, reduce_results=False)
            if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor, ops_config: OpsConfig,
                token_mask: torch.Tensor | None = None,
                on_routing: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``on_routing(ids [T, k])``: told the chosen experts (routing replay)."""
        c = self.config
        router_logits = self.gate(x, ops_config)
        weights, ids = ops.grouped_topk(
            router_logits, self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, ops_config)
        if on_routing is not None:
            on_routing(ids)
        out = self.experts(x, weights, ids, ops_config, token_mask)
        if self.shared_experts is not None:
            shared = self.shared_experts(x, ops_config)
            out = ((out.float() + shared.float()).to(out.dtype) if self.fp32_combine
                   else out + shared)
        return self.parallel.all_reduce(out, ops_config.mode)
