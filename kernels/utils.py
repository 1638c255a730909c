"""Small helpers shared by the kernel launchers: argument checks and interpreter detection."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreter() -> bool:
    """True when Triton runs kernels through its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Whether bf16 tiles must be upcast to fp32 before ``tl.dot``.

    The interpreter (triton 3.9, numpy backed) returns garbage for bf16 ``tl.dot`` while fp16 and
    fp32 are exact (DESIGN.md, "Testing where there is no GPU"). On a GPU this is always False, so
    it never changes the reduction order there.
    """
    return is_interpreter() and dtype == torch.bfloat16


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one launcher argument; raise ValueError naming it and what was expected."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({allowed}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {tensor.stride()})")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected stride 1 in the last dim, got strides {tensor.stride()}"
        )
    return tensor


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it. ValueError names the odd one out."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name}: expected device {first.device} (as {first_name}), got {tensor.device}"
            )
    return first.device


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """Exact shape check; -1 in ``expected`` matches any size."""
    shape = tuple(tensor.shape)
    ok = len(shape) == len(expected) and all(
        e in (-1, s) for s, e in zip(shape, expected, strict=True)
    )
    if not ok:
        want = tuple("*" if e == -1 else e for e in expected)
        raise ValueError(f"{name}: expected shape {want}, got {shape}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
