"""The trainer's path through the layers: each op's engine kernel in the forward, the gradient of
a plain torch reference of the same op in the backward.

``OpsConfig.differentiable`` (``corun.training``) turns it on. Every op of ``models.ops`` that a
trainer's forward reaches is declared with ``@differentiable(reference, inputs)``: with autograd
recording and the flag on, the call becomes one ``torch.autograd.Function`` whose forward runs
the op itself under ``no_grad`` (so its outputs are the engine's bits, whatever the kernels'
reduction order) and whose backward evaluates ``reference`` at the saved ``inputs`` with autograd
and returns its gradients. The references compute the op's math in torch (fp32 where the op
accumulates in fp32); the backward is that of the function the kernels compute, not of their
rounding, as in any mixed-precision trainer. Without the flag (or under ``no_grad``) an op is
called as it is: the engine pays nothing.

Arguments that are not ``inputs`` (positions, block tables, routing ids, caches written in
place) are passed through untouched and get no gradient.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kernels import reference as ref


class _EngineOp(torch.autograd.Function):
    """forward(run, reference, needs_out, *inputs) -> run(*inputs); backward: the gradient of
    reference(*inputs) (given the forward's outputs too when ``needs_out``)."""

    @staticmethod
    def forward(ctx, run: Callable, reference: Callable, needs_out: bool,
                *inputs: torch.Tensor | None):
        with torch.no_grad():
            out = run(*inputs)
        ctx.reference, ctx.needs_out = reference, needs_out
        outs = out if isinstance(out, tuple) else (out,)
        ctx.out = tuple(o.detach() for o in outs) if needs_out else None
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        saved = ctx.saved_tensors
        wanted = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            inputs = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip(saved, wanted, strict=True)]
            kwargs = {"_out": ctx.out} if ctx.needs_out else {}
            out = ctx.reference(*inputs, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if g is not None and o.requires_grad]
        targets = [t for t in inputs if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                         allow_unused=True) if pairs and targets else ())
        grads_in = [next(found) if t is not None and t.requires_grad else None for t in inputs]
        return (None, None, None, *grads_in)


def _ops_config(arguments: dict) -> object:
    if "ops" in arguments:
        return arguments["ops"]
    return arguments["batch"].ops


def differentiable(reference: Callable, inputs: Sequence[str],
                   needs_out: bool = False) -> Callable[[Callable], Callable]:
    """Declare an op of ``models.ops`` differentiable: ``reference`` takes the op's arguments
    (by name, ``inputs`` replaced by autograd leaves; ``_out=`` the forward's outputs when
    ``needs_out``) and returns what the op returns, differentiably."""

    def wrap(op: Callable) -> Callable:
        signature = inspect.signature(op)

        @functools.wraps(op)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if not (getattr(_ops_config(arguments), "differentiable", False)
                    and torch.is_grad_enabled()):
                return op(*args, **kwargs)
            tensors = [arguments[name] for name in inputs]

            def with_inputs(fn: Callable, *values, **extra):
                return fn(**{**arguments, **dict(zip(inputs, values, strict=True)), **extra})

            return _EngineOp.apply(functools.partial(with_inputs, op),
                                   functools.partial(with_inputs, reference), needs_out,
                                   *tensors)

        return call

    return wrap


# ---------------------------------------------------------------------------------------------
# references: what each op computes, as differentiable torch
# ---------------------------------------------------------------------------------------------


def linear_reference(x, weight, ops, bias=None):
    return F.linear(x, weight, bias)


def bmm_reference(x, weight, ops):
    return torch.matmul(x, weight.transpose(1, 2))


def rmsnorm_reference(x, weight, eps, ops, residual=None):
    return ref.rmsnorm_reference(x, weight, eps, residual)


def silu_mul_reference(x, ops):
    return ref.silu_mul_reference(x)


def rope_reference(q, k, positions, cos_sin_cache, is_neox, ops):
    return ref.rope_reference(q, k, positions, cos_sin_cache, is_neox)


