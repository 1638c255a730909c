"""Meta-device construction, materialisation on the target device, and seeded random weights.

A model is built on the ``meta`` device (no memory), moved to its dtype and materialised with
``to_empty`` directly on the target device, so a 60 GB random-weight model never passes through
host memory. Derived fp32 buffers (RoPE tables, router correction bias) are then recomputed by
each module's ``init_buffers``.

Random weights are drawn from a ``torch.Generator`` on the target device seeded by ``seed``, with
scales chosen so activations stay O(1) through every layer in bf16: matrices ~ N(0, fan_in^-1)
(unit gain), the residual-branch outputs (o_proj, down_proj) further scaled by (2 L)^-1/2 so the
residual stream grows like sqrt of depth at most, norm weights 1, biases 0. Logits then have
roughly unit spread: finite and varied, not degenerate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.layers.norm import RMSNorm

RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Meta-built ``model`` -> uninitialised storage of ``dtype`` on ``device``, buffers rebuilt."""
    model.to(dtype=dtype)
    model.to_empty(device=device)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model


@torch.no_grad()
def init_random_weights(model: nn.Module, num_layers: int, seed: int) -> None:
    """Fill every parameter from one generator seeded by ``seed`` (same seed and device, same
    bits)."""
    first = next(model.parameters())
    generator = torch.Generator(device=first.device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    residual_scale = 1.0 / math.sqrt(2 * max(num_layers, 1))
    for name, param in model.named_parameters():  # tied parameters appear once
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            std = param.shape[-1] ** -0.5
            if any(part in RESIDUAL_OUTPUTS for part in name.split(".")):
                std *= residual_scale
            param.normal_(0.0, std, generator=generator)
