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

Tensor parallelism: a sharded parameter declares its ``ShardLayout`` (the TP=1 shape and which
pieces of that full tensor this rank holds). Random weights draw the *full* tensor per parameter,
in the TP=1 order from the same generator, and keep this rank's pieces, so every rank holds the
shard of the very weights a TP=1 build draws (transient memory: the largest full parameter). The
loader reads the same layout to narrow each checkpoint tensor to the rank's slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.layers.norm import RMSNorm

RESIDUAL_OUTPUTS = ("o_proj", "down_proj")

Index = tuple[slice, ...]


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's parameter comes from: ``local[local_index] = full[full_index]`` for each
    piece, ``full`` being the TP=1 parameter of ``full_shape``. Local elements no piece covers
    (a padded vocab shard's tail) are zeros."""

    full_shape: tuple[int, ...]
    pieces: tuple[tuple[Index, Index], ...]


def replicated(param: torch.Tensor) -> ShardLayout:
    return ShardLayout(tuple(param.shape), (((), ()),))


def shard_layout(module: nn.Module, leaf: str, param: torch.Tensor) -> ShardLayout:
    """A module's declared layout of parameter ``leaf`` (``shard_layout(leaf)``), else
    replicated."""
    declare = getattr(module, "shard_layout", None)
    layout = declare(leaf) if callable(declare) else None
    return layout if layout is not None else replicated(param)


def parameter_layouts(model: nn.Module) -> dict[str, ShardLayout]:
    """name -> ShardLayout of every parameter (tied parameters once, as named_parameters)."""
    owners = dict(model.named_modules())
    layouts = {}
    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        layouts[name] = shard_layout(owners[prefix], leaf, param)
    return layouts


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
    bits); a tensor-parallel rank gets its pieces of the same full tensors as TP=1."""
    first = next(model.parameters())
    generator = torch.Generator(device=first.device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    residual_scale = 1.0 / math.sqrt(2 * max(num_layers, 1))
    layouts = parameter_layouts(model)
    for name, param in model.named_parameters():  # tied parameters appear once
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            layout = layouts[name]
            std = layout.full_shape[-1] ** -0.5  # the fan-in of the full matrix
            if any(part in RESIDUAL_OUTPUTS for part in name.split(".")):
                std *= residual_scale
            if layout == replicated(param):
                param.normal_(0.0, std, generator=generator)
                continue
            full = torch.empty(layout.full_shape, dtype=param.dtype, device=param.device)
            full.normal_(0.0, std, generator=generator)
            param.zero_()
            for local_index, full_index in layout.pieces:
                param[local_index] = full[full_index]


# Elements one digest chunk widens to int64 at once (256 MiB of int64 temporaries).
_DIGEST_CHUNK = 1 << 25
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden-ratio bits as a signed int64


@torch.no_grad()
def tensor_digest(tensor: torch.Tensor) -> tuple[int, int]:
    """An integer digest of a tensor's bits, computed where it lives: with ``b_i`` the i-th
    element's bits widened to int64, ``(sum_i b_i (2i + 1), sum_i b_i h(i))`` mod 2**64 (``h`` an
    odd multiplicative hash), as ``corun.fingerprint``'s logits digest. Exact integer sums: the
    order of addition does not matter."""
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
        flat.element_size()])
    d1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    d2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    golden = torch.tensor(_GOLDEN, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        chunk = bits[start:start + _DIGEST_CHUNK].to(torch.int64)
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        d1 += (chunk * (2 * index + 1)).sum()
        d2 += (chunk * ((index * golden + 1) | 1)).sum()
    return int(d1), int(d2)


def _bytes_digest(tensor: torch.Tensor) -> str:
    """blake2b of a CPU tensor's bytes (read in place: ~1 GB/s, several times the int64 sums)."""
    import hashlib

    flat = tensor.detach().contiguous().view(-1)
    flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[
        flat.element_size()])
    return hashlib.blake2b(memoryview(flat.numpy()), digest_size=16).hexdigest()


def weights_digest(model: nn.Module) -> str:
    """sha256 (hex) over every parameter and persistent buffer of ``model``: name, shape, dtype
    and the digest of its bits (on a GPU ``tensor_digest``, computed in place; on the CPU a hash
    of its bytes). Equal for two models on one kind of device exactly when their weights have
    the same bits (up to collisions), however they were made: drawn, loaded or updated."""
    import hashlib

    owners = dict(model.named_modules())
    tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in owners[prefix]._non_persistent_buffers_set:
            tensors[name] = buffer
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        bits = tensor_digest(tensor) if tensor.is_cuda else _bytes_digest(tensor)
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{bits}".encode())
    return h.hexdigest()