def causal_attention_reference(q, k, v, k_cache, v_cache, batch, scale):
    """Causal attention of each whole sequence of a prefill batch over its own q, k, v (a
    trainer's batch: every chunk is its sequence from position 0), GQA, fp32 softmax."""
    out = []
    for start, end in _whole_sequences(batch):
        qb, kb, vb = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        attn = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                              enable_gqa=True)
        out.append(attn.transpose(0, 1).to(q.dtype))
    tail = q.shape[0] - sum(o.shape[0] for o in out)  # a packed step's padding rows: zeros
    return torch.cat([*out, q.new_zeros(tail, *q.shape[1:])])


def _whole_sequences(batch) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a trainer's prefill batch, which must hold whole
    sequences (no cached prefix, no decode tokens)."""
    if not batch.is_prefill or batch.num_decode_tokens:
        raise ValueError("batch: a differentiable forward runs prefill batches of whole "
                         "sequences")
    cu, lengths = batch.cu_seqlens_q.tolist(), batch.context_lens.tolist()
    for b in range(len(cu) - 1):
        if cu[b + 1] - cu[b] != lengths[b]:
            raise ValueError(f"batch: sequence {b} has {lengths[b] - (cu[b + 1] - cu[b])} "
                             f"cached tokens before its chunk; a differentiable forward runs "
                             f"whole sequences")
    return list(zip(cu[:-1], cu[1:], strict=True))


def mla_attention_reference(q_latent, q_pe, latent, k_pe, kv_cache, batch, scale):
    """MLA's absorbed causal attention of each whole sequence in fp32: scores over the latent
    and the rope part, softmax, the latent rows weighted -> [T, H, Lkv]."""
    out = []
    for start, end in _whole_sequences(batch):
        ql, qp = q_latent[start:end].float(), q_pe[start:end].float()
        c, kp = latent[start:end].float(), k_pe[start:end].float()
        scores = (torch.einsum("lhd,sd->hls", ql, c) + torch.einsum("lhr,sr->hls", qp, kp))
        causal = torch.ones(end - start, end - start, dtype=torch.bool,
                            device=q_latent.device).tril()
        probs = torch.softmax((scores * scale).masked_fill(~causal, float("-inf")), dim=-1)
        out.append(torch.einsum("hls,sd->lhd", probs, c).to(q_latent.dtype))
    tail = q_latent.shape[0] - sum(o.shape[0] for o in out)
    return torch.cat([*out, q_latent.new_zeros(tail, *q_latent.shape[1:])])


def softmax_topk_reference(router_logits, top_k, renormalize, ops, _out):
    """The routing weights of the experts the forward chose (``_out``'s ids)."""
    ids = _out[1].long()
    weights = torch.softmax(router_logits.float(), dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, _out[1]


def grouped_topk_reference(router_logits, correction_bias, top_k, n_group, topk_group,
                           renormalize, routed_scaling_factor, ops, _out):
    """DeepSeek-V3 / Hy3 routing weights of the chosen experts: unbiased sigmoid scores."""
    ids = _out[1].long()
    weights = torch.sigmoid(router_logits.float()).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, _out[1]


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids, ops, token_mask=None):
    """Routed experts, one product per expert over its (token, rank) pairs, each expert's
    output in x's dtype, combined over the ranks in fp32."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    pair_out = []
    order = []
    for expert in torch.unique(flat_ids).tolist():
        rows = torch.nonzero(flat_ids == expert).squeeze(1)
        hidden = ref.silu_mul_reference(F.linear(x[tokens[rows]], w13[expert]))
        pair_out.append(F.linear(hidden, w2[expert]))
        order.append(rows)
    per_pair = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    if order:
        per_pair = per_pair.index_copy(0, torch.cat(order), torch.cat(pair_out))
    weights = topk_weights.float()
    if token_mask is not None:
        weights = weights * token_mask.view(-1, 1).float()
    out = (weights.unsqueeze(-1) * per_pair.view(num_tokens, top_k, -1).float()).sum(dim=1)
    return out.to(x.dtype)
